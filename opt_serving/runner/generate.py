"""Hugging Face's generate() for every plan, over the runner's stages: the stage objects the engine steps
(runner.stage.StageSlots, in this process or in Ray actors).

`Generation` is generate()'s front (every argument, the sampling settings, scores, return_dict_in_generate) and
the one loop that runs it, whatever the plan:
- **One stage** (a model on one device or one tensor-parallel mesh) holds the whole model: its `seq_generate` and
  `seq_beam_search` run the whole search as one compiled on-device loop (model/sample.py, model/beam_search.py),
  with no host round trip per token.
- **Several stages** (a pipeline): a loop on the host. Each stage keeps whole-sequence caches of its own layers
  (its seq_* calls, runner.types.STAGE_CALLS); the rows (beam search: the prompts, each with its beams) split into
  micro-batches that are in flight together; the tokens are chosen here from the last stage's logits by the same
  jitted `sample.pick_tokens` and `beam_search.beam_step`; every stage reorders its cache rows after a beam step.
"""
from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import choose, sampling
from opt_serving.config import OPTConfig
from opt_serving.model import beam_search, kv_cache, opt, sample
from opt_serving.model import lora as lora_model
from opt_serving.model.lora_config import LoraConfig
from opt_serving.model.peft import LoraAdapter
from opt_serving.model.wrapper import OPTModel
from opt_serving.runner import speculative
from opt_serving.runner.stage import LocalStages, StageSlots


def one_adapter(adapter: LoraAdapter) -> LoraConfig:
    """The LoRA slots of a model that runs one adapter: one, of its rank, on its targets."""
    return LoraConfig(1, adapter.rank, adapter.targets)


def use_adapter(stages, cfg: OPTConfig, adapter: LoraAdapter) -> None:
    """Every stage (made with one_adapter's slots) holds its share of `adapter` in slot 0, which generate()'s rows
    use."""
    layouts = stages.get([stages.call(i, "lora_layout") for i in range(stages.n)])
    stages.get([stages.call(i, "set_lora", 0, lora_model.slot_part(adapter, cfg, layout), True)
                for i, layout in enumerate(layouts)])


@dataclasses.dataclass
class GenerateOutput:
    """HF's GenerateDecoderOnlyOutput / GenerateBeamDecoderOnlyOutput fields we fill."""
    sequences: Any
    scores: tuple | None = None
    sequences_scores: Any = None


def prepare_inputs(cfg: OPTConfig, input_ids, attention_mask, max_length, max_new_tokens):
    """generate()'s inputs checked and as int32 numpy: (ids [B, S], mask [B, S], max_new_tokens, is_torch)."""
    is_torch = type(input_ids).__module__.startswith("torch")
    ids = np.asarray(input_ids.cpu().numpy() if is_torch else input_ids, np.int32)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq > 0, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"input_ids must lie in [0, {cfg.vocab_size}), got {ids.min()}..{ids.max()}")
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = np.asarray(attention_mask.cpu().numpy() if hasattr(attention_mask, "cpu")
                          else attention_mask, np.int32)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    s = ids.shape[1]
    if max_new_tokens is None:
        max_new_tokens = (max_length if max_length is not None else 20) - s
    if max_new_tokens < 1:
        raise ValueError(f"nothing to generate: the prompt has {s} tokens and max_length is "
                         f"{max_length}; set max_new_tokens")
    if s + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({s} tokens) + {max_new_tokens} new tokens exceeds the model's "
                         f"limit of {cfg.max_position_embeddings} positions")
    return ids, mask, max_new_tokens, is_torch


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st):
    """beam_search.beam_step, jitted on its own: the driver runs it between pipelined decodes."""
    return beam_search.beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st)


def _rows(tree, rows):
    return jax.tree_util.tree_map(lambda a: a[rows] if getattr(a, "ndim", 0) else a, tree)


class Generation:
    """generate() over `stages` (runner.stage.Stages: one stage in this process, a pipeline's Ray actors or stages
    in this process), keeping `micro_batches` groups of rows in flight over a pipeline. `model`: the OPTModel a
    one-stage generation runs (its params, its steps). `close()` (or dropping the model) frees the stages (Ray's:
    the actors and their placement group)."""

    def __init__(self, cfg: OPTConfig, stages, plan=None, micro_batches: Optional[int] = None,
                 model: Optional[OPTModel] = None):
        self.config, self.stages, self.plan, self.model = cfg, stages, plan, model
        self.micro_batches = micro_batches or stages.n
        # a pipeline: this process picks the tokens from the logits the last stage sends back
        self.argmax = choose(jax.devices()[:1], jnp.float32).argmax
        self._keys = itertools.count()
        self.last_speculation: Optional[speculative.SpeculationStats] = None  # the last speculative generate()'s

    @classmethod
    def of(cls, model: OPTModel, lora: Optional[LoraAdapter] = None) -> "Generation":
        """generate() for a model on one device or one tensor-parallel mesh: one stage in this process over its
        params (no copy), holding no slots' cache (a row of the smallest window). `lora`: an adapter every row
        runs with (its low-rank products beside the base weights: model/lora.py)."""
        stage = StageSlots(model.config, model.fused_params, opt.StageSpec.whole(model.config), rows=1,
                           backend=model.backend, lora=None if lora is None else one_adapter(lora))
        generation = cls(model.config, LocalStages([stage]), model.plan, model=model)
        if lora is not None:
            use_adapter(generation.stages, model.config, lora)
        return generation

    # a model in this process: its OPTModel's (a pipeline's weights live in its stage actors)
    def _local(self) -> OPTModel:
        if self.model is None:
            raise AttributeError("a pipelined model's weights live in its stage actors")
        return self.model

    params = property(lambda self: self._local().params, doc="the params in the checkpoint's layout, a new tree")
    fused_params = property(lambda self: self._local().fused_params, doc="the params in their runtime layout")
    backend = property(lambda self: self._local().backend, doc="the backend.Backend the steps run on")
    dtype = property(lambda self: self._local().dtype, doc="the params' dtype")
    mesh = property(lambda self: self._local().mesh, doc="the tensor-parallel mesh (None on one device)")

    def _sample(self, ids, mask, st, max_new, new_bucket, pad, output_scores):
        """-> (history [B, S + new_bucket], steps taken, processed scores [new_bucket, B, V] or [0, ...])"""
        if self.stages.n == 1:  # the whole model on one stage: one compiled loop there
            return self.stages.get(self.stages.call(0, "seq_generate", ids, mask, st, max_new, new_bucket, pad,
                                                    output_scores))
        return self._host_sample(ids, mask, st, max_new, new_bucket, pad, output_scores)

    def _beams(self, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad, output_scores,
               should_stop=None):
        """-> ((seqs, beam_idx) of the n_return best per prompt, scores [max_new, B*K, V], beam scores);
        SearchStopped when `should_stop()` is true before a step"""
        if self.stages.n > 1:
            return self._host_beams(ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad,
                                    output_scores, should_stop)
        # the compiled loop asks about the search through its token, in this process (a one-stage model is here)
        with beam_search.stoppable(should_stop) as token:
            out = self.stages.get(self.stages.call(0, "seq_beam_search", ids, mask, st, max_new, k, n_return,
                                                   length_penalty, early_stop, eos, pad, output_scores, token))
            jax.block_until_ready(out)  # the loop asks about `token` while it runs: keep it registered till then
        beam_search.check_stop(should_stop)
        return out

    def generate(self, input_ids=None, attention_mask=None, max_length=None, max_new_tokens=None,
                 min_length=None, min_new_tokens=None, do_sample=False, temperature=1.0, top_k=50,
                 top_p=1.0, num_beams=1, num_return_sequences=1, repetition_penalty=1.0,
                 no_repeat_ngram_size=0, bad_words_ids=None, eos_token_id=None, pad_token_id=None,
                 output_scores=False, return_dict_in_generate=False, seed=None,
                 length_penalty=1.0, early_stopping=False, should_stop=None, assistant_model=None,
                 prompt_lookup_num_tokens=None, num_assistant_tokens=None, num_assistant_tokens_schedule="adaptive",
                 max_matching_ngram_size=2, **unused):
        """transformers' generate(). Beyond it: `should_stop`, a function asked before every step of a beam
        search (num_beams > 1); once it returns True the search ends at once with
        beam_search.SearchStopped (a server stops the search of a client that has gone).

        Speculative decoding, as transformers' assisted generation (one sequence; runner/speculative.py):
        `assistant_model` (a jax/ or alpa/ model with the same tokenizer) drafts `num_assistant_tokens` (4) a
        round, or `prompt_lookup_num_tokens` are drafted from the sequence's earlier n-grams (up to
        `max_matching_ngram_size`). `num_assistant_tokens_schedule`: "adaptive" (each round's draft length from
        the acceptance rate and measured costs, none while that does not pay) or "constant"; `last_speculation`
        holds the figures."""
        if unused:
            raise TypeError(f"generate() got unsupported arguments: {sorted(unused)}")
        if assistant_model is not None or prompt_lookup_num_tokens:
            return self._generate_speculative(
                input_ids, attention_mask, max_length, max_new_tokens, min_length, min_new_tokens, do_sample,
                temperature, top_k, top_p, num_beams, num_return_sequences, eos_token_id, output_scores,
                return_dict_in_generate, seed, assistant_model, prompt_lookup_num_tokens, num_assistant_tokens,
                num_assistant_tokens_schedule, max_matching_ngram_size,
                dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                     bad_words_ids=bad_words_ids))
        cfg = self.config
        ids, mask, max_new_tokens, is_torch = prepare_inputs(cfg, input_ids, attention_mask,
                                                             max_length, max_new_tokens)
        b, s = ids.shape
        eos = cfg.eos_token_id if eos_token_id is None else int(eos_token_id)
        pad = (cfg.pad_token_id if cfg.pad_token_id is not None else eos) \
            if pad_token_id is None else int(pad_token_id)
        if do_sample and temperature <= 0:
            raise ValueError(f"do_sample needs temperature > 0, got {temperature}")
        if seed is None:
            seed = int(np.random.randint(0, 2 ** 31))
        settings = dict(
            temperature=temperature if do_sample else 0.0,
            top_k=(top_k or 0) if do_sample else 0, top_p=top_p if do_sample else 1.0,
            repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size or 0,
            min_length=min_length or 0, min_new_tokens=min_new_tokens or 0, eos_token_id=eos,
            bad_words_ids=bad_words_ids)
        if num_beams > 1:
            if do_sample:
                raise NotImplementedError("beam sampling (num_beams > 1 with do_sample) is not supported")
            seqs, scores, seq_scores, n_steps = self._generate_beams(
                ids, mask, settings, seed, max_new_tokens, num_beams, num_return_sequences, length_penalty,
                early_stopping, eos, pad, output_scores, should_stop)
        else:
            if num_return_sequences > 1 and not do_sample:
                raise ValueError("greedy search returns one sequence per prompt; "
                                 "use do_sample or num_beams for num_return_sequences > 1")
            seqs, scores, n_steps = self._generate_samples(ids, mask, settings, seed, max_new_tokens,
                                                           num_return_sequences, pad, output_scores)
            seq_scores = None
        return _outputs(seqs, scores, seq_scores, n_steps, is_torch, output_scores, return_dict_in_generate)

    def _generate_speculative(self, input_ids, attention_mask, max_length, max_new_tokens, min_length,
                              min_new_tokens, do_sample, temperature, top_k, top_p, num_beams, num_return_sequences,
                              eos_token_id, output_scores, return_dict_in_generate, seed, assistant_model,
                              prompt_lookup_num_tokens, num_assistant_tokens, schedule, max_ngram, unsupported):
        """generate() with an assistant model or prompt lookup (runner/speculative.py) -> its usual outputs."""
        cfg = self.config
        ids, mask, max_new_tokens, is_torch = prepare_inputs(cfg, input_ids, attention_mask, max_length,
                                                             max_new_tokens)
        if assistant_model is not None and prompt_lookup_num_tokens:
            raise ValueError("give assistant_model or prompt_lookup_num_tokens, not both")
        if ids.shape[0] != 1 or not mask.all():
            raise ValueError(f"speculative decoding (assistant_model, prompt_lookup_num_tokens) continues one "
                             f"unpadded sequence, as transformers' assisted generation; got {ids.shape[0]} rows"
                             + ("" if mask.all() else " with padding"))
        off = {"num_beams": num_beams > 1, "num_return_sequences": num_return_sequences > 1,
               "output_scores": bool(output_scores), "repetition_penalty": unsupported["repetition_penalty"] != 1.0,
               "no_repeat_ngram_size": bool(unsupported["no_repeat_ngram_size"]),
               "bad_words_ids": bool(unsupported["bad_words_ids"])}
        if any(off.values()):
            raise NotImplementedError("speculative decoding does not take " +
                                      ", ".join(n for n, on in off.items() if on))
        if schedule not in ("adaptive", "constant"):
            raise ValueError(f"num_assistant_tokens_schedule must be 'adaptive' or 'constant', got {schedule!r}")
        if do_sample and temperature <= 0:
            raise ValueError(f"do_sample needs temperature > 0, got {temperature}")
        if assistant_model is not None:
            if not isinstance(assistant_model, Generation):
                raise TypeError(f"assistant_model must be a jax/ or alpa/ model (get_model), got "
                                f"{type(assistant_model).__name__}")
            if assistant_model.config.vocab_size != cfg.vocab_size:
                raise ValueError(f"the assistant's vocabulary ({assistant_model.config.vocab_size} tokens) is not "
                                 f"the model's ({cfg.vocab_size}): they must share the tokenizer")
            drafter, k = speculative.ModelDrafter(assistant_model), num_assistant_tokens or 4
        else:
            drafter, k = speculative.PromptLookup(max_ngram), int(prompt_lookup_num_tokens)
        if k < 1:
            raise ValueError(f"the draft length must be at least 1, got {k}")
        eos = cfg.eos_token_id if eos_token_id is None else int(eos_token_id)
        settings = dict(temperature=temperature if do_sample else 0.0, top_k=(top_k or 0) if do_sample else 0,
                        top_p=top_p if do_sample else 1.0, min_new_tokens=min_new_tokens or 0,
                        min_length=min_length or 0)
        seed = int(np.random.randint(0, 2 ** 31)) if seed is None else seed
        seq, self.last_speculation = speculative.generate(self, drafter, ids[0], max_new_tokens, settings, eos, seed,
                                                          k, adaptive=schedule == "adaptive")
        n_steps = len(seq) - ids.shape[1]
        return _outputs(seq[None], None, None, n_steps, is_torch, False, return_dict_in_generate)

    def _generate_beams(self, ids, mask, settings, seed, max_new_tokens, num_beams, num_return_sequences,
                        length_penalty, early_stopping, eos, pad, output_scores, should_stop=None):
        """generate()'s beam search -> (sequences [B * n, S + steps], per-step scores, sequence scores, steps)."""
        b, s = ids.shape
        if num_return_sequences > num_beams:
            raise ValueError(f"num_return_sequences ({num_return_sequences}) > num_beams ({num_beams})")
        ids, mask = np.repeat(ids, num_beams, 0), np.repeat(mask, num_beams, 0)
        st = sampling.make_settings(b * num_beams, seed=seed, **settings)
        seqs, scores, seq_scores = self._beams(
            ids, mask, st, max_new_tokens, num_beams, num_return_sequences, float(length_penalty),
            bool(early_stopping is True), eos, pad, output_scores, should_stop=should_stop)
        seqs, beam_idx = np.asarray(seqs[0]), np.asarray(seqs[1])
        out_len = s + int(((beam_idx + 1) != 0).sum(1).max())
        return seqs[:, :out_len], scores, seq_scores, out_len - s

    def _generate_samples(self, ids, mask, settings, seed, max_new_tokens, n, pad, output_scores):
        """generate()'s greedy / sampled rows (n per prompt) -> (sequences, per-step scores, steps)."""
        cfg = self.config
        if n > 1:
            ids, mask = np.repeat(ids, n, 0), np.repeat(mask, n, 0)
        rows, s = ids.shape
        # bucket the prompt width (extra left pads) and the new-token budget so that
        # prompts of nearby lengths share one compiled loop
        sb = kv_cache.bucket_length(s, cfg.max_position_embeddings, min_bucket=8)
        extra = sb - s
        ids = np.concatenate([np.full((rows, extra), pad, np.int32), ids], 1)
        mask = np.concatenate([np.zeros((rows, extra), np.int32), mask], 1)
        if settings["min_length"]:  # HF's counts the history we lengthened
            settings = dict(settings, min_length=settings["min_length"] + extra)
        st = sampling.make_settings(rows, seed=np.asarray(seed) + np.arange(rows), **settings)
        new_bucket = kv_cache.bucket_length(max_new_tokens, 1 << 30)
        seqs, steps, scores = self._sample(ids, mask, st, max_new_tokens, new_bucket, pad, output_scores)
        n_steps = int(steps)
        return np.asarray(seqs)[:, extra:sb + n_steps], scores, n_steps

    @property
    def pipeline(self):  # the stage actors (tests, benchmarks)
        return self.stages

    def close(self) -> None:
        self.stages.close()

    shutdown = close

    def _chain(self, method: str, key, x, *rest):
        for i in range(self.stages.n):
            x = self.stages.call(i, "seq_" + method, key, x, *rest)
        return x

    def _open(self, batch: int, max_len: int):
        key = next(self._keys)
        self.stages.get([self.stages.call(i, "seq_open", key, batch, max_len) for i in range(self.stages.n)])
        return key

    def _close(self, keys) -> None:
        for key in keys:
            for i in range(self.stages.n):
                self.stages.call(i, "seq_close", key)

    def __call__(self, input_ids, attention_mask=None):
        """Full-sequence logits [B, S, V] (reference and tests)."""
        ids = np.asarray(input_ids, np.int32)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
        key = self._open(*ids.shape)
        try:
            return self.stages.get(self._chain("prefill", key, ids, mask, True))
        finally:
            self._close([key])

    def _groups(self, n: int) -> list[np.ndarray]:
        return [g for g in np.array_split(np.arange(n), min(self.micro_batches, n)) if len(g)]

    def _host_sample(self, ids, mask, st, max_new, new_bucket, pad, output_scores):
        """sample.search's contract over the stages: the rows in micro-batches, round-robin, so
        while one micro-batch's logits come back the others are in the stages."""
        b, s = ids.shape
        total = s + new_bucket
        runs = []
        try:
            for rows in self._groups(b):
                key = self._open(len(rows), total)
                runs.append(dict(rows=rows, key=key, st=_rows(st, rows), steps=0,
                                 state=sampling.init_state(ids[rows], mask[rows], self.config.vocab_size, total),
                                 unfinished=jnp.ones(len(rows), jnp.bool_), n_real=mask[rows].sum(1).astype(np.int32),
                                 ref=self._chain("prefill", key, ids[rows], mask[rows], False)))
            scores = np.zeros((new_bucket if output_scores else 0, b, self.config.vocab_size), np.float32)
            for i in range(max_new):
                for r in runs:
                    if r["ref"] is None:
                        continue
                    logits = self.stages.get(r["ref"])
                    tok, r["state"], r["unfinished"], sc = sample.pick_tokens(
                        jnp.asarray(logits), r["state"], r["st"], r["unfinished"], pad, self.argmax)
                    r["steps"], r["ref"] = i + 1, None
                    if output_scores:
                        scores[i, r["rows"]] = np.asarray(sc)
                    if i + 1 < max_new and bool(r["unfinished"].any()):
                        r["ref"] = self._chain("decode", r["key"], np.asarray(tok), r["n_real"] + i,
                                               np.full(len(r["rows"]), s + i, np.int32))
        finally:
            self._close([r["key"] for r in runs])
        steps = max(r["steps"] for r in runs)
        out = np.full((b, total), pad, np.int32)
        for r in runs:
            out[r["rows"], :s + r["steps"]] = np.asarray(r["state"].history)[:, :s + r["steps"]]
        return out, steps, scores

    def _host_beams(self, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad,
                    output_scores, should_stop=None):
        """beam_search.search's contract over the stages: prompts in micro-batches, each with its K
        beams; per step the logits come to the driver, `beam_step` picks the beams, every stage reorders
        its cache rows to follow them (Ray runs one caller's calls to an actor in order, so the next
        decode sees the reordered cache), and the next decode goes out."""
        bk, s = ids.shape
        b, total, v = bk // k, s + max_new, self.config.vocab_size
        fill = pad if pad else eos
        runs, scores = [], np.zeros((max_new if output_scores else 0, bk, v), np.float32)
        try:
            for items in self._groups(b):
                rows = (items[:, None] * k + np.arange(k)).reshape(-1)
                key = self._open(len(rows), total)
                runs.append(dict(items=items, rows=rows, key=key, c=beam_search.beam_init(
                    jnp.asarray(ids[rows]), jnp.asarray(mask[rows]), k, total, fill),
                    seen=sampling.init_state(ids[rows], mask[rows], v, total), st=_rows(st, rows),
                    n_real=mask[rows].sum(1).astype(np.int32),
                    ref=self._chain("prefill", key, ids[rows], mask[rows], False)))
            live = True
            while live:
                live = False
                for r in runs:
                    if r["ref"] is None:
                        continue
                    beam_search.check_stop(should_stop)  # before each micro-batch's step
                    cur = int(r["c"]["cur"])
                    r["c"], parents, last, go, lp = _beam_step(k, s, length_penalty, early_stop, eos,
                                                               jnp.asarray(self.stages.get(r["ref"])), r["c"],
                                                               r["seen"], r["st"])
                    r["ref"] = None
                    if output_scores:
                        scores[cur - s, r["rows"]] = np.asarray(lp)
                    if bool(go):
                        for i in range(self.stages.n):
                            self.stages.call(i, "seq_reorder", r["key"], np.asarray(parents))
                        r["ref"] = self._chain("decode", r["key"], np.asarray(last), r["n_real"] + (cur - s),
                                               np.full(len(r["rows"]), cur, np.int32))
                        live = True
        finally:
            self._close([r["key"] for r in runs])
        seqs = np.full((b * n_return, total), fill, np.int32)
        idx = np.full((b * n_return, max_new), -1, np.int32)
        best = np.zeros(b * n_return, np.float32)
        for r in runs:
            n = len(r["items"])
            out = (r["items"][:, None] * n_return + np.arange(n_return)).reshape(-1)
            seqs[out] = np.asarray(r["c"]["seqs"])[:, :n_return].reshape(n * n_return, total)
            idx[out] = np.asarray(r["c"]["beam_idx"])[:, :n_return].reshape(n * n_return, -1)
            best[out] = np.asarray(r["c"]["beam_scores"])[:, :n_return].reshape(-1)
        return (seqs, idx), scores, best


def _outputs(seqs, scores, seq_scores, n_steps, is_torch, output_scores, return_dict_in_generate):
    """generate()'s return value in HF's shapes (torch tensors for torch inputs)."""
    def out(x, dtype=None):
        if not is_torch:
            return x
        import torch
        return torch.from_numpy(np.array(x, dtype))
    seqs = out(seqs, np.int64)
    if not return_dict_in_generate:
        return seqs
    score_steps = tuple(out(x) for x in np.asarray(scores)[:n_steps]) if output_scores else None
    seq_scores = None if seq_scores is None else out(np.asarray(seq_scores))
    return GenerateOutput(sequences=seqs, scores=score_steps, sequences_scores=seq_scores)

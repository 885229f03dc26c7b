"""A Hugging Face style generate() for the Flax OPT (OPTModel, on one device or a tensor-parallel mesh;
runner/generate.py's StageGeneration, over pipeline stages, shares its front, `Generation`). `get_model`
(opt_serving/models.py) is reachable here, where notebooks have always imported it, and so are `PREFIXES`
(spec.py) and `resolve_numpy_folder` (weights.py).

generate() mirrors transformers 5.23 (`_sample` and the vectorised `_beam_search`, in beam_search.py)
so tokens match HF's; the whole decoding loop is one jitted `lax.while_loop`,
so there is no host round trip per token, and beam search reorders the cache on device.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import Backend, sampling
from opt_serving.config import OPTConfig
from opt_serving.model import beam_search, kv_cache, layout, opt
from opt_serving.model.weights import resolve_numpy_folder  # noqa: F401 (notebooks import it from here)
from opt_serving.parallel.sharding import ShardedOPT
from opt_serving.spec import PREFIXES  # noqa: F401 (notebooks import it from here)


@dataclasses.dataclass
class GenerateOutput:
    """HF's GenerateDecoderOnlyOutput / GenerateBeamDecoderOnlyOutput fields we fill."""
    sequences: Any
    scores: tuple | None = None
    sequences_scores: Any = None


def prepare_inputs(cfg: OPTConfig, input_ids, attention_mask, max_length, max_new_tokens):
    """generate()'s inputs checked and as int32 numpy: (ids [B, S], mask [B, S], max_new_tokens, is_torch).
    Shared by every backend's generate(), so they accept and refuse the same things."""
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


class Generation:
    """Hugging Face's generate() over a model's own decode loops: arguments, sampling settings and the
    returned shapes are this code for every plan; a subclass gives `_sample` and `_beams` (OPTModel:
    one compiled on-device loop; runner.generate.StageGeneration: a host loop over the stages, picking
    tokens with the same jitted `pick_tokens` and `beam_search.beam_step`)."""
    config: OPTConfig

    def _sample(self, ids, mask, st, max_new: int, new_bucket: int, pad: int, output_scores: bool):
        """-> (history [B, S + new_bucket], steps taken, processed scores [new_bucket, B, V] or [0, ...])"""
        raise NotImplementedError

    def _beams(self, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad, output_scores,
               should_stop=None):
        """-> ((seqs, beam_idx) of the n_return best per prompt, scores [max_new, B*K, V], beam scores);
        SearchStopped when `should_stop()` is true before a step"""
        raise NotImplementedError

    def generate(self, input_ids=None, attention_mask=None, max_length=None, max_new_tokens=None,
                 min_length=None, min_new_tokens=None, do_sample=False, temperature=1.0, top_k=50,
                 top_p=1.0, num_beams=1, num_return_sequences=1, repetition_penalty=1.0,
                 no_repeat_ngram_size=0, bad_words_ids=None, eos_token_id=None, pad_token_id=None,
                 output_scores=False, return_dict_in_generate=False, seed=None,
                 length_penalty=1.0, early_stopping=False, should_stop=None, **unused):
        """transformers' generate(). Beyond it: `should_stop`, a function asked before every step of a beam
        search (num_beams > 1); once it returns True the search ends at once with
        beam_search.SearchStopped (a server stops the search of a client that has gone)."""
        if unused:
            raise TypeError(f"generate() got unsupported arguments: {sorted(unused)}")
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
        if settings["min_length"]:
            settings = dict(settings, min_length=settings["min_length"] + extra)  # HF's counts the history we lengthened
        st = sampling.make_settings(rows, seed=np.asarray(seed) + np.arange(rows), **settings)
        new_bucket = kv_cache.bucket_length(max_new_tokens, 1 << 30)
        seqs, steps, scores = self._sample(ids, mask, st, max_new_tokens, new_bucket, pad, output_scores)
        n_steps = int(steps)
        return np.asarray(seqs)[:, extra:sb + n_steps], scores, n_steps

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


class OPTModel(Generation):
    """The Flax OPT on one device or one tensor-parallel mesh: params + config, the jitted steps, and generate()
    as one compiled on-device loop. Tensor parallelism is a layout of the params (parallel/sharding.py), not
    another model: over params sharded on `mesh`, GSPMD partitions the same programs."""

    def __init__(self, cfg: OPTConfig, params, backend: Backend | None = None, weights: str = "float32",
                 mesh=None, plan=None):
        """`params` in the checkpoint's layout; or, with the `backend` they were prepared for, already in
        its runtime layout (a slot runner's, shared: runner/slots.py). `weights`: how the dense layers run
        (Backend.weights): "int8" for model/quantize.py's params, "bfloat16" for float32 params whose
        products run in bfloat16 (get_model decides). `mesh`: the tp mesh sharded params lie on (the engine
        steps below then keep the cache sharded by heads); `plan`: the planner's plan it was built for."""
        self.config, self.mesh, self.plan = cfg, mesh, plan
        self.dtype = opt.param_dtype(params)
        if backend is None:  # q/k/v fused on one device, packed where the backend chosen for them packs
            backend, params = layout.runtime_params(params, weights=weights)
        # the steps and generate() run these
        self.backend, self.fused_params = backend, params
        self._sharded = None if mesh is None else ShardedOPT(cfg, params, mesh, backend=backend)

    @property
    def params(self):
        """The params in the checkpoint's layout (q_proj / k_proj / v_proj, plain kernels), as a new tree."""
        return layout.checkpoint_params(self.config, self.backend, self.fused_params)

    # engine-facing pass-throughs
    def init_cache(self, batch: int, max_len: int):
        if self._sharded is not None:
            return self._sharded.init_cache(batch, max_len)
        return kv_cache.init_cache(self.config, batch, max_len, opt.cache_dtype(self.fused_params, self.backend))

    def prefill(self, cache, input_ids, attention_mask, all_logits=True):
        if self._sharded is not None:
            return self._sharded.prefill(cache, input_ids, attention_mask, all_logits)
        return opt.prefill(self.config, self.fused_params, cache, input_ids, attention_mask,
                           all_logits=all_logits, backend=self.backend)

    def decode(self, cache, tokens, positions, write_index):
        if self._sharded is not None:
            return self._sharded.decode(cache, tokens, positions, write_index)
        return opt.decode(self.config, self.fused_params, cache, tokens, positions, write_index,
                          backend=self.backend)

    def __call__(self, input_ids, attention_mask=None):
        return opt.forward(self.config, self.fused_params, input_ids, attention_mask, self.backend)

    def _sample(self, ids, mask, st, max_new, new_bucket, pad, output_scores):
        return _sample_loop(self.config, self.fused_params, jnp.asarray(ids), jnp.asarray(mask), st,
                            jnp.int32(max_new), new_bucket, pad, output_scores, self.backend)

    def _beams(self, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad, output_scores,
               should_stop=None):
        with beam_search.stoppable(should_stop) as token:
            out = beam_search.search(self.config, self.fused_params, jnp.asarray(ids), jnp.asarray(mask), st,
                                     max_new, k, n_return, length_penalty, early_stop, eos, pad, output_scores,
                                     self.backend, None if token is None else jnp.int32(token))
            jax.block_until_ready(out)  # the loop asks about `token` while it runs: keep it registered till then
        beam_search.check_stop(should_stop)
        return out


def processed_choice(logits, state, st, argmax=sampling.argmax):
    """HF's logits processors and warpers over logits [B, V], then each row's greedy or sampled token ->
    (tokens [B], the processed scores [B, V]: what output_scores returns)."""
    scores = sampling.warp(sampling.process_logits(logits, state, st), st)
    return sampling.choose(scores, state, st, argmax), scores


def append_tokens(tok, state, st, unfinished, pad):
    """Finished rows get `pad`; the tokens join the history; a row finishes at its EOS."""
    tok = jnp.where(unfinished, tok, pad)
    state = sampling.update_state(state, tok)
    return tok, state, unfinished & (tok != st.eos_token_id)


@partial(jax.jit, static_argnames=("argmax",))
def pick_tokens(logits, state, st, unfinished, pad, argmax=sampling.argmax):
    """One generate() step's choice from the next-token logits [B, V], as a jitted function of its own
    (a host loop's, e.g. over pipeline stages) -> (tokens, state, unfinished, processed scores)."""
    tok, scores = processed_choice(logits, state, st, argmax)
    return (*append_tokens(tok, state, st, unfinished, pad), scores)


def decode_windows(prompt_len: int, total: int) -> list[int]:
    """The cache sizes a generation of `total` positions runs through: powers of two from the
    first that holds the prompt, then `total`. A decode step's cost is reading its cache, so
    rows 20 tokens long should not read a cache sized for 72."""
    first = kv_cache.bucket_length(prompt_len + 1, total)
    windows = [first]
    while windows[-1] < total:
        windows.append(min(windows[-1] * 2, total))
    return windows


@partial(jax.jit, static_argnums=(0, 6, 7, 8, 9))
def _sample_loop(cfg, params, ids, mask, st, max_new, new_bucket, pad, output_scores, backend: Backend):
    """HF `_sample`: greedy or sampled rows, finished rows filled with pad; stops when all are done.

    `max_new` is traced; buffers are sized by the static `new_bucket` >= max_new. The cache
    starts at the smallest window holding the prompt and grows a window at a time
    (decode_windows): one decode loop per window. With the backend's attention kernel, which
    reads only the entries written so far, the cache is full-size from the start and there is
    one loop.

    Steps where every row takes the plain argmax (sampling.plain_argmax) go through opt.lm_argmax: no
    sampling processors, and with the backend's screened greedy head not even the logits."""
    b, s = ids.shape
    total = s + new_bucket
    windows = [total] if backend.attention else decode_windows(s, total)
    n_real = jnp.sum(mask, axis=1).astype(jnp.int32)
    h, cache = opt.start(cfg, params, ids, mask, windows[0] - s, backend, return_hidden=True)
    state = sampling.init_state(ids, mask, cfg.vocab_size, total)
    scores_buf = jnp.zeros((new_bucket if output_scores else 0, b, cfg.vocab_size), jnp.float32)
    plain_when_greedy = not output_scores

    def choice(h, state):
        return processed_choice(opt.lm_logits(params, h, backend), state, st, backend.argmax)

    def pick(h, state, unfinished, scores_buf, i):  # h: final hidden states [B, D]
        if plain_when_greedy:
            tok = jax.lax.cond(sampling.plain_argmax(state, st),
                               lambda: opt.lm_argmax(params, h, sampling.held_back(state, st), backend),
                               lambda: choice(h, state)[0])
        else:
            tok, scores = choice(h, state)
            if output_scores:
                scores_buf = scores_buf.at[i].set(scores)
        tok, state, unfinished = append_tokens(tok, state, st, unfinished, pad)
        return tok, state, unfinished, scores_buf

    tok, state, unfinished, scores_buf = pick(h, state, jnp.ones((b,), jnp.bool_), scores_buf, 0)

    def body(c):
        i, tok, cache, state, unfinished, scores_buf = c
        # one write index for all rows (a scalar): an in-place slice update, where a per-row
        # scatter makes XLA copy the loop-carried cache every step
        h, cache = opt.decode_step(cfg, params, cache, tok, n_real + i - 1, s + i - 1,
                                   read_len=s + i, return_hidden=True, backend=backend)
        tok, state, unfinished, scores_buf = pick(h, state, unfinished, scores_buf, i)
        return i + 1, tok, cache, state, unfinished, scores_buf

    carry = (jnp.int32(1), tok, cache, state, unfinished, scores_buf)
    for j, window in enumerate(windows):
        if j:
            carry = carry[:2] + (kv_cache._resize(carry[2], window),) + carry[3:]
        # step i writes entry s + i - 1: this window holds the steps up to i = window - s
        carry = jax.lax.while_loop(
            lambda c, last=window - s: (c[0] < max_new) & (c[0] <= last) & jnp.any(c[4]), body, carry)
    steps, _, _, state, _, scores_buf = carry
    return state.history, steps, scores_buf


def __getattr__(name: str):
    """`from opt_serving.model.wrapper import get_model`, where notebooks have always imported it: the edge's
    get_model (opt_serving/models.py), which builds this module's models, so it is looked up when asked for
    rather than imported here (the model layer imports nothing above it)."""
    if name == "get_model":
        import opt_serving.models
        return opt_serving.models.get_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


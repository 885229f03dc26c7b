"""get_model(name, path, ...) and a Hugging Face style generate() for the Flax OPT.

Names: `facebook/opt-*` -> HF PyTorch OPTForCausalLM (the reference and baseline),
`jax/opt-*` -> the Flax model on one device, `alpa/opt-*` -> the parallel backend.

generate() mirrors transformers 5.23 (`_sample` and the vectorised `_beam_search`)
so tokens match HF's; the whole decoding loop is one jitted `lax.while_loop`,
so there is no host round trip per token, and beam search reorders the cache on device.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving import sampling
from opt_serving.config import OPTConfig, config_for, get_config, size_from_name
from opt_serving.model import cpu_kernels, kv_cache, opt, weights

PREFIXES = ("facebook/", "jax/", "alpa/")


def resolve_numpy_folder(path: str | Path, model_name: str) -> Path:
    """`path` itself, or Alpa's `<path>/<name>-np` (also accepting `<path>/<size>-np`)."""
    path = Path(path)
    try:
        size = size_from_name(model_name)
        candidates = [path, path / f"opt-{size}-np", path / f"{size}-np"]
    except ValueError:  # not a preset: the name is a label for the folder itself ("jax/my-finetune")
        candidates = [path]
    for c in candidates:
        if (c / "config.json").exists() or (c / "decoder.embed_tokens.weight").exists():
            return c
    raise FileNotFoundError(f"no numpy weights folder for {model_name!r}: tried "
                            + ", ".join(str(c) for c in candidates))


def _dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str) and dtype == "auto":  # float16 on a GPU, float32 on a CPU
        dtype = "float16" if jax.default_backend() == "gpu" else "float32"
    if isinstance(dtype, str):
        dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    return jnp.dtype(dtype)


def get_model(model_name: str, path: str | Path | None = None, dtype=jnp.float32,
              tensor_parallel: int | None = None, pipeline_parallel: int | None = None,
              dummy: bool = False, seed: int = 0, **kwargs):
    """Load an OPT model by name (see the module docstring for the prefixes)."""
    if not model_name.startswith(PREFIXES):
        raise ValueError(f"unknown model {model_name!r}: the name must start with one of "
                         f"{', '.join(PREFIXES)} (e.g. 'jax/opt-125m')")
    if path is None or not (Path(path) / "config.json").is_file():
        try:  # unknown sizes fail here, naming the known ones (a folder's config.json wins)
            size_from_name(model_name)
        except ValueError as e:
            if path is None:
                raise
            raise ValueError(f"{e}; any name works with a folder that has a config.json, and {path} has none") \
                from None
    if model_name.startswith("alpa/"):
        try:
            from opt_serving.parallel import backend
        except ImportError:
            raise NotImplementedError(
                f"{model_name}: the alpa/ backend (opt_serving.parallel.backend) is not available "
                "in this build; use jax/ for one device") from None
        return backend.get_alpa_model(model_name, path, dtype=dtype, tensor_parallel=tensor_parallel,
                                      pipeline_parallel=pipeline_parallel, dummy=dummy, seed=seed, **kwargs)
    if tensor_parallel not in (None, 1) or pipeline_parallel not in (None, 1):
        raise ValueError(f"{model_name} runs on one device; use alpa/ for parallelism")
    if model_name.startswith("facebook/"):
        return _get_hf_model(model_name, path, dtype, dummy, seed)
    dtype = _dtype(dtype)
    if dummy:
        cfg = get_config(model_name)
        return OPTModel(cfg, opt.init_params(cfg, seed, dtype))
    if path is None:
        raise ValueError(f"{model_name}: give path= (the numpy weights folder) or dummy=True")
    folder = resolve_numpy_folder(path, model_name)
    cfg, params = weights.load_params(folder, config_for(model_name, folder), dtype, progress=kwargs.get("progress", False))
    return OPTModel(cfg, params)


def _get_hf_model(model_name, path, dtype, dummy, seed):
    import torch
    import transformers
    torch_dtype = {"float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}[str(_dtype(dtype))]
    if dummy or path is None:
        if not dummy:
            raise ValueError(f"{model_name}: give path= (an HF folder or numpy folder) or dummy=True")
        torch.manual_seed(seed)
        hf_cfg = transformers.OPTConfig(**get_config(model_name).to_hf_dict())
        return transformers.OPTForCausalLM(hf_cfg).to(torch_dtype).eval()
    path = Path(path)
    if (path / "config.json").exists() and (any(path.glob("*.safetensors"))
                                            or any(path.glob("pytorch_model*.bin"))):
        return transformers.OPTForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    folder = resolve_numpy_folder(path, model_name)
    cfg, arrays = weights.load_numpy_folder(folder)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**cfg.to_hf_dict()))
    state = {weights.metaseq_key_to_hf(k): torch.from_numpy(np.array(v, np.float32))
             for k, v in arrays.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"numpy folder {folder} does not fit OPTForCausalLM: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.to(torch_dtype).eval()


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
    one compiled on-device loop; backend.PipelinedOPT: a host loop over the stage actors, picking
    tokens with the same jitted `pick_tokens` and `beam_step`)."""
    config: OPTConfig

    def _sample(self, ids, mask, st, max_new: int, new_bucket: int, pad: int, output_scores: bool):
        """-> (history [B, S + new_bucket], steps taken, processed scores [new_bucket, B, V] or [0, ...])"""
        raise NotImplementedError

    def _beams(self, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad, output_scores):
        """-> ((seqs, beam_idx) of the n_return best per prompt, scores [max_new, B*K, V], beam scores)"""
        raise NotImplementedError

    def generate(self, input_ids=None, attention_mask=None, max_length=None, max_new_tokens=None,
                 min_length=None, min_new_tokens=None, do_sample=False, temperature=1.0, top_k=50,
                 top_p=1.0, num_beams=1, num_return_sequences=1, repetition_penalty=1.0,
                 no_repeat_ngram_size=0, bad_words_ids=None, eos_token_id=None, pad_token_id=None,
                 output_scores=False, return_dict_in_generate=False, seed=None,
                 length_penalty=1.0, early_stopping=False, **unused):
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
            if num_return_sequences > num_beams:
                raise ValueError(f"num_return_sequences ({num_return_sequences}) > num_beams ({num_beams})")
            ids, mask = np.repeat(ids, num_beams, 0), np.repeat(mask, num_beams, 0)
            st = sampling.make_settings(b * num_beams, seed=seed, **settings)
            seqs, scores, seq_scores = self._beams(
                ids, mask, st, max_new_tokens, num_beams, num_return_sequences, float(length_penalty),
                bool(early_stopping is True), eos, pad, output_scores)
            seqs, beam_idx = np.asarray(seqs[0]), np.asarray(seqs[1])
            out_len = s + int(((beam_idx + 1) != 0).sum(1).max())
            seqs = seqs[:, :out_len]
            n_steps = out_len - s
        else:
            if num_return_sequences > 1:
                if not do_sample:
                    raise ValueError("greedy search returns one sequence per prompt; "
                                     "use do_sample or num_beams for num_return_sequences > 1")
                ids, mask = np.repeat(ids, num_return_sequences, 0), np.repeat(mask, num_return_sequences, 0)
            rows = ids.shape[0]
            # bucket the prompt width (extra left pads) and the new-token budget so that
            # prompts of nearby lengths share one compiled loop
            sb = kv_cache.bucket_length(s, cfg.max_position_embeddings, min_bucket=8)
            extra = sb - s
            ids = np.concatenate([np.full((rows, extra), pad, np.int32), ids], 1)
            mask = np.concatenate([np.zeros((rows, extra), np.int32), mask], 1)
            if settings["min_length"]:
                settings["min_length"] += extra  # HF's min_length counts the history we lengthened
            st = sampling.make_settings(rows, seed=np.asarray(seed) + np.arange(rows), **settings)
            new_bucket = kv_cache.bucket_length(max_new_tokens, 1 << 30)
            seqs, steps, scores = self._sample(ids, mask, st, max_new_tokens, new_bucket, pad, output_scores)
            n_steps = int(steps)
            seqs = np.asarray(seqs)[:, extra:sb + n_steps]
            seq_scores = None
        if is_torch:
            import torch
            seqs = torch.from_numpy(np.array(seqs, np.int64))
        if not return_dict_in_generate:
            return seqs
        score_steps = None
        if output_scores:
            sc = np.asarray(scores)[:n_steps]
            score_steps = tuple(sc)
            if is_torch:
                import torch
                score_steps = tuple(torch.from_numpy(np.array(x)) for x in score_steps)
        if seq_scores is not None:
            seq_scores = np.asarray(seq_scores)
            if is_torch:
                import torch
                seq_scores = torch.from_numpy(np.array(seq_scores))
        return GenerateOutput(sequences=seqs, scores=score_steps, sequences_scores=seq_scores)


class OPTModel(Generation):
    """The Flax OPT on one device: params + config, the jitted steps, and generate()."""

    def __init__(self, cfg: OPTConfig, params):
        self.config = cfg
        # kept in the layout the steps run fastest (opt.runtime_params: q/k/v fused into one matmul,
        # on a CPU pre-packed for oneDNN; a sharded tree, e.g. a tensor-parallel engine's, stays as
        # it is): the steps and generate() run these
        self.dtype = opt.param_dtype(params)
        self.fused_params = opt.runtime_params(params)

    @property
    def params(self):
        """The params in the checkpoint's layout (q_proj / k_proj / v_proj, plain kernels), as a new tree."""
        return opt.checkpoint_params(self.fused_params)

    # engine-facing pass-throughs
    def init_cache(self, batch: int, max_len: int):
        return kv_cache.init_cache(self.config, batch, max_len, self.dtype)

    def prefill(self, cache, input_ids, attention_mask, all_logits=True):
        return opt.prefill(self.config, self.fused_params, cache, input_ids, attention_mask,
                           all_logits=all_logits)

    def decode(self, cache, tokens, positions, write_index):
        return opt.decode(self.config, self.fused_params, cache, tokens, positions, write_index)

    def __call__(self, input_ids, attention_mask=None):
        return opt.forward(self.config, self.fused_params, input_ids, attention_mask)

    def _sample(self, ids, mask, st, max_new, new_bucket, pad, output_scores):
        return _sample_loop(self.config, self.fused_params, jnp.asarray(ids), jnp.asarray(mask), st,
                            jnp.int32(max_new), new_bucket, pad, output_scores,
                            cpu_kernels.is_packed(self.fused_params))

    def _beams(self, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad, output_scores):
        return _beam_search(self.config, self.fused_params, jnp.asarray(ids), jnp.asarray(mask), st, max_new, k,
                            n_return, length_penalty, early_stop, eos, pad, output_scores)


def _start(cfg, params, ids, mask, max_new, return_hidden=False):
    """Prefill a cache of `max_new` more entries than the prompt; next-token logits [B, V] (or the
    final hidden states [B, D])."""
    b, s = ids.shape
    cache = kv_cache.init_cache(cfg, b, s + max_new, opt.param_dtype(params))
    return opt._prefill(cfg, params, cache, ids, mask, all_logits=False, return_hidden=return_hidden)


def processed_choice(logits, state, st):
    """HF's logits processors and warpers over logits [B, V], then each row's greedy or sampled token ->
    (tokens [B], the processed scores [B, V]: what output_scores returns)."""
    scores = sampling.warp(sampling.process_logits(logits, state, st), st)
    return sampling.choose(scores, state, st), scores


def append_tokens(tok, state, st, unfinished, pad):
    """Finished rows get `pad`; the tokens join the history; a row finishes at its EOS."""
    tok = jnp.where(unfinished, tok, pad)
    state = sampling.update_state(state, tok)
    return tok, state, unfinished & (tok != st.eos_token_id)


@jax.jit
def pick_tokens(logits, state, st, unfinished, pad):
    """One generate() step's choice from the next-token logits [B, V], as a jitted function of its own
    (a host loop's, e.g. over pipeline stages) -> (tokens, state, unfinished, processed scores)."""
    tok, scores = processed_choice(logits, state, st)
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
def _sample_loop(cfg, params, ids, mask, st, max_new, new_bucket, pad, output_scores, read_written=False):
    """HF `_sample`: greedy or sampled rows, finished rows filled with pad; stops when all are done.

    `max_new` is traced; buffers are sized by the static `new_bucket` >= max_new. The cache
    starts at the smallest window holding the prompt and grows a window at a time
    (decode_windows): one decode loop per window. With `read_written` (packed params on a CPU,
    where cpu_kernels.decode_attention reads only the entries written so far) the cache is
    full-size from the start and there is one loop.

    Steps where every row takes the plain argmax (sampling.plain_argmax) go through opt.lm_argmax,
    which on a CPU with the screened greedy head never makes the logits."""
    b, s = ids.shape
    total = s + new_bucket
    windows = [total] if read_written else decode_windows(s, total)
    n_real = jnp.sum(mask, axis=1).astype(jnp.int32)
    h, cache = _start(cfg, params, ids, mask, windows[0] - s, return_hidden=True)
    state = sampling.init_state(ids, mask, cfg.vocab_size, total)
    scores_buf = jnp.zeros((new_bucket if output_scores else 0, b, cfg.vocab_size), jnp.float32)
    screened = cpu_kernels.has_head(params) and not output_scores

    def pick(h, state, unfinished, scores_buf, i):  # h: final hidden states [B, D]
        if screened:
            tok = jax.lax.cond(sampling.plain_argmax(state, st),
                               lambda: opt.lm_argmax(params, h, sampling.held_back(state, st)),
                               lambda: processed_choice(opt.lm_logits(params, h), state, st)[0])
        else:
            tok, scores = processed_choice(opt.lm_logits(params, h), state, st)
            if output_scores:
                scores_buf = scores_buf.at[i].set(scores)
        tok, state, unfinished = append_tokens(tok, state, st, unfinished, pad)
        return tok, state, unfinished, scores_buf

    tok, state, unfinished, scores_buf = pick(h, state, jnp.ones((b,), jnp.bool_), scores_buf, 0)

    def body(c):
        i, tok, cache, state, unfinished, scores_buf = c
        # one write index for all rows (a scalar): an in-place slice update, where a per-row
        # scatter makes XLA copy the loop-carried cache every step
        h, cache = opt._decode(cfg, params, cache, tok, n_real + i - 1, s + i - 1,
                               read_len=s + i if read_written else None, return_hidden=True)
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


def _gather_beams(x, idx):
    """x [B, K, ...], idx [B, K'] -> [B, K', ...]"""
    return jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(x, idx)


def beam_init(ids, mask, k: int, max_length: int, fill: int) -> dict:
    """Beam state for prompts already repeated k times (rows [B*K])."""
    bk, s = ids.shape
    b = bk // k
    running = jnp.full((b, k, max_length), fill, jnp.int32).at[:, :, :s].set(ids.reshape(b, k, s))
    idx = jnp.full((b, k, max_length - s), -1, jnp.int32)
    return dict(cur=jnp.int32(s), running=running, running_scores=jnp.zeros((b, k), jnp.float32)
                .at[:, 1:].set(-1e9), running_idx=idx, seqs=running,
                beam_scores=jnp.full((b, k), -1e9, jnp.float32), beam_idx=idx,
                finished=jnp.zeros((b, k), jnp.bool_), unsat=jnp.ones((b, 1), jnp.bool_))


def beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st):
    """One step of transformers 5.23 `_beam_search` (vectorised, one EOS token) given the next-token
    logits [B*K, V] -> (new state, the parent row of every beam [B*K] (reorder the cache by it), the
    token each beam feeds next [B*K], whether to go on, the processed log-probs [B*K, V]).
    Pure: the on-device loop below and the pipelined host loop (parallel/backend.py) both run it."""
    bk, v = logits.shape
    b = bk // k
    cur, running, running_scores, running_idx = (c["cur"], c["running"], c["running_scores"],
                                                 c["running_idx"])
    max_length = running.shape[2]
    keep = 2 * k  # beams_to_keep = max(2, 1 + n_eos) * num_beams
    top_mask = jnp.arange(keep) < k
    g = _gather_beams
    state = _state_from_history(prompt_seen, running.reshape(bk, max_length), cur, v)
    log_probs = sampling.process_logits(jax.nn.log_softmax(logits.astype(jnp.float32), -1), state, st)
    acc = (log_probs.reshape(b, k, v) + running_scores[:, :, None]).reshape(b, k * v)
    topk_lp, topk_i = jax.lax.top_k(acc, keep)
    cur_beam, topk_ids = topk_i // v, (topk_i % v).astype(jnp.int32)
    t_idx = g(running_idx, cur_beam)
    t_seq = jax.lax.dynamic_update_slice(g(running, cur_beam), topk_ids[:, :, None], (0, 0, cur))
    flat_parent = (cur_beam + jnp.arange(b)[:, None] * k).astype(jnp.int32)
    t_idx = jax.lax.dynamic_update_slice(t_idx, flat_parent[:, :, None], (0, 0, cur - s))
    hits = (cur + 1 >= max_length) | (topk_ids == eos)
    # the best unfinished beams continue
    t_run_lp = topk_lp + hits.astype(jnp.float32) * -1.0e9
    nxt = jax.lax.top_k(t_run_lp, k)[1]
    running, running_scores, running_idx = g(t_seq, nxt), g(t_run_lp, nxt), g(t_idx, nxt)
    # finished hypotheses merge into the kept ones by length-normalised score
    did = hits & top_mask[None, :]
    t_lp = topk_lp / ((cur + 1 - s).astype(jnp.float32) ** length_penalty)
    full = jnp.all(c["finished"], axis=-1, keepdims=True) & early_stop
    t_lp = t_lp + full * -1.0e9 + (~c["unsat"]) * -1.0e9 + (~did) * -1.0e9
    top = jax.lax.top_k(jnp.concatenate([c["beam_scores"], t_lp], 1), k)[1]
    merged = lambda a, t: g(jnp.concatenate([a, t], 1), top)  # noqa: E731
    seqs, beam_scores = merged(c["seqs"], t_seq), merged(c["beam_scores"], t_lp)
    beam_idx, finished = merged(c["beam_idx"], t_idx), merged(c["finished"], did)
    # the cache follows the surviving beams
    parents = jax.lax.dynamic_slice_in_dim(running_idx, cur - s, 1, axis=2).reshape(bk)
    cur = cur + 1
    best = running_scores[:, :1] / ((cur - s).astype(jnp.float32) ** length_penalty)
    worst = jnp.where(finished, jnp.min(beam_scores, axis=1, keepdims=True), -1.0e9)
    unsat = c["unsat"] & jnp.any(best > worst, axis=-1, keepdims=True)
    go = jnp.any(unsat) & ~(jnp.all(finished) & early_stop) & ~jnp.all(hits) & (cur < max_length)
    # next: feed each surviving beam's newest token
    last = jax.lax.dynamic_slice_in_dim(running, cur - 1, 1, axis=2).reshape(bk)
    c = dict(cur=cur, running=running, running_scores=running_scores, running_idx=running_idx,
             seqs=seqs, beam_scores=beam_scores, beam_idx=beam_idx, finished=finished, unsat=unsat)
    return c, parents, last, go, log_probs


@partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9, 10, 11, 12))
def _beam_search(cfg, params, ids, mask, st, max_new, k, n_return, length_penalty, early_stop,
                 eos, pad, output_scores):
    """A port of transformers 5.23 `_beam_search` (vectorised, one EOS token), on device."""
    bk, s = ids.shape
    b = bk // k
    n_real = jnp.sum(mask, axis=1).astype(jnp.int32)  # [B*K]; equal within a batch item
    prompt_seen = sampling.init_state(ids, mask, cfg.vocab_size, s + max_new)
    scores_buf = jnp.zeros((max_new if output_scores else 0, bk, cfg.vocab_size), jnp.float32)
    logits, cache = _start(cfg, params, ids, mask, max_new)

    def step(carry):
        c, logits, cache, _, scores_buf = carry
        cur = c["cur"]
        c, parents, last, go, log_probs = beam_step(k, s, length_penalty, early_stop, eos, logits, c,
                                                    prompt_seen, st)
        if output_scores:
            scores_buf = scores_buf.at[cur - s].set(log_probs)
        cache = kv_cache.reorder(cache, parents)
        logits, cache = jax.lax.cond(
            go,
            lambda: opt._decode(cfg, params, cache, last, n_real + (cur - s), cur),  # a scalar: see _sample_loop
            lambda: (logits, cache))
        return c, logits, cache, go, scores_buf

    c = beam_init(ids, mask, k, s + max_new, pad if pad else eos)
    c, *_, scores_buf = jax.lax.while_loop(lambda carry: carry[3], step,
                                           (c, logits, cache, jnp.bool_(True), scores_buf))
    flat = lambda x: x[:, :n_return].reshape((b * n_return,) + x.shape[2:])  # noqa: E731
    return (flat(c["seqs"]), flat(c["beam_idx"])), scores_buf, flat(c["beam_scores"])


def _state_from_history(prompt_state, hist, cur, v):
    """A sampling.State for beams whose history was just reordered (seen = prompt + generated)."""
    bk, L = hist.shape
    gen = (jnp.arange(L)[None, :] >= prompt_state.prompt_length[:, None]) & (jnp.arange(L) < cur)
    rows = jnp.broadcast_to(jnp.arange(bk)[:, None], (bk, L))
    seen = prompt_state.seen.at[rows, jnp.where(gen, hist, v)].set(True, mode="drop")
    counts = jnp.zeros((bk, v), jnp.int32).at[rows, jnp.where(gen, hist, v)].add(1, mode="drop")
    return sampling.State(history=hist, length=jnp.full((bk,), cur, jnp.int32),
                          prompt_length=prompt_state.prompt_length, seen=seen, counts=counts)

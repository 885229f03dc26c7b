"""The model's pure steps over a KV cache: each applies the model's modules (opt.py) with one attend a layer
(attends.py) and returns the new cache; cfg and the backend are static wherever a step is jitted (here, in the
stages' programs, in the sharded model).

    prefill_step          a left-padded batch of prompts into a fresh cache
    extend_step           a chunk of C tokens after what each row holds (a prompt in chunks, a speculative check)
    decode_step           one new token a row
    rows_decode_step      one new token in each of some rows, the others neither computed nor read
    decode_joining_step   a decode step with short prompts joining free rows in the same pass
    ragged_step           rows and prompt parts in one pass (the backend's ragged attention)

The engine-facing functions (cfg is static, the cache donated):
    prefill(cfg, params, cache, input_ids[B,S], attention_mask[B,S], backend=...) -> (logits[B,S,V], cache)
    decode(cfg, params, cache, tokens[B], positions[B], write_index[B], backend=...) -> (logits[B,V], cache)
generate()'s loops `start` a cache of their own; `forward` is the full-sequence reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opt_serving.backend import Backend
from opt_serving.config import OPTConfig
from opt_serving.model.attends import (decode_attend, extend_attend, joining_attend, prefill_attend, ragged_attend,
                                       rows_attend)
from opt_serving.model.kv_cache import cache_dtype, init_cache
from opt_serving.model.opt import OPT, XLA, StageSpec, is_fused, param_dtype


def prefill_positions(attention_mask):
    """HF's positions for a left-padded batch: count of real tokens before, pads at -1."""
    m = attention_mask.astype(jnp.int32)
    return jnp.cumsum(m, axis=1) * m - 1


def prefill_step(cfg, params, cache, input_ids, attention_mask, all_logits=True, return_hidden=False,
                 stage: StageSpec | None = None, backend: Backend = XLA):
    """See `prefill`. With return_hidden, the final hidden states [B,S,D] (or [B,D]) come back
    instead of logits: the caller applies `opt.lm_logits` only where it needs them (a 2048-token
    prompt's full logits are a 158 GFLOP product). A `stage` that is not first takes hidden states
    [B,S,D] as `input_ids`; one that is not last returns its hidden states [B,S,D]."""
    dtype = param_dtype(params)
    b, s = attention_mask.shape
    if s > cache["mask"].shape[1]:
        raise ValueError(f"prompt of {s} tokens does not fit a cache of {cache['mask'].shape[1]}")
    attends = [prefill_attend(kc, vc, attention_mask)
               for kc, vc in zip(cache["k"], cache["v"])]
    out, caches = OPT(cfg, dtype, is_fused(params), stage, backend).apply(
        {"params": params}, input_ids, prefill_positions(attention_mask), attends, all_logits, return_hidden)
    # prefill starts the rows afresh: only the prompt's real tokens are valid
    mask = jnp.zeros_like(cache["mask"]).at[:, :s].set(attention_mask.astype(jnp.bool_))
    new_cache = {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}
    last = stage is None or stage.last
    return (out if all_logits or not last else out[:, 0]), new_cache


def extend_step(cfg, params, cache, x, start, chunk_mask, return_hidden=False, stage: StageSpec | None = None,
                backend: Backend = XLA, per_query: bool = False):
    """Continue a prefill by a chunk of C tokens (ids x [B, C], or on a stage that is not first the previous
    stage's hidden states [B, C, D]) at positions start..start+C-1 (`start` int32, scalar or [B]);
    `chunk_mask` [B, C] marks its real tokens (a prompt's last chunk is right-padded). Each writes its k/v
    at its own entry and attends to the row's valid entries before `start` and causally within the chunk;
    valid afterwards: those and the chunk's real tokens. Chunks of C over a prompt give what `prefill_step` of
    the whole prompt gives. `per_query`: each token's attention computed as its own decode step's (speculative
    checks: their tokens are then the ones decode steps give). -> (logits [B, C, V], or with `return_hidden` /
    on a stage that is not last the hidden states [B, C, D]; cache)."""
    b, c = chunk_mask.shape
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
    rel = jnp.arange(cache["mask"].shape[1])[None] - start[:, None]  # [B, max_len]: entry - start
    real = jnp.take_along_axis(chunk_mask.astype(jnp.bool_), jnp.clip(rel, 0, c - 1), axis=1)
    chunk = (rel >= 0) & (rel < c) & real  # entries the chunk's real tokens fill
    before = cache["mask"] & (rel < 0)
    mask = before[:, None] | (chunk[:, None] & (rel[:, None] <= jnp.arange(c)[None, :, None]))  # [B, C, max_len]
    attends = [extend_attend(kc, vc, mask, start, backend if per_query else None)
               for kc, vc in zip(cache["k"], cache["v"])]
    positions = jnp.where(chunk_mask > 0, start[:, None] + jnp.arange(c), -1)  # pads as prefill's: -1
    out, caches = OPT(cfg, param_dtype(params), is_fused(params), stage, backend).apply(
        {"params": params}, x, positions, attends, return_hidden=return_hidden)
    return out, {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": before | chunk}


def decode_step(cfg, params, cache, tokens, positions, write_index, read_len=None, return_hidden=False,
                stage: StageSpec | None = None, backend: Backend = XLA):
    """See `decode`. A `stage` that is not first takes hidden states [B, D] as `tokens`; one that is
    not last returns its hidden states [B, D]."""
    dtype = param_dtype(params)
    rows = jnp.arange(positions.shape[0])
    mask = cache["mask"].at[rows, write_index].set(True)
    attends = [decode_attend(kc, vc, mask, write_index, read_len, backend)
               for kc, vc in zip(cache["k"], cache["v"])]
    out, caches = OPT(cfg, dtype, is_fused(params), stage, backend).apply(
        {"params": params}, tokens[:, None], positions[:, None], attends, return_hidden=return_hidden)
    new_cache = {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}
    return out[:, 0], new_cache


def rows_decode_step(cfg, params, cache, tokens, positions, rows, stage: StageSpec | None = None,
                     backend: Backend = XLA):
    """A decode step of some of the cache's rows only (the running ones, padded to a few sizes): rows [R] which
    rows (past the cache's: padding), tokens [R] their newest tokens (on a stage that is not first, hidden states
    [R, D]) at positions [R] (-1: not stepped). The products run at R rows and the attention reads R rows of the
    cache (attends.rows_attend), so a step costs what its rows need, not what every slot would.
    -> (hidden states [R, D], cache)."""
    b, n = cache["mask"].shape
    write = jnp.where((positions >= 0) & (rows < b), positions, n)  # out of range: nothing written
    mask = cache["mask"].at[rows, write].set(True, mode="drop")
    read = mask.at[rows].get(mode="fill", fill_value=False)  # [R, n]
    attends = [rows_attend(kc, vc, read, rows, write) for kc, vc in zip(cache["k"], cache["v"])]
    out, caches = OPT(cfg, param_dtype(params), is_fused(params), stage, backend).apply(
        {"params": params}, tokens[:, None], jnp.maximum(positions, 0)[:, None], attends, return_hidden=True)
    return out[:, 0], {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}


def decode_joining_step(cfg, params, cache, tokens, positions, write_index, read_len, block,
                        stage: StageSpec | None = None, backend: Backend = XLA):
    """A decode step of the cache's B rows (as `decode_step`, hidden states) with prompts joining free rows in
    the same pass, so their tokens share its products: `block` = (ids [T] (or on a stage that is not first
    nothing: `tokens` are then the previous stage's hidden states [B + T, D]), rows [T], entries [T], seg
    [T]), see `attends.joining_attend`. A joining row's cache row starts afresh: valid are its prompt's entries.
    -> (hidden states [B + T, D], cache)."""
    ids, rows, entries, seg = block
    b, n = positions.shape[0], cache["mask"].shape[1]
    joining = jnp.zeros(b, jnp.bool_).at[rows].set(True, mode="drop")
    write_index = jnp.where(joining, n, write_index)  # a joining row's decode writes nothing (out of range)
    mask = cache["mask"].at[jnp.arange(b), write_index].set(True, mode="drop")
    attends = [joining_attend(kc, vc, mask, write_index, read_len, rows, entries, seg, backend)
               for kc, vc in zip(cache["k"], cache["v"])]
    first = stage is None or stage.first
    x = jnp.concatenate([tokens, ids])[None] if first else tokens[None]  # [1, B + T] or [1, B + T, D]
    out, caches = OPT(cfg, param_dtype(params), is_fused(params), stage, backend).apply(
        {"params": params}, x, jnp.concatenate([positions, entries])[None], attends, return_hidden=True)
    mask = mask.at[rows].set(False, mode="drop").at[rows, entries].set(True, mode="drop")
    return out[0], {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}


def ragged_step(cfg, params, cache, tokens, positions, write_index, block, prefix,
                stage: StageSpec | None = None, backend: Backend = XLA, keep=None):
    """A step of the cache's B rows and of T prompt tokens in one pass (the backend's ragged attention): row b's
    newest token at positions[b] written at entry write_index[b] (out of range: the row is not stepped: it is free,
    or its prompt is still being prefilled), and `block` = (ids [T] (on a stage that is not first nothing: `tokens`
    are the previous stage's hidden states [B + T, D]), rows [T], entries [T]): prompt tokens, each written at its
    entry of its row (its position) and reading the row's entries before it and itself, so a prompt's tokens may
    continue what earlier steps wrote (a long prompt a part at a time, the tail of a cached prefix). `prefix` =
    (pool k, pool v (tuples over layers of [H, P, bs, D]), ptab [B, Mp], plen [B]): a row's first plen entries are
    read from those pool blocks (a cached prefix shared by rows, never copied into them). With no rows stepped
    (positions [0]) every token is in the block: a running row's newest token is then a block token at its entry.
    `keep` (int32 [K], a last stage): only those tokens' hidden states are wanted (opt.OPT's keep).
    -> (hidden states [B + T, D], or [K, D] with `keep`; cache)."""
    ids, rows, entries = block
    pool_k, pool_v, ptab, plen = prefix
    b, (rows_count, n) = positions.shape[0], cache["mask"].shape  # (b: 0 where every token is in the block)
    q_rows = jnp.concatenate([jnp.arange(b, dtype=jnp.int32), rows])  # [N]
    q_entries = jnp.concatenate([write_index, entries])
    q_ends = jnp.where((q_rows < rows_count) & (q_entries < n), q_entries + 1, 0)
    attends = [ragged_attend(kc, vc, q_rows, q_entries, q_ends, pk, pv, ptab, plen, backend)
               for kc, vc, pk, pv in zip(cache["k"], cache["v"], pool_k, pool_v)]
    first = stage is None or stage.first
    x = jnp.concatenate([tokens, ids])[None] if first else tokens[None]  # [1, B + T] or [1, B + T, D]
    out, caches = OPT(cfg, param_dtype(params), is_fused(params), stage, backend).apply(
        {"params": params}, x, jnp.concatenate([positions, entries])[None], attends, return_hidden=True, keep=keep)
    mask = cache["mask"].at[q_rows, q_entries].set(True, mode="drop")  # (bookkeeping: the kernel reads ends)
    return out[0], {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}


prefill = jax.jit(prefill_step, static_argnums=(0,), static_argnames=("all_logits", "backend"),
                  donate_argnums=(2,))
prefill.__doc__ = """prefill(cfg, params, cache, input_ids[B,S], attention_mask[B,S], all_logits=True, backend=XLA)
    -> (logits float32 [B,S,V] (or [B,V] for the last position when all_logits=False), cache)

Left-padded prompts; positions come from the mask as in HF (cumsum(mask)-1, +2
offset). Writes cache entries 0..S-1 and resets each row's validity to the
prompt's real tokens. The cache is donated; pass S bucketed (bucket_length). `backend`: the one
the params were prepared for (layout.runtime_params)."""

decode = jax.jit(decode_step, static_argnums=(0,), static_argnames=("backend",), donate_argnums=(2,))
decode.__doc__ = """decode(cfg, params, cache, tokens[B], positions[B], write_index[B], read_len=None, backend=XLA)
    -> (logits float32 [B,V], cache)

One token per row: `positions` are 0-based token positions (the +2 offset is
added inside), `write_index` the cache entry each row writes (or a scalar int32: all rows
write that entry, an in-place slice update); each row attends
to its valid entries plus the new one. The cache is donated. `read_len`
(traced, e.g. the longest row's length): every valid entry and write_index lie
below it, and with the attention kernel only those entries are read. With `return_hidden` the final
hidden states [B, D] come back instead of logits (see opt.lm_logits, opt.lm_argmax)."""


def start(cfg: OPTConfig, params, ids, mask, max_new: int, backend: Backend = XLA, return_hidden=False):
    """Prefill a new cache of `max_new` more entries than the prompt (traced: generate()'s loops) ->
    (next-token logits [B, V] (or the final hidden states [B, D]), cache)."""
    b, s = ids.shape
    cache = init_cache(cfg, b, s + max_new, cache_dtype(params, backend))
    return prefill_step(cfg, params, cache, ids, mask, all_logits=False, return_hidden=return_hidden, backend=backend)


def forward(cfg: OPTConfig, params, input_ids, attention_mask=None, backend: Backend = XLA):
    """Full-sequence logits without keeping a cache (reference and tests)."""
    input_ids = jnp.asarray(input_ids)
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    cache = init_cache(cfg, input_ids.shape[0], input_ids.shape[1], cache_dtype(params, backend))
    return prefill(cfg, params, cache, input_ids, jnp.asarray(attention_mask), backend=backend)[0]

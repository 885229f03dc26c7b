"""Each kind of step's attention over the KV cache: the `attend` functions the steps hand the model's modules,
one a layer (`OPT(...).apply(..., attends)`). An attend takes a layer's q, k, v, writes k and v into that layer's
cache at the entries the step fills and attends to the entries the step may read -> (context, (k cache, v cache)):

    prefill_attend   a prompt written at entries 0..S-1, attending causally (causal_attention)
    decode_attend    one new token a row, at the row's own entry, over the row's valid entries
    extend_attend    a chunk of a prompt after what the row holds (a prompt in chunks, a speculative check)
    joining_attend   a decode step with short prompts joining free rows in the same pass
    ragged_attend    rows and prompt parts in one pass (the backend's ragged attention)
    rows_attend      one new token in each of some rows of the cache, reading only those rows

A layer's cache is [B, H, max_len, D] (kv_cache.py); its q, k, v come in as [B, S, H, D] (the joining and
ragged steps': [1, N, H, D], every token of the pass in one row).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from opt_serving.backend import Backend
from opt_serving.model.kv_cache import as_cached, from_cache, to_cache
from opt_serving.model.opt import XLA


def _masked_softmax(scores, mask):
    """Softmax in float32 over the last axis where `mask` (fully masked rows stay finite)."""
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


# a long prompt's queries go a block at a time, each over the keys before it; measured faster only past 512
# tokens (the scores above the diagonal are then most of the attention's work), so shorter prompts go whole
PREFILL_QUERY_BLOCK, PREFILL_BLOCKED_FROM = 128, 513


def causal_attention(q, k, v, attention_mask):
    """Causal attention of S tokens q, k, v [B, S, H, D] where attention_mask [B, S] -> [B, S, H, D]. From
    PREFILL_BLOCKED_FROM tokens the queries go a block at a time, each over the keys up to its own end: the
    scores above the diagonal are never made (a prompt of 1024 tokens computes 9/16 of the full S x S)."""
    s = q.shape[1]
    block = PREFILL_QUERY_BLOCK if s >= PREFILL_BLOCKED_FROM else s
    # heads first once (the dots want them so): a block's keys and values are then slices, not transposed again
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # [B, H, S, D]
    out = []
    for i0 in range(0, s, block):
        i1 = min(i0 + block, s)
        causal = jnp.arange(i0, i1)[:, None] >= jnp.arange(i1)[None, :]  # [Q, K]
        mask = causal[None, None] & attention_mask[:, None, None, :i1].astype(jnp.bool_)  # [B, 1, Q, K]
        scores = jnp.einsum("bhqd,bhkd->bhqk", q[:, :, i0:i1], k[:, :, :i1])
        probs = _masked_softmax(scores, mask).astype(q.dtype)
        out.append(jnp.einsum("bhqk,bhkd->bhqd", probs, v[:, :, :i1]))
    return jnp.concatenate(out, axis=2).transpose(0, 2, 1, 3)  # [B, S, H, D]


def prefill_attend(k_cache, v_cache, attention_mask):
    """Causal self-attention over the prompt; writes k/v into entries 0..S-1."""
    def attend(q, k, v):  # each [B, S, H, D]
        ctx = causal_attention(q, as_cached(k, k_cache.dtype), as_cached(v, v_cache.dtype), attention_mask)
        zero = jnp.int32(0)
        # [B, H, S, D] into the cache's [B, H, max_len, D]
        kc = jax.lax.dynamic_update_slice(k_cache, to_cache(k.transpose(0, 2, 1, 3), k_cache.dtype),
                                          (zero, zero, zero, zero))
        vc = jax.lax.dynamic_update_slice(v_cache, to_cache(v.transpose(0, 2, 1, 3), v_cache.dtype),
                                          (zero, zero, zero, zero))
        return ctx, (kc, vc)
    return attend


def decode_reference(q, ks, vs, m):
    """A decode step's attention, the model's own: q [B, H, D] over ks, vs [B, H, n, D] where m [B, n]."""
    scores = jnp.einsum("bhd,bhtd->bht", q, from_cache(ks, q.dtype))
    probs = _masked_softmax(scores, m[:, None, :]).astype(q.dtype)
    return jnp.einsum("bht,bhtd->bhd", probs, from_cache(vs, q.dtype))


def decode_attend(k_cache, v_cache, mask, write_index, read_len=None, backend: Backend = XLA):
    """One new token per row, written at that row's own index, attending to its valid entries.

    With `read_len` (traced) every valid entry and write_index lie below it: a decode step's
    cost is reading the cache, so a backend with the attention kernel reads only entries
    0..read_len-1 (Backend.decode_attention); otherwise the whole cache is read."""
    def attend(q, k, v):  # each [B, 1, H, D]
        if jnp.ndim(write_index) == 0:  # every row writes the same entry: an in-place slice update
            at = (0, 0, write_index, 0)  # [B, H, 1, D] into [B, H, max_len, D]
            kc = jax.lax.dynamic_update_slice(k_cache, to_cache(k.transpose(0, 2, 1, 3), k_cache.dtype), at)
            vc = jax.lax.dynamic_update_slice(v_cache, to_cache(v.transpose(0, 2, 1, 3), v_cache.dtype), at)
        else:
            rows = jnp.arange(q.shape[0])
            kc = k_cache.at[rows, :, write_index].set(to_cache(k[:, 0], k_cache.dtype))  # scatter [B,H,D]
            vc = v_cache.at[rows, :, write_index].set(to_cache(v[:, 0], v_cache.dtype))
        ctx = backend.decode_attention(q[:, 0], kc, vc, mask, read_len, decode_reference)
        return ctx[:, None], (kc, vc)
    return attend


def rows_attend(k_cache, v_cache, mask, rows, write_index):
    """A decode step of some rows of the cache only (rows [R]; past the cache's: padding): row rows[r]'s new k/v go
    in at entry write_index[r] (out of range: dropped) and its query reads that row's entries where mask [R, n].
    The rows are gathered before the attention reads them, so a step of R rows reads R rows of the cache, not
    every row (in place, the cache's idle rows would be read too, and its busy rows cost the same either way)."""
    def attend(q, k, v):  # each [R, 1, H, D]
        kc = k_cache.at[rows, :, write_index].set(to_cache(k[:, 0], k_cache.dtype), mode="drop")  # [R, H, D]
        vc = v_cache.at[rows, :, write_index].set(to_cache(v[:, 0], v_cache.dtype), mode="drop")
        ks, vs = (c.at[rows].get(mode="fill", fill_value=0) for c in (kc, vc))  # [R, H, n, D]
        return decode_reference(q[:, 0], ks, vs, mask)[:, None], (kc, vc)
    return attend


def extend_attend(k_cache, v_cache, mask, start, per_query: Optional[Backend] = None):
    """A prefill chunk at entries start..start+C-1 of each row (`start` [B]): writes its k/v there (entries
    past the cache, pads only, are dropped) and attends where `mask` [B, C, max_len] says. `per_query`: a
    backend whose decode attention then computes each query as a decode step of its own would (for a few
    queries, a speculative check's, whose tokens must be a decode step's: each query reads its row's cache, which
    the reference repeats per query)."""
    def attend(q, k, v):  # each [B, C, H, D]
        b, c = q.shape[:2]
        at = start[:, None] + jnp.arange(c)  # [B, C]
        rows = jnp.arange(b)[:, None]
        kc = k_cache.at[rows, :, at].set(to_cache(k, k_cache.dtype), mode="drop")  # [B, C, H, D] entries
        vc = v_cache.at[rows, :, at].set(to_cache(v, v_cache.dtype), mode="drop")
        if per_query is not None:
            flat = mask.reshape(b * c, -1)  # [B * C, max_len]: query i of row b as row b * C + i

            def repeated(q, ks, vs, m):  # each query beside its own copy of its row's cache
                return decode_reference(q, jnp.repeat(ks, c, 0), jnp.repeat(vs, c, 0), m)
            ctx = per_query.decode_attention(q.reshape(b * c, *q.shape[2:]), kc, vc, flat, jnp.max(start) + c,
                                             repeated)
            return ctx.reshape(q.shape), (kc, vc)
        scores = jnp.einsum("bqhd,bhkd->bhqk", q, from_cache(kc, q.dtype))
        probs = _masked_softmax(scores, mask[:, None]).astype(q.dtype)
        return jnp.einsum("bhqk,bhkd->bqhd", probs, from_cache(vc, q.dtype)), (kc, vc)
    return attend


def joining_attend(k_cache, v_cache, mask, write_index, read_len, rows, entries, seg, backend: Backend = XLA):
    """A decode step of the cache's B rows (as `decode_attend`) with a block of T prompt tokens in the same
    pass: token t goes to cache row rows[t] (B: padding, dropped) at entry entries[t] and attends causally
    to the tokens of its own prompt (seg[t]) in the block. A joining row's own decode write must be out of
    range (dropped): the decode rows' and the block's k/v then go in with one scatter, in place, before the
    decode attention reads the cache."""
    b = write_index.shape[0]
    at_rows, at_entries = jnp.concatenate([jnp.arange(b), rows]), jnp.concatenate([write_index, entries])
    allowed = (seg[:, None] == seg[None, :]) & (entries[None, :] <= entries[:, None])  # [T, T]

    def attend(q, k, v):  # each [1, B + T, H, D]: the decode rows' tokens, then the block's
        kc = k_cache.at[at_rows, :, at_entries].set(to_cache(k[0], k_cache.dtype), mode="drop")  # [B + T, H, D]
        vc = v_cache.at[at_rows, :, at_entries].set(to_cache(v[0], v_cache.dtype), mode="drop")
        ctx = backend.decode_attention(q[0, :b], kc, vc, mask, read_len, decode_reference)  # [B, H, D]
        qb, kb, vb = q[0, b:], as_cached(k[0, b:], k_cache.dtype), as_cached(v[0, b:], v_cache.dtype)  # [T, H, D]
        probs = _masked_softmax(jnp.einsum("qhd,khd->hqk", qb, kb), allowed[None]).astype(q.dtype)
        ctx_b = jnp.einsum("hqk,khd->qhd", probs, vb)  # [T, H, D]
        return jnp.concatenate([ctx, ctx_b])[None], (kc, vc)
    return attend


def ragged_attend(k_cache, v_cache, rows, entries, ends, pool_k, pool_v, ptab, plen, backend: Backend):
    """A ragged step's attention (Backend.ragged_attention): the N queries' k/v go into the cache at (rows,
    entries) (out of range: dropped) with one scatter, then query i reads entries [0, ends[i]) of its row."""
    def attend(q, k, v, keep=None):  # each [1, N, H, D]; keep int32 [K]: only those queries
        kc = k_cache.at[rows, :, entries].set(to_cache(k[0], k_cache.dtype), mode="drop")  # [N, H, D] entries
        vc = v_cache.at[rows, :, entries].set(to_cache(v[0], v_cache.dtype), mode="drop")
        q_rows, q_ends, q = (rows, ends, q[0]) if keep is None else (rows[keep], ends[keep], q[0, keep])
        ctx = backend.ragged_attention(q, kc, vc, q_rows, q_ends, pool_k, pool_v, ptab, plen)  # [N or K, H, D]
        return ctx[None], (kc, vc)
    return attend

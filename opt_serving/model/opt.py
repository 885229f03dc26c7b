"""Flax OPT for every size, with pure jitted prefill / decode steps over a KV cache.

Pre-LN models (125m, 1.3b, ... 175b) and OPT-350m (post-LN, 512-wide embeddings
projected in and out of the decoder, no final layer norm). Learned positions
with fairseq's offset of 2, ReLU, logits tied to the token embedding.

Params, activations and the cache are in the model dtype; layer norms and the
attention softmax run in float32, and logits come back as float32.

The operations whose implementation depends on where the model runs (the dense products, the tied LM head,
a decode step's attention) go through a `Backend` (opt_serving/backend), a static attribute of the modules
and a static argument of the steps: `Backend.xla()` (plain XLA) unless the caller holds another, chosen
where the params were loaded (model/layout.py: runtime_params).

The engine-facing functions (cfg is static, the cache is donated):
    prefill(cfg, params, cache, input_ids[B,S], attention_mask[B,S], backend=...) -> (logits[B,S,V], cache)
    decode(cfg, params, cache, tokens[B], positions[B], write_index[B], backend=...) -> (logits[B,V], cache)
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from opt_serving.backend import Backend
from opt_serving.config import OPTConfig
from opt_serving.model.kv_cache import init_cache

LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which OPT uses
XLA = Backend.xla()


class LayerNorm(nn.Module):
    """Layer norm computed in float32 whatever the model dtype."""
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(epsilon=LN_EPS, dtype=jnp.float32, param_dtype=self.dtype,
                         name="ln")(x.astype(jnp.float32))
        return y.astype(self.dtype)


class Linear(nn.Module):
    """nn.Dense's numbers (kernel [in, out], bias; the backend's params: Backend.dense), with the ReLU that
    follows fc1 (`relu`)."""
    features: int
    use_bias: bool = True
    relu: bool = False
    dtype: Any = jnp.float32
    backend: Backend = XLA

    @nn.compact
    def __call__(self, x):
        return self.backend.dense(self, x, self.features, use_bias=self.use_bias, relu=self.relu, dtype=self.dtype)


class SelfAttention(nn.Module):
    cfg: OPTConfig
    dtype: Any = jnp.float32
    fused_qkv: bool = False  # params hold one qkv_proj [D, 3D] (see layout.fuse_qkv) instead of q/k/v
    backend: Backend = XLA

    def setup(self):
        h = self.cfg.hidden_size
        dense = partial(Linear, dtype=self.dtype, backend=self.backend)
        if self.fused_qkv:
            self.qkv_proj = dense(3 * h, name="qkv_proj")
        else:
            self.q_proj, self.k_proj, self.v_proj = (dense(h, name=n) for n in ("q_proj", "k_proj", "v_proj"))
        self.out_proj = dense(h, name="out_proj")

    def __call__(self, x, attend: Callable):
        cfg = self.cfg
        b, s, _ = x.shape
        split = lambda t: t.reshape(b, s, cfg.num_attention_heads, cfg.head_dim)  # [B, S, H, D]
        if self.fused_qkv:
            q, k, v = jnp.split(self.qkv_proj(x), 3, axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # OPT scales q after its bias, as HF and metaseq do
        q, k, v = split(q * (cfg.head_dim ** -0.5)), split(k), split(v)
        ctx, cache_out = attend(q, k, v)  # ctx [B, S, H, D]
        return self.out_proj(ctx.reshape(b, s, cfg.hidden_size)), cache_out


class DecoderLayer(nn.Module):
    cfg: OPTConfig
    dtype: Any = jnp.float32
    fused_qkv: bool = False
    backend: Backend = XLA

    def setup(self):
        cfg, dt, be = self.cfg, self.dtype, self.backend
        self.self_attn = SelfAttention(cfg, dt, self.fused_qkv, be)
        self.self_attn_layer_norm = LayerNorm(dt)
        self.fc1 = Linear(cfg.ffn_dim, relu=True, dtype=dt, backend=be)
        self.fc2 = Linear(cfg.hidden_size, dtype=dt, backend=be)
        self.final_layer_norm = LayerNorm(dt)

    def __call__(self, h, attend: Callable):
        pre = self.cfg.do_layer_norm_before
        residual = h
        x = self.self_attn_layer_norm(h) if pre else h
        x, cache_out = self.self_attn(x, attend)
        h = residual + x
        if not pre:
            h = self.self_attn_layer_norm(h)
        residual = h
        x = self.final_layer_norm(h) if pre else h
        h = residual + self.fc2(self.fc1(x))
        if not pre:
            h = self.final_layer_norm(h)
        return h, cache_out


class StageSpec(NamedTuple):
    """A contiguous slice of the decoder: layers [start, stop). The first stage embeds the tokens, the
    last applies the final layer norm (and projection) and owns the tied LM head. The whole model is
    the one stage that is both (`whole`). A stage's params number its layers from 0."""
    start: int
    stop: int
    first: bool = True
    last: bool = True

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    @classmethod
    def whole(cls, cfg: OPTConfig) -> "StageSpec":
        return cls(0, cfg.num_hidden_layers)


class OPT(nn.Module):
    """The decoder plus tied LM head, or one pipeline stage of it (`stage`). `attends[i]` implements
    the stage's layer i's attention (prefill or decode, with its cache) and returns (context, new
    layer cache). A stage that is not first takes hidden states [B, S, D] in place of token ids."""
    cfg: OPTConfig
    dtype: Any = jnp.float32
    fused_qkv: bool = False
    stage: StageSpec | None = None  # None: the whole model
    backend: Backend = XLA

    def setup(self):
        cfg, dt, be = self.cfg, self.dtype, self.backend
        st = self.stage or StageSpec.whole(cfg)
        if st.first or st.last:  # the input embedding, tied to the LM head
            self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.word_embed_proj_dim,
                                         dtype=dt, param_dtype=dt)
        if st.first:
            self.embed_positions = nn.Embed(cfg.max_position_embeddings + cfg.position_offset,
                                            cfg.hidden_size, dtype=dt, param_dtype=dt)
            if cfg.has_project_in_out:
                self.project_in = Linear(cfg.hidden_size, use_bias=False, dtype=dt, backend=be)
        if st.last and cfg.has_project_in_out:
            self.project_out = Linear(cfg.word_embed_proj_dim, use_bias=False, dtype=dt, backend=be)
        self.layers = [DecoderLayer(cfg, dt, self.fused_qkv, be) for _ in range(st.num_layers)]
        if st.last and cfg.has_final_layer_norm:
            self.layer_norm = LayerNorm(dt)

    def __call__(self, x, positions, attends, all_logits: bool = True,
                 return_hidden: bool = False):
        cfg = self.cfg
        st = self.stage or StageSpec.whole(cfg)
        if st.first:
            h = self.embed_tokens(x)  # [B, S, word_embed_proj_dim]
            if cfg.has_project_in_out:
                h = self.project_in(h)
            h = h + self.embed_positions(positions + cfg.position_offset)  # [B, S, D]
        else:
            h = x.astype(self.dtype)  # the previous stage's hidden states [B, S, D]
        caches = []
        # unrolled on purpose: a scan carrying the cache copies it every step
        for layer, attend in zip(self.layers, attends):
            h, c = layer(h, attend)
            caches.append(c)
        if not st.last:
            return h, caches
        if not all_logits:
            h = h[:, -1:]
        if cfg.has_final_layer_norm:
            h = self.layer_norm(h)
        if cfg.has_project_in_out:
            h = self.project_out(h)
        if return_hidden:  # the caller applies lm_logits to the positions it needs
            return h, caches
        # at init the params are still being made: the head reads the embedding just declared
        params = ({"embed_tokens": {"embedding": self.embed_tokens.embedding}} if self.is_initializing()
                  else self.variables["params"])
        return lm_logits(params, h, self.backend), caches


def lm_logits(params, h, backend: Backend = XLA):
    """The tied LM head: h [..., word_embed_proj_dim] -> float32 logits [..., V]."""
    return backend.logits(params, h)


def lm_argmax(params, h, exclude=None, backend: Backend = XLA, allowed=None):
    """argmax of lm_logits(params, h) over the vocabulary -> int32 [...], each row's `exclude` token
    (int32 [...], -1 for none) left out, and with `allowed` (structured output's token masks:
    sampling.allow_only) the tokens a constrained row may not take; a backend with the screened greedy head
    never makes the logits."""
    return backend.greedy(params, h, exclude, allowed)


def _masked_softmax(scores, mask):
    """Softmax in float32 over the last axis where `mask` (fully masked rows stay finite)."""
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


# a long prompt's queries go a block at a time, each over the keys before it; measured faster only past 512
# tokens (the scores above the diagonal are then most of the attention's work), so shorter prompts go whole
PREFILL_QUERY_BLOCK, PREFILL_BLOCKED_FROM = 128, 513


def _causal_attention(q, k, v, attention_mask):
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


def as_cached(x, dtype):
    """k or v as a cache of `dtype` gives them back: a prompt's tokens attend to each other's k/v as every later
    step reads them, so a prompt prefilled whole, in chunks, after a cached prefix or joining a step gets the
    same numbers (a bfloat16 cache rounds them)."""
    return x if dtype == x.dtype else from_cache(to_cache(x, dtype), x.dtype)


def _prefill_attend(k_cache, v_cache, attention_mask):
    """Causal self-attention over the prompt; writes k/v into entries 0..S-1."""
    def attend(q, k, v):  # each [B, S, H, D]
        ctx = _causal_attention(q, as_cached(k, k_cache.dtype), as_cached(v, v_cache.dtype), attention_mask)
        zero = jnp.int32(0)
        # [B, H, S, D] into the cache's [B, H, max_len, D]
        kc = jax.lax.dynamic_update_slice(k_cache, to_cache(k.transpose(0, 2, 1, 3), k_cache.dtype),
                                          (zero, zero, zero, zero))
        vc = jax.lax.dynamic_update_slice(v_cache, to_cache(v.transpose(0, 2, 1, 3), v_cache.dtype),
                                          (zero, zero, zero, zero))
        return ctx, (kc, vc)
    return attend


def _decode_reference(q, ks, vs, m):
    """A decode step's attention, the model's own: q [B, H, D] over ks, vs [B, H, n, D] where m [B, n]."""
    scores = jnp.einsum("bhd,bhtd->bht", q, from_cache(ks, q.dtype))
    probs = _masked_softmax(scores, m[:, None, :]).astype(q.dtype)
    return jnp.einsum("bht,bhtd->bhd", probs, from_cache(vs, q.dtype))


def _decode_attend(k_cache, v_cache, mask, write_index, read_len=None, backend: Backend = XLA):
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
        ctx = backend.decode_attention(q[:, 0], kc, vc, mask, read_len, _decode_reference)
        return ctx[:, None], (kc, vc)
    return attend


def _extend_attend(k_cache, v_cache, mask, start, per_query: Optional[Backend] = None):
    """A prefill chunk at entries start..start+C-1 of each row (`start` [B]): writes its k/v there (entries
    past the cache, pads only, are dropped) and attends where `mask` [B, C, max_len] says. `per_query`: a
    backend whose decode attention then computes each query as a decode step of its own would (the row's cache
    repeated per query: for a few queries, a speculative check's, whose tokens must be a decode step's)."""
    def attend(q, k, v):  # each [B, C, H, D]
        b, c = q.shape[:2]
        at = start[:, None] + jnp.arange(c)  # [B, C]
        rows = jnp.arange(b)[:, None]
        kc = k_cache.at[rows, :, at].set(to_cache(k, k_cache.dtype), mode="drop")  # [B, C, H, D] entries
        vc = v_cache.at[rows, :, at].set(to_cache(v, v_cache.dtype), mode="drop")
        if per_query is not None:
            flat = mask.reshape(b * c, -1)  # [B * C, max_len]: query i of row b as row b * C + i
            ctx = per_query.decode_attention(q.reshape(b * c, *q.shape[2:]), jnp.repeat(kc, c, 0),
                                             jnp.repeat(vc, c, 0), flat, jnp.max(start) + c, _decode_reference)
            return ctx.reshape(q.shape), (kc, vc)
        scores = jnp.einsum("bqhd,bhkd->bhqk", q, from_cache(kc, q.dtype))
        probs = _masked_softmax(scores, mask[:, None]).astype(q.dtype)
        return jnp.einsum("bhqk,bhkd->bqhd", probs, from_cache(vc, q.dtype)), (kc, vc)
    return attend


def prefill_positions(attention_mask):
    """HF's positions for a left-padded batch: count of real tokens before, pads at -1."""
    m = attention_mask.astype(jnp.int32)
    return jnp.cumsum(m, axis=1) * m - 1


def prefill_step(cfg, params, cache, input_ids, attention_mask, all_logits=True, return_hidden=False,
                 stage: StageSpec | None = None, backend: Backend = XLA):
    """See `prefill`. With return_hidden, the final hidden states [B,S,D] (or [B,D]) come back
    instead of logits: the caller applies `lm_logits` only where it needs them (a 2048-token
    prompt's full logits are a 158 GFLOP product). A `stage` that is not first takes hidden states
    [B,S,D] as `input_ids`; one that is not last returns its hidden states [B,S,D]."""
    dtype = param_dtype(params)
    b, s = attention_mask.shape
    if s > cache["mask"].shape[1]:
        raise ValueError(f"prompt of {s} tokens does not fit a cache of {cache['mask'].shape[1]}")
    attends = [_prefill_attend(kc, vc, attention_mask)
               for kc, vc in zip(cache["k"], cache["v"])]
    out, caches = OPT(cfg, dtype, is_fused(params), stage, backend).apply(
        {"params": params}, input_ids, prefill_positions(attention_mask), attends, all_logits, return_hidden)
    # prefill starts the rows afresh: only the prompt's real tokens are valid
    mask = jnp.zeros_like(cache["mask"]).at[:, :s].set(attention_mask.astype(jnp.bool_))
    new_cache = {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}
    last = stage is None or stage.last
    return (out if all_logits or not last else out[:, 0]), new_cache


def _extend(cfg, params, cache, x, start, chunk_mask, return_hidden=False, stage: StageSpec | None = None,
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
    attends = [_extend_attend(kc, vc, mask, start, backend if per_query else None)
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
    attends = [_decode_attend(kc, vc, mask, write_index, read_len, backend)
               for kc, vc in zip(cache["k"], cache["v"])]
    out, caches = OPT(cfg, dtype, is_fused(params), stage, backend).apply(
        {"params": params}, tokens[:, None], positions[:, None], attends, return_hidden=return_hidden)
    new_cache = {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}
    return out[:, 0], new_cache


def _joining_attend(k_cache, v_cache, mask, write_index, read_len, rows, entries, seg, backend: Backend = XLA):
    """A decode step of the cache's B rows (as `_decode_attend`) with a block of T prompt tokens in the same
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
        ctx = backend.decode_attention(q[0, :b], kc, vc, mask, read_len, _decode_reference)  # [B, H, D]
        qb, kb, vb = q[0, b:], as_cached(k[0, b:], k_cache.dtype), as_cached(v[0, b:], v_cache.dtype)  # [T, H, D]
        probs = _masked_softmax(jnp.einsum("qhd,khd->hqk", qb, kb), allowed[None]).astype(q.dtype)
        ctx_b = jnp.einsum("hqk,khd->qhd", probs, vb)  # [T, H, D]
        return jnp.concatenate([ctx, ctx_b])[None], (kc, vc)
    return attend


def decode_joining_step(cfg, params, cache, tokens, positions, write_index, read_len, block,
                        stage: StageSpec | None = None, backend: Backend = XLA):
    """A decode step of the cache's B rows (as `decode_step`, hidden states) with prompts joining free rows in
    the same pass, so their tokens share its products: `block` = (ids [T] (or on a stage that is not first
    nothing: `tokens` are then the previous stage's hidden states [B + T, D]), rows [T], entries [T], seg
    [T]), see `_joining_attend`. A joining row's cache row starts afresh: valid are its prompt's entries.
    -> (hidden states [B + T, D], cache)."""
    ids, rows, entries, seg = block
    b, n = positions.shape[0], cache["mask"].shape[1]
    joining = jnp.zeros(b, jnp.bool_).at[rows].set(True, mode="drop")
    write_index = jnp.where(joining, n, write_index)  # a joining row's decode writes nothing (out of range)
    mask = cache["mask"].at[jnp.arange(b), write_index].set(True, mode="drop")
    attends = [_joining_attend(kc, vc, mask, write_index, read_len, rows, entries, seg, backend)
               for kc, vc in zip(cache["k"], cache["v"])]
    first = stage is None or stage.first
    x = jnp.concatenate([tokens, ids])[None] if first else tokens[None]  # [1, B + T] or [1, B + T, D]
    out, caches = OPT(cfg, param_dtype(params), is_fused(params), stage, backend).apply(
        {"params": params}, x, jnp.concatenate([positions, entries])[None], attends, return_hidden=True)
    mask = mask.at[rows].set(False, mode="drop").at[rows, entries].set(True, mode="drop")
    return out[0], {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}


def _ragged_attend(k_cache, v_cache, rows, entries, ends, pool_k, pool_v, ptab, plen, backend: Backend):
    """A ragged step's attention (Backend.ragged_attention): the N queries' k/v go into the cache at (rows,
    entries) (out of range: dropped) with one scatter, then query i reads entries [0, ends[i]) of its row."""
    def attend(q, k, v):  # each [1, N, H, D]
        kc = k_cache.at[rows, :, entries].set(to_cache(k[0], k_cache.dtype), mode="drop")  # [N, H, D] entries
        vc = v_cache.at[rows, :, entries].set(to_cache(v[0], v_cache.dtype), mode="drop")
        ctx = backend.ragged_attention(q[0], kc, vc, rows, ends, pool_k, pool_v, ptab, plen)  # [N, H, D]
        return ctx[None], (kc, vc)
    return attend


def ragged_step(cfg, params, cache, tokens, positions, write_index, block, prefix,
                stage: StageSpec | None = None, backend: Backend = XLA):
    """A step of the cache's B rows and of T prompt tokens in one pass (the backend's ragged attention): row b's
    newest token at positions[b] written at entry write_index[b] (out of range: the row is not stepped: it is free,
    or its prompt is still being prefilled), and `block` = (ids [T] (on a stage that is not first nothing: `tokens`
    are the previous stage's hidden states [B + T, D]), rows [T], entries [T]): prompt tokens, each written at its
    entry of its row (its position) and reading the row's entries before it and itself, so a prompt's tokens may
    continue what earlier steps wrote (a long prompt a part at a time, the tail of a cached prefix). `prefix` =
    (pool k, pool v (tuples over layers of [H, P, bs, D]), ptab [B, Mp], plen [B]): a row's first plen entries are
    read from those pool blocks (a cached prefix shared by rows, never copied into them). With no rows stepped
    (positions [0]) every token is in the block: a running row's newest token is then a block token at its entry.
    -> (hidden states [B + T, D], cache)."""
    ids, rows, entries = block
    pool_k, pool_v, ptab, plen = prefix
    b, (rows_count, n) = positions.shape[0], cache["mask"].shape  # (b: 0 where every token is in the block)
    q_rows = jnp.concatenate([jnp.arange(b, dtype=jnp.int32), rows])  # [N]
    q_entries = jnp.concatenate([write_index, entries])
    q_ends = jnp.where((q_rows < rows_count) & (q_entries < n), q_entries + 1, 0)
    attends = [_ragged_attend(kc, vc, q_rows, q_entries, q_ends, pk, pv, ptab, plen, backend)
               for kc, vc, pk, pv in zip(cache["k"], cache["v"], pool_k, pool_v)]
    first = stage is None or stage.first
    x = jnp.concatenate([tokens, ids])[None] if first else tokens[None]  # [1, B + T] or [1, B + T, D]
    out, caches = OPT(cfg, param_dtype(params), is_fused(params), stage, backend).apply(
        {"params": params}, x, jnp.concatenate([positions, entries])[None], attends, return_hidden=True)
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
hidden states [B, D] come back instead of logits (see lm_logits, lm_argmax)."""


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


def is_fused(params: dict) -> bool:
    return "qkv_proj" in params["layers_0"]["self_attn"]


def param_dtype(params):
    """The model dtype: activations' (packed weights are uint8 bytes: skipped)."""
    return next(x.dtype for x in jax.tree_util.tree_leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))


def cache_dtype(params, backend: Backend = XLA):
    """The KV cache's dtype: the model's, but bfloat16 where the CPU's decode attention reads it beside
    bfloat16 or int8 weights (a decode step's attention is a read of the cache: half the bytes; those formats
    already round each product's rows). Every cache of a model follows this one rule, so the engine and
    generate() compute the same tokens. That bfloat16 cache holds its numbers' bits as uint16: XLA's CPU
    scatters bfloat16 by converting the whole operand to float32 and back (a decode step's one-entry write
    then cost more than the step), uint16 in place; `to_cache` / `from_cache` read and write it."""
    if backend.attention and backend.weights in ("bfloat16", "int8"):
        return BF16_BITS
    return param_dtype(params)


BF16_BITS = jnp.dtype(jnp.uint16)  # a cache dtype: bfloat16 numbers kept as their bits (see cache_dtype)


def to_cache(x, dtype):
    """k or v values as a cache of `dtype` holds them."""
    if dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def from_cache(x, dtype):
    """Cache entries as numbers of `dtype`."""
    if x.dtype == BF16_BITS:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(dtype)

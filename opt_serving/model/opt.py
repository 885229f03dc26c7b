"""Flax OPT for every size, with pure jitted prefill / decode steps over a KV cache.

Pre-LN models (125m, 1.3b, ... 175b) and OPT-350m (post-LN, 512-wide embeddings
projected in and out of the decoder, no final layer norm). Learned positions
with fairseq's offset of 2, ReLU, logits tied to the token embedding.

Params, activations and the cache are in the model dtype; layer norms and the
attention softmax run in float32, and logits come back as float32.

The engine-facing functions (cfg is static, the cache is donated):
    prefill(cfg, params, cache, input_ids[B,S], attention_mask[B,S]) -> (logits[B,S,V], cache)
    decode(cfg, params, cache, tokens[B], positions[B], write_index[B]) -> (logits[B,V], cache)
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opt_serving import sampling
from opt_serving.config import OPTConfig
from opt_serving.model import cpu_kernels
from opt_serving.model.kv_cache import init_cache

LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which OPT uses


class LayerNorm(nn.Module):
    """Layer norm computed in float32 whatever the model dtype."""
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(epsilon=LN_EPS, dtype=jnp.float32, param_dtype=self.dtype,
                         name="ln")(x.astype(jnp.float32))
        return y.astype(self.dtype)


class Linear(nn.Module):
    """nn.Dense's params and numbers (kernel [in, out], bias), plus two things it cannot do:
    a weight pre-packed for the CPU (a `packed` param in place of `kernel`, see cpu_kernels.py),
    and the ReLU that follows fc1 fused into that product."""
    features: int
    use_bias: bool = True
    relu: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        bias = (self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
                if self.use_bias else None)
        if self.has_variable("params", "packed"):
            return cpu_kernels.matmul(x, self.get_variable("params", "packed"), self.features, bias, self.relu)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                            self.dtype)
        y = jax.lax.dot_general(x.astype(self.dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + bias
        return nn.relu(y) if self.relu else y


class SelfAttention(nn.Module):
    cfg: OPTConfig
    dtype: Any = jnp.float32
    fused_qkv: bool = False  # params hold one qkv_proj [D, 3D] (see fuse_qkv) instead of q/k/v

    def setup(self):
        h = self.cfg.hidden_size
        dense = partial(Linear, dtype=self.dtype)
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

    def setup(self):
        cfg, dt = self.cfg, self.dtype
        self.self_attn = SelfAttention(cfg, dt, self.fused_qkv)
        self.self_attn_layer_norm = LayerNorm(dt)
        self.fc1 = Linear(cfg.ffn_dim, relu=True, dtype=dt)
        self.fc2 = Linear(cfg.hidden_size, dtype=dt)
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

    def setup(self):
        cfg, dt = self.cfg, self.dtype
        st = self.stage or StageSpec.whole(cfg)
        if st.first or st.last:  # the input embedding, tied to the LM head
            self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.word_embed_proj_dim,
                                         dtype=dt, param_dtype=dt)
        if st.first:
            self.embed_positions = nn.Embed(cfg.max_position_embeddings + cfg.position_offset,
                                            cfg.hidden_size, dtype=dt, param_dtype=dt)
            if cfg.has_project_in_out:
                self.project_in = Linear(cfg.hidden_size, use_bias=False, dtype=dt)
        if st.last and cfg.has_project_in_out:
            self.project_out = Linear(cfg.word_embed_proj_dim, use_bias=False, dtype=dt)
        self.layers = [DecoderLayer(cfg, dt, self.fused_qkv) for _ in range(st.num_layers)]
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
        if self.is_initializing():
            return lm_logits(self.embed_tokens.embedding, h), caches
        return lm_logits(self.variables["params"], h), caches


def lm_logits(params_or_embedding, h):
    """The tied LM head: h [..., word_embed_proj_dim] -> float32 logits [..., V]. Takes the params
    (using the packed copy of the embedding when there is one) or the embedding [V, D] itself."""
    p = params_or_embedding
    if isinstance(p, dict) and "lm_head" in p:  # packed (cpu_kernels.pack_params)
        return cpu_kernels.matmul(h.astype(jnp.float32), p["lm_head"]["packed"],
                                  p["embed_tokens"]["embedding"].shape[0])
    embedding = p["embed_tokens"]["embedding"] if isinstance(p, dict) else p
    return jnp.einsum("...d,vd->...v", h, embedding, preferred_element_type=jnp.float32)


def lm_argmax(params, h, exclude=None):
    """argmax of lm_logits(params, h) over the vocabulary -> int32 [...], each row's `exclude` token
    (int32 [...], -1 for none) left out. Where the params carry the screened greedy head
    (cpu_kernels.greedy_tokens) the float32 logits are never made."""
    if isinstance(params, dict) and cpu_kernels.has_head(params):
        return cpu_kernels.greedy_tokens(params, h, exclude)
    logits = lm_logits(params, h)
    return cpu_kernels.argmax(logits if exclude is None else sampling.leave_out(logits, exclude))


def _masked_softmax(scores, mask):
    """Softmax in float32 over the last axis where `mask` (fully masked rows stay finite)."""
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def _prefill_attend(k_cache, v_cache, attention_mask):
    """Causal self-attention over the prompt; writes k/v into entries 0..S-1."""
    def attend(q, k, v):  # each [B, S, H, D]
        s = q.shape[1]
        causal = jnp.tril(jnp.ones((s, s), jnp.bool_))
        mask = causal[None, None] & attention_mask[:, None, None, :].astype(jnp.bool_)  # [B,1,S,S]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        probs = _masked_softmax(scores, mask).astype(q.dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        zero = jnp.int32(0)
        # [B, H, S, D] into the cache's [B, H, max_len, D]
        kc = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3).astype(k_cache.dtype),
                                          (zero, zero, zero, zero))
        vc = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).astype(v_cache.dtype),
                                          (zero, zero, zero, zero))
        return ctx, (kc, vc)
    return attend


def _decode_attend(k_cache, v_cache, mask, write_index, read_len=None):
    """One new token per row, written at that row's own index, attending to its valid entries.

    With `read_len` (traced) every valid entry and write_index lie below it: a decode step's
    cost is reading the cache, so on a CPU a kernel reads only entries 0..read_len-1
    (cpu_kernels.decode_attention); elsewhere the whole cache is read."""
    def reference(q, ks, vs, m):  # [B, H, D], [B, H, n, D], [B, H, n, D], [B, n]
        scores = jnp.einsum("bhd,bhtd->bht", q, ks)
        probs = _masked_softmax(scores, m[:, None, :]).astype(q.dtype)
        return jnp.einsum("bht,bhtd->bhd", probs, vs)

    def attend(q, k, v):  # each [B, 1, H, D]
        if jnp.ndim(write_index) == 0:  # every row writes the same entry: an in-place slice update
            at = (0, 0, write_index, 0)  # [B, H, 1, D] into [B, H, max_len, D]
            kc = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3).astype(k_cache.dtype), at)
            vc = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).astype(v_cache.dtype), at)
        else:
            rows = jnp.arange(q.shape[0])
            kc = k_cache.at[rows, :, write_index].set(k[:, 0].astype(k_cache.dtype))  # scatter [B,H,D]
            vc = v_cache.at[rows, :, write_index].set(v[:, 0].astype(v_cache.dtype))
        if read_len is None:
            ctx = reference(q[:, 0], kc, vc, mask)
        else:
            ctx = cpu_kernels.decode_attention(q[:, 0], kc, vc, mask, read_len, reference)
        return ctx[:, None], (kc, vc)
    return attend


def prefill_positions(attention_mask):
    """HF's positions for a left-padded batch: count of real tokens before, pads at -1."""
    m = attention_mask.astype(jnp.int32)
    return jnp.cumsum(m, axis=1) * m - 1


def _prefill(cfg, params, cache, input_ids, attention_mask, all_logits=True, return_hidden=False,
             stage: StageSpec | None = None):
    """See `prefill`. With return_hidden, the final hidden states [B,S,D] (or [B,D]) come back
    instead of logits: the caller applies `lm_logits` only where it needs them (a 2048-token
    prompt's full logits are a 158 GFLOP product). A `stage` that is not first takes hidden states
    [B,S,D] as `input_ids`; one that is not last returns its hidden states [B,S,D]."""
    dtype = cache["k"][0].dtype
    b, s = attention_mask.shape
    if s > cache["mask"].shape[1]:
        raise ValueError(f"prompt of {s} tokens does not fit a cache of {cache['mask'].shape[1]}")
    attends = [_prefill_attend(kc, vc, attention_mask)
               for kc, vc in zip(cache["k"], cache["v"])]
    out, caches = OPT(cfg, dtype, is_fused(params), stage).apply(
        {"params": params}, input_ids, prefill_positions(attention_mask), attends, all_logits, return_hidden)
    # prefill starts the rows afresh: only the prompt's real tokens are valid
    mask = jnp.zeros_like(cache["mask"]).at[:, :s].set(attention_mask.astype(jnp.bool_))
    new_cache = {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}
    last = stage is None or stage.last
    return (out if all_logits or not last else out[:, 0]), new_cache


def _decode(cfg, params, cache, tokens, positions, write_index, read_len=None, return_hidden=False,
            stage: StageSpec | None = None):
    """See `decode`. A `stage` that is not first takes hidden states [B, D] as `tokens`; one that is
    not last returns its hidden states [B, D]."""
    dtype = cache["k"][0].dtype
    rows = jnp.arange(positions.shape[0])
    mask = cache["mask"].at[rows, write_index].set(True)
    attends = [_decode_attend(kc, vc, mask, write_index, read_len)
               for kc, vc in zip(cache["k"], cache["v"])]
    out, caches = OPT(cfg, dtype, is_fused(params), stage).apply(
        {"params": params}, tokens[:, None], positions[:, None], attends, return_hidden=return_hidden)
    new_cache = {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches), "mask": mask}
    return out[:, 0], new_cache


prefill = jax.jit(_prefill, static_argnums=(0,), static_argnames=("all_logits",),
                  donate_argnums=(2,))
prefill.__doc__ = """prefill(cfg, params, cache, input_ids[B,S], attention_mask[B,S], all_logits=True)
    -> (logits float32 [B,S,V] (or [B,V] for the last position when all_logits=False), cache)

Left-padded prompts; positions come from the mask as in HF (cumsum(mask)-1, +2
offset). Writes cache entries 0..S-1 and resets each row's validity to the
prompt's real tokens. The cache is donated; pass S bucketed (bucket_length)."""

decode = jax.jit(_decode, static_argnums=(0,), donate_argnums=(2,))
decode.__doc__ = """decode(cfg, params, cache, tokens[B], positions[B], write_index[B], read_len=None)
    -> (logits float32 [B,V], cache)

One token per row: `positions` are 0-based token positions (the +2 offset is
added inside), `write_index` the cache entry each row writes (or a scalar int32: all rows
write that entry, an in-place slice update); each row attends
to its valid entries plus the new one. The cache is donated. `read_len`
(traced, e.g. the longest row's length): every valid entry and write_index lie
below it, and on a CPU only those entries are read. With `return_hidden` the final
hidden states [B, D] come back instead of logits (see lm_logits, lm_argmax)."""


def forward(cfg: OPTConfig, params, input_ids, attention_mask=None):
    """Full-sequence logits without keeping a cache (reference and tests)."""
    input_ids = jnp.asarray(input_ids)
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    dtype = param_dtype(params)
    cache = init_cache(cfg, input_ids.shape[0], input_ids.shape[1], dtype)
    return prefill(cfg, params, cache, input_ids, jnp.asarray(attention_mask))[0]


def fuse_qkv(params: dict) -> dict:
    """The same params with each layer's q, k and v projections as one qkv_proj [D, 3D].

    One [D, 3D] matmul runs faster than three [D, D] ones (XLA CPU: ~1.5x at batch 16-64).
    For one device only: a tensor-parallel plan splits q, k and v by heads separately."""
    out = dict(params)
    for name, layer in params.items():
        attn = layer.get("self_attn", {}) if name.startswith("layers_") else {}
        if "q_proj" not in attn:
            continue
        parts = [attn[n] for n in ("q_proj", "k_proj", "v_proj")]
        fused = {key: jnp.concatenate([p[key] for p in parts], axis=-1) for key in ("kernel", "bias")}
        rest = {k: v for k, v in attn.items() if k not in ("q_proj", "k_proj", "v_proj")}
        out[name] = {**layer, "self_attn": {**rest, "qkv_proj": fused}}
    return out


def fuse_qkv_on_one_device(params: dict) -> dict:
    """fuse_qkv when every parameter sits on one device; a sharded (tensor-parallel) tree as it is."""
    return fuse_qkv(params) if len(cpu_kernels.devices(params)) <= 1 else params


def runtime_params(params: dict) -> dict:
    """The layout the steps run fastest on where the params lie: on one device q/k/v fused
    (fuse_qkv), and on one CPU in float32 every dense weight pre-packed for oneDNN (cpu_kernels.pack_params).
    Idempotent; the forward pass gives the same numbers with either layout."""
    if cpu_kernels.is_packed(params):
        return params
    return cpu_kernels.pack_params(fuse_qkv_on_one_device(params))


def checkpoint_params(params: dict) -> dict:
    """runtime_params undone: the checkpoint's layout (plain kernels, q_proj / k_proj / v_proj)."""
    return unfuse_qkv(cpu_kernels.unpack_params(params))


def unfuse_qkv(params: dict) -> dict:
    """fuse_qkv undone: the checkpoint's layout (q_proj, k_proj, v_proj)."""
    out = dict(params)
    for name, layer in params.items():
        attn = layer.get("self_attn", {}) if name.startswith("layers_") else {}
        if "qkv_proj" not in attn:
            continue
        parts = {key: jnp.split(attn["qkv_proj"][key], 3, axis=-1) for key in ("kernel", "bias")}
        rest = {k: v for k, v in attn.items() if k != "qkv_proj"}
        rest.update({n: {key: parts[key][i] for key in parts}
                     for i, n in enumerate(("q_proj", "k_proj", "v_proj"))})
        out[name] = {**layer, "self_attn": rest}
    return out


def is_fused(params: dict) -> bool:
    return "qkv_proj" in params["layers_0"]["self_attn"]


def param_dtype(params):
    """The model dtype (packed weights are uint8 bytes: skipped)."""
    return next(x.dtype for x in jax.tree_util.tree_leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))


def init_params(cfg: OPTConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02):
    """Random params (normal(0, std) weights, zero biases, unit norms), as `dummy=True` uses.

    Drawn on the host one tensor at a time (no compile, never two copies of the model)."""
    rng = np.random.default_rng(seed)

    def make(path, leaf):
        name = path[-1].key
        if name == "bias":
            return jnp.zeros(leaf.shape, dtype)
        if name == "scale":
            return jnp.ones(leaf.shape, dtype)
        host = rng.standard_normal(leaf.shape, np.float32) * np.float32(std)
        return jax.device_put(host.astype(dtype))

    return jax.tree_util.tree_map_with_path(make, param_tree_shapes(cfg))


def stage_params(params: dict, stage: StageSpec) -> dict:
    """A whole model's param tree (checkpoint layout) cut down to one stage's: its layers numbered
    from 0, the embeddings on the first stage, the final norm, projection and tied embedding on the
    last."""
    out = {f"layers_{i - stage.start}": params[f"layers_{i}"] for i in range(stage.start, stage.stop)}
    keep = set()
    if stage.first or stage.last:
        keep.add("embed_tokens")
    if stage.first:
        keep |= {"embed_positions", "project_in"}
    if stage.last:
        keep |= {"project_out", "layer_norm"}
    out.update({k: v for k, v in params.items() if k in keep})
    return out


def param_tree_shapes(cfg: OPTConfig) -> dict:
    """The Flax param tree's shapes, without allocating it."""
    b = jnp.zeros((1, 1), jnp.int32)
    attends = [lambda q, k, v: (q, None)] * cfg.num_hidden_layers
    return jax.eval_shape(lambda: OPT(cfg).init(jax.random.PRNGKey(0), b, b, attends)["params"])


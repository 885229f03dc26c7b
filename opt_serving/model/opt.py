"""Flax OPT for every size: the model's modules (the pure steps that run them over a KV cache: steps.py).

Pre-LN models (125m, 1.3b, ... 175b) and OPT-350m (post-LN, 512-wide embeddings
projected in and out of the decoder, no final layer norm). Learned positions
with fairseq's offset of 2, ReLU, logits tied to the token embedding.

Params, activations and the cache are in the model dtype; layer norms and the
attention softmax run in float32, and logits come back as float32.

The operations whose implementation depends on where the model runs (the dense products, the tied LM head,
a decode step's attention) go through a `Backend` (opt_serving/backend), a static attribute of the modules
and a static argument of the steps: `Backend.xla()` (plain XLA) unless the caller holds another, chosen
where the params were loaded (model/layout.py: runtime_params).

A layer's attention is not the modules' own: each step hands `OPT` one `attend` a layer (attends.py), which
writes the layer's k/v into its cache and reads what that step may see.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from opt_serving.backend import Backend
from opt_serving.config import OPTConfig

LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which OPT uses
XLA = Backend.xla()


class _Norm(nn.Module):
    """The layer norm's params (`scale`, `bias`) where nn.LayerNorm kept them (checkpoints' "ln"), run by the
    backend (Backend.layer_norm)."""
    dtype: Any
    backend: Backend

    @nn.compact
    def __call__(self, x):
        return self.backend.layer_norm(self, x, LN_EPS, self.dtype)


class LayerNorm(nn.Module):
    """Layer norm computed in float32 whatever the model dtype."""
    dtype: Any = jnp.float32
    backend: Backend = XLA

    @nn.compact
    def __call__(self, x):
        return _Norm(self.dtype, self.backend, name="ln")(x.astype(jnp.float32)).astype(self.dtype)


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

    def __call__(self, x, attend: Callable, keep=None):
        """`keep` (int32 [K]): only these tokens' queries attend (every token's k/v still goes into the cache)
        -> [B, K, D]; the attend takes it as a fourth argument."""
        cfg = self.cfg
        b, s, _ = x.shape
        split = lambda t: t.reshape(b, s, cfg.num_attention_heads, cfg.head_dim)  # [B, S, H, D]
        if self.fused_qkv:
            q, k, v = jnp.split(self.qkv_proj(x), 3, axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # OPT scales q after its bias, as HF and metaseq do
        q, k, v = split(q * (cfg.head_dim ** -0.5)), split(k), split(v)
        ctx, cache_out = attend(q, k, v) if keep is None else attend(q, k, v, keep)  # ctx [B, S or K, H, D]
        return self.out_proj(ctx.reshape(b, ctx.shape[1], cfg.hidden_size)), cache_out


class DecoderLayer(nn.Module):
    cfg: OPTConfig
    dtype: Any = jnp.float32
    fused_qkv: bool = False
    backend: Backend = XLA

    def setup(self):
        cfg, dt, be = self.cfg, self.dtype, self.backend
        self.self_attn = SelfAttention(cfg, dt, self.fused_qkv, be)
        self.self_attn_layer_norm = LayerNorm(dt, be)
        self.fc1 = Linear(cfg.ffn_dim, relu=True, dtype=dt, backend=be)
        self.fc2 = Linear(cfg.hidden_size, dtype=dt, backend=be)
        self.final_layer_norm = LayerNorm(dt, be)

    def __call__(self, h, attend: Callable, keep=None):
        """h [B, S, D] -> [B, S, D], or with `keep` (int32 [K]) only those tokens past the attention's k/v:
        [B, K, D]."""
        pre = self.cfg.do_layer_norm_before
        residual = h if keep is None else h[:, keep]
        x = self.self_attn_layer_norm(h) if pre else h
        x, cache_out = self.self_attn(x, attend, keep)
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
            self.layer_norm = LayerNorm(dt, be)

    def __call__(self, x, positions, attends, all_logits: bool = True,
                 return_hidden: bool = False, keep=None):
        """`keep` (int32 [K], a last stage): the tokens whose outputs are wanted, all others' only as k/v for the
        cache. The last layer then computes those K alone past its k/v (a step's prompt tokens but their last
        need nothing more from it): outputs [B, K, ...]."""
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
        for i, (layer, attend) in enumerate(zip(self.layers, attends)):
            h, c = layer(h, attend, keep if st.last and i == len(self.layers) - 1 else None)
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


def is_fused(params: dict) -> bool:
    return "qkv_proj" in params["layers_0"]["self_attn"]


def param_dtype(params):
    """The model dtype: activations' (packed weights are uint8 bytes: skipped)."""
    return next(x.dtype for x in jax.tree_util.tree_leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))

"""What the model's costly operations run on, decided once, where the params are loaded.

A `Backend` is a frozen, hashable value: the Flax model takes it as a static attribute (`opt.OPT(backend=...)`)
and the jitted steps as a static argument, and its methods are the operations whose implementation depends on
where the model runs: the dense layers' products, the layer norms, the tied LM head (logits, greedy tokens), a
decode step's attention, the argmax over the vocabulary. `Backend.xla()` is plain XLA, right on every device; the CPU
kernels (backend/cpu/) run where `choose` / `for_params` say, and `prepare` puts the params in the layout
they read (`plain` undoes it).

The rule: the kernels' products, decode attention and screened greedy head on one CPU device in float32
(and under bfloat16 or int8 weights; the screened head with float32 and bfloat16 ones, which keep a float32 LM
head; `Settings` can turn them off); the argmax kernel on any CPU devices; plain XLA on other platforms.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import sampling
from opt_serving.backend.cpu import _lib, attention, head, norm, products
from opt_serving.settings import Settings

__all__ = ["Backend", "bfloat16_products", "choose", "devices", "for_params"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the model's operations run (see the module docstring); every field False is plain XLA."""
    products: bool = False     # dense layers and logits: oneDNN products on weights packed by `prepare`
    attention: bool = False    # decode steps: the kernel reading only the cache entries written so far
    greedy_head: bool = False  # greedy steps: the screened (int8 or bfloat16) head, never the float32 logits
    #                            (float32 and bfloat16 weights: both keep a float32 LM head, products.head_format)
    cpu_argmax: bool = False   # the argmax kernel (on a CPU; traced for every platform)
    # the dense weights' format (products.FORMATS): "float32" the params' own kernels (whatever their dtype);
    # "bfloat16" float32 params whose packed products run on bfloat16 copies; "int8" model/quantize.py's
    # qkernel + scale (packed, or multiplied by XLA as they are where products is off)
    weights: str = "float32"

    def __post_init__(self):
        products.check_format(self.weights)
        if self.greedy_head and (not self.products or self.weights == "int8"):
            raise ValueError("the screened greedy head comes with float32 or bfloat16 packed products (prepare "
                             "packs both)")
        if self.weights == "bfloat16" and not self.products:
            raise ValueError("bfloat16 weights here are packed products' (plain XLA takes bfloat16 params)")

    @classmethod
    def xla(cls) -> "Backend":
        return cls()

    # ---- the operations the model calls ----
    def dense(self, module: nn.Module, x, features: int, *, use_bias: bool = True, relu: bool = False,
              dtype=jnp.float32):
        """`module`'s dense layer x [..., K] -> [..., features]: its params declared (at init) and read
        through it: `bias` [features], and `kernel` [K, features] (plain XLA) or `packed` (packed products).
        The ReLU after fc1 is fused into the packed product."""
        bias = module.param("bias", nn.initializers.zeros, (features,), dtype) if use_bias else None
        scale = module.get_variable("params", "scale") if self.weights == "int8" else None
        if self.products:
            packed = module.get_variable("params", "packed")
            if packed is None:  # init, or params this backend did not prepare
                raise ValueError(f"{module.name}: no packed weight; packed weights come from Backend.prepare "
                                 "(init with Backend.xla())")
            return products.matmul(x, packed, features, bias, relu, self.weights, scale)
        if self.weights == "int8":  # weight-only: the int8 numbers times their column scales
            y = jax.lax.dot_general(x.astype(dtype), module.get_variable("params", "qkernel").astype(dtype),
                                    (((x.ndim - 1,), (0,)), ((), ()))) * scale.astype(dtype)
        else:
            kernel = module.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], features), dtype)
            y = jax.lax.dot_general(x.astype(dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + bias
        return nn.relu(y) if relu else y

    def layer_norm(self, module: nn.Module, x, eps: float, dtype=jnp.float32):
        """`module`'s layer norm of float32 x [..., D] over its last axis: its params declared (at init) and read
        through it, `scale` and `bias` [D] of `dtype`, nn.LayerNorm's. With packed products the CPU kernel's, each
        row alone (a row's numbers the same whatever the rows beside it); otherwise nn.LayerNorm's numbers."""
        d = x.shape[-1]
        scale = module.param("scale", nn.initializers.ones, (d,), dtype)
        bias = module.param("bias", nn.initializers.zeros, (d,), dtype)
        if self.products:
            return norm.layer_norm(x, scale, bias, eps)
        return nn.LayerNorm(epsilon=eps, dtype=jnp.float32, param_dtype=dtype).apply(
            {"params": {"scale": scale, "bias": bias}}, x)

    def logits(self, params: dict, h):
        """The tied LM head: h [..., D] -> float32 logits [..., V]. int8 reads only its own copy (`lm_head`): a
        pipeline's last stage holds no embedding then."""
        scale = params["lm_head"]["scale"] if self.weights == "int8" else None  # [V]
        if self.products:
            vocab = params["embed_tokens"]["embedding"].shape[0] if scale is None else scale.shape[0]
            return products.matmul(h.astype(jnp.float32), params["lm_head"]["packed"], vocab,
                                   weights=products.head_format(self.weights), scales=scale)
        if self.weights == "int8":
            q = params["lm_head"]["qkernel"]  # [D, V]
            return jnp.einsum("...d,dv->...v", h, q.astype(h.dtype), preferred_element_type=jnp.float32) * scale
        embedding = params["embed_tokens"]["embedding"]  # [V, D]
        return jnp.einsum("...d,vd->...v", h, embedding, preferred_element_type=jnp.float32)

    def greedy(self, params: dict, h, exclude=None, allowed=None):
        """argmax of logits(params, h) over the vocabulary -> int32 [...], each row's `exclude` token (int32
        [...], -1 for none) left out, and with `allowed` (structured output's masks: sampling.allow_only) a
        constrained row's disallowed tokens. With the screened head the float32 logits are never made."""
        if self.greedy_head:
            masks = None
            if allowed is not None:  # unconstrained rows: every token allowed
                masks = jnp.where(allowed[1][:, None], allowed[0], -1)
            return head.greedy_tokens(params, h, exclude, masks)
        logits = sampling.allow_only(self.logits(params, h), allowed)
        return self.argmax(logits if exclude is None else sampling.leave_out(logits, exclude))

    def argmax(self, x):
        """jnp.argmax over the last axis -> int32 (the first maximum; a NaN wins)."""
        return head.argmax(x, sampling.argmax) if self.cpu_argmax else sampling.argmax(x)

    def decode_attention(self, q, k_cache, v_cache, mask, read_len: Optional[jax.Array], reference: Callable):
        """One decode step's attention, q [B, H, D] over k/v [B, H, T, D] where mask [B, T] -> [B, H, D].
        `reference(q, k, v, mask)` is the model's own (it reads all T entries); with the attention kernel and a
        `read_len` (traced: every valid entry lies below it) only the entries below read_len are read. q and mask
        may have C rows a cache row ([B * C, ...]: row i reads cache row i // C; `reference` then takes them so)."""
        if self.attention and read_len is not None:
            return attention.decode_attention(q, k_cache, v_cache, mask, read_len, reference)
        return reference(q, k_cache, v_cache, mask)

    @property
    def ragged(self) -> bool:
        """Whether this backend runs ragged steps (steps.ragged_step): prompts continuing rows and cached prefixes
        read from the pool inside decode steps. The CPU attention kernel does; elsewhere prompts are prefilled in
        passes of their own."""
        return self.attention

    def ragged_attention(self, q, k_cache, v_cache, rows, ends, pool_k, pool_v, ptab, plen):
        """A ragged step's attention: q [N, H, D], query i reading the entries [0, ends[i]) of cache row rows[i]
        (k/v [B, H, T, D]), a row's first plen[row] entries from pool blocks ptab[row] -> [N, H, D] float32."""
        if not self.ragged:
            raise NotImplementedError("ragged steps run on the CPU attention kernel (Backend.ragged)")
        return attention.ragged_attention(q, k_cache, v_cache, rows, ends, pool_k, pool_v, ptab, plen)

    # ---- the params ----
    def prepare(self, params: dict) -> dict:
        """The params in the layout this backend reads: with packed products every dense weight packed
        (`kernel` -> `packed`) and a packed copy of the tied embedding (`lm_head`, with the screened head's
        int8 or bfloat16 copy and row norms when greedy_head: head.pack_head); as they are otherwise. Numbers unchanged."""
        if not self.products:
            return params
        device = next(iter(devices(params)))
        out = products.pack_params(params, device, self.weights)
        if self.greedy_head and "embed_tokens" in params:
            out["lm_head"].update(head.pack_head(params["embed_tokens"]["embedding"], device))
        return out

    def plain(self, params: dict, like: dict) -> dict:
        """`prepare` undone. `like`: a tree in the plain layout (arrays or shapes: param_tree.param_tree_shapes)."""
        return products.unpack_params(params, like, self.weights) if self.products else params


def choose(devices: Iterable, dtype, settings: Optional[Settings] = None,
           weights: str = "float32") -> Backend:
    """The backend for params of `dtype` on `devices` (see the module docstring for the rule) whose dense
    weights come as `weights` ("int8": model/quantize.py's; "bfloat16": float32 params to run in bfloat16
    products, see bfloat16_products). `settings`: Settings.from_env() by default."""
    settings = settings or Settings.from_env()
    devices = list(devices)
    xla = Backend(weights="int8" if weights == "int8" else "float32")
    if not settings.kernels or not devices or any(d.platform != "cpu" for d in devices):
        return xla
    if _lib.load(settings.threads()) is None:
        return xla
    one = len(devices) == 1 and dtype is not None and jnp.dtype(dtype) == jnp.float32
    if weights == "bfloat16" and not (one and bfloat16_products(devices, settings)):
        raise ValueError("bfloat16 products need float32 params on one CPU device with native bfloat16 "
                         "(see bfloat16_products)")
    return Backend(products=one, attention=one, cpu_argmax=True, weights=weights if one else xla.weights,
                   greedy_head=one and weights != "int8" and settings.bf16_screen and head.supported())


def bfloat16_products(devices: Iterable, settings: Optional[Settings] = None) -> bool:
    """Whether bfloat16 weights on `devices` can run as packed bfloat16 products with float32 accumulation
    (one CPU device whose oneDNN runs bfloat16 natively: AVX512_BF16 or AMX). Where not, bfloat16 params run
    on XLA, which converts them to float32 at each product."""
    settings = settings or Settings.from_env()
    devices = list(devices)
    return (settings.kernels and len(devices) == 1 and devices[0].platform == "cpu"
            and _lib.load(settings.threads()) is not None and head.supported())


def for_params(params: dict, settings: Optional[Settings] = None, weights: str = "float32") -> Backend:
    """choose() for a param tree where it lies (its devices; its dtype where all its floating arrays share
    one). The screened head needs an embedding with every weight finite (its error bound)."""
    floating = {x.dtype for x in jax.tree_util.tree_leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)}
    backend = choose(devices(params), floating.pop() if len(floating) == 1 else None, settings, weights)
    if backend.greedy_head and not ("embed_tokens" in params
                                    and np.isfinite(np.asarray(params["embed_tokens"]["embedding"])).all()):
        backend = dataclasses.replace(backend, greedy_head=False)
    return backend


def devices(params: dict) -> set:
    """The devices a param tree's arrays lie on."""
    return set().union(*(x.sharding.device_set for x in jax.tree_util.tree_leaves(params)
                         if hasattr(x, "sharding")))

"""The vocabulary end of a step on a CPU: an argmax, and the screened greedy head.

XLA CPU's own argmax (and its TopK with k=1) are slow over OPT's 50272 logits, hence `argmax`.

`greedy_tokens` is a greedy step's argmax over the LM head without its float32 logits: on a CPU with native
bfloat16 products (AVX512_BF16, AMX) a bfloat16 copy of the head (`pack_head`) is multiplied at twice the
float32 rate, and the few tokens whose proven error interval reaches the best one are scored again exactly,
so the token is the float32 argmax's (the proof is in csrc/head.cc; figures in benchmark/README.md).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend.cpu import _lib


def argmax(x, reference: Callable) -> jax.Array:
    """jnp.argmax(x, -1).astype(int32) for float32 x [..., V] (the first maximum; a NaN wins): the kernel on a
    CPU, `reference(x)` on another platform or for another dtype."""
    if x.dtype != jnp.float32:
        return reference(x)
    _lib.lib()  # its FFI target registered

    def kernel(x):
        x2 = x.reshape(-1, x.shape[-1])  # [rows, V]
        out = jax.ffi.ffi_call(_lib.ARGMAX, jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32))(x2)
        return out.reshape(x.shape[:-1])
    return jax.lax.platform_dependent(x, cpu=kernel, default=reference)


def supported() -> bool:
    """The extension loads and this CPU runs bfloat16 products natively."""
    lib = _lib.load()
    return lib is not None and bool(lib.opt_head_supported())


def pack_head(embedding, device=None) -> dict:
    """The tied embedding [V, K] -> {"bf16": packed bfloat16 head, "row_norms": [V] float32 (rounded up)}.
    A non-finite weight has no error bound: ValueError (Backend.for_params leaves the screen off then)."""
    lib = _lib.lib()
    e = np.ascontiguousarray(np.asarray(embedding), np.float32)
    v, k = e.shape
    out = np.empty(lib.opt_head_packed_bytes(k, v), np.uint8)
    norms = np.empty(v, np.float32)
    rc = lib.opt_head_pack(e.ctypes.data, k, v, out.ctypes.data, norms.ctypes.data)
    if rc == 2:
        raise ValueError("the embedding holds a non-finite weight: the screen has no error bound for it")
    if rc != 0:
        raise RuntimeError(f"oneDNN could not pack a bfloat16 [{k}, {v}] head")
    device = device or jax.devices("cpu")[0]
    return {"bf16": jax.device_put(out, device), "row_norms": jax.device_put(norms, device)}


def greedy_tokens(params: dict, h, exclude=None) -> jax.Array:
    """argmax_j h[..., K] . embedding[j] as int32 [...], for params whose `lm_head` holds pack_head's entries
    (float32 h). `exclude` [...] (int32, -1 for none): a token each row may not take (EOS while
    min_new_tokens holds it back)."""
    _lib.lib()  # its FFI target registered
    head, embedding = params["lm_head"], params["embed_tokens"]["embedding"]
    x2 = h.astype(jnp.float32).reshape(-1, h.shape[-1])  # [rows, K]
    ex = jnp.full(h.shape[:-1], -1, jnp.int32) if exclude is None else jnp.asarray(exclude, jnp.int32)
    out = jax.ffi.ffi_call(_lib.GREEDY_HEAD, jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32))(
        x2, head["bf16"], embedding, head["row_norms"], jnp.broadcast_to(ex, h.shape[:-1]).reshape(-1))
    return out.reshape(h.shape[:-1])

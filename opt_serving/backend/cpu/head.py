"""The vocabulary end of a step on a CPU: an argmax, and the screened greedy head.

XLA CPU's own argmax (and its TopK with k=1) are slow over OPT's 50272 logits, hence `argmax`.

`greedy_tokens` is a greedy step's argmax over the LM head without its float32 logits: an int8 copy of the head
(where oneDNN's int8 products are VNNI or AMX, a quarter of float32's bytes) or a bfloat16 one (native bfloat16
products: AVX512_BF16, AMX; half the bytes), made by `pack_head`, is multiplied instead, and the few tokens whose
proven error interval reaches the best one are scored again exactly, so the token is the float32 argmax's (both
proofs are in csrc/head.cc and csrc/head8.cc; figures in benchmark/README.md).
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


def screens() -> list[str]:
    """The screens this CPU runs, best first: "int8" (oneDNN's int8 products on VNNI or AMX), "bfloat16" (native
    bfloat16 products); none without the extension."""
    lib = _lib.load()
    if lib is None:
        return []
    return [kind for kind, ok in (("int8", lib.opt_head8_supported()), ("bfloat16", lib.opt_head_supported())) if ok]


def supported() -> bool:
    """The extension loads and this CPU runs a screen."""
    return bool(screens())


def pack_head(embedding, device=None, kind: str | None = None) -> dict:
    """The tied embedding [V, K] -> the screen's packed head and the row norms its bound needs (all float32, rounded
    up): {"s8", "s8_scales", "l1_norms", "row_norms"} for `kind` "int8", {"bf16", "row_norms"} for "bfloat16"
    (default: the best this CPU runs). A non-finite weight has no error bound: ValueError (Backend.for_params
    leaves the screen off then)."""
    lib = _lib.lib()
    kind = kind or screens()[0]
    e = np.ascontiguousarray(np.asarray(embedding), np.float32)
    v, k = e.shape
    norms = np.empty(v, np.float32)
    if kind == "int8":
        out = np.empty(lib.opt_onednn_packed_bytes_as(k, v, 2), np.uint8)
        scales, l1 = np.empty(v, np.float32), np.empty(v, np.float32)
        rc = lib.opt_head8_pack(e.ctypes.data, k, v, out.ctypes.data, scales.ctypes.data, l1.ctypes.data,
                                norms.ctypes.data)
        packed = {"s8": out, "s8_scales": scales, "l1_norms": l1, "row_norms": norms}
    else:
        out = np.empty(lib.opt_head_packed_bytes(k, v), np.uint8)
        rc = lib.opt_head_pack(e.ctypes.data, k, v, out.ctypes.data, norms.ctypes.data)
        packed = {"bf16": out, "row_norms": norms}
    if rc == 2:
        raise ValueError("the embedding holds a non-finite weight: the screen has no error bound for it")
    if rc != 0:
        raise RuntimeError(f"oneDNN could not pack a {kind} [{k}, {v}] head")
    device = device or jax.devices("cpu")[0]
    return {name: jax.device_put(a, device) for name, a in packed.items()}


def greedy_tokens(params: dict, h, exclude=None, allowed=None) -> jax.Array:
    """argmax_j h[..., K] . embedding[j] as int32 [...], for params whose `lm_head` holds pack_head's entries
    (float32 h). `exclude` [...] (int32, -1 for none): a token each row may not take (EOS while
    min_new_tokens holds it back). `allowed` [..., W] (int32, W = ceil(V / 32), or None: every token): structured
    output's token bitmask of each row (bit t % 32 of word t // 32; a row of -1 allows every token): the argmax
    is over the row's allowed tokens, still the float32 one."""
    _lib.lib()  # its FFI target registered
    head, embedding = params["lm_head"], params["embed_tokens"]["embedding"]
    x2 = h.astype(jnp.float32).reshape(-1, h.shape[-1])  # [rows, K]
    ex = jnp.full(h.shape[:-1], -1, jnp.int32) if exclude is None else jnp.asarray(exclude, jnp.int32)
    ex = jnp.broadcast_to(ex, h.shape[:-1]).reshape(-1)
    masks = jnp.zeros((x2.shape[0], 0), jnp.int32) if allowed is None else \
        jnp.asarray(allowed, jnp.int32).reshape(x2.shape[0], -1)  # [rows, W]
    tok = jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32)
    if "s8" in head:
        out = jax.ffi.ffi_call(_lib.GREEDY_HEAD8, tok)(x2, head["s8"], embedding, head["s8_scales"],
                                                      head["l1_norms"], head["row_norms"], ex, masks)
    else:
        out = jax.ffi.ffi_call(_lib.GREEDY_HEAD, tok)(x2, head["bf16"], embedding, head["row_norms"], ex, masks)
    return out.reshape(h.shape[:-1])

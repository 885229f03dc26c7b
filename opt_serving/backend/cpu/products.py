"""Matrix products against weights packed once, at load, into the blocked layout oneDNN's matmul reads.

XLA's CPU GEMMs re-pack a dense layer's [K, N] weight on every call, and a decode step reads every weight once
for a handful of rows, so that packing would be most of its cost (figures: benchmark/README.md). A packed buffer
means something only in the process that made it (its layout depends on the oneDNN build and the CPU), so
packed params are never saved: `unpack_params` gives the plain ones back, exactly.

`weights` names the format a packed product stores its weight in; `pack`, `unpack` and `matmul` are the one
place that dispatches on it (FORMATS lists the ones there are).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend.cpu import _lib
from opt_serving.backend.tree import at, dense_paths, fresh_at

FORMATS = ("float32", "bfloat16", "int8")
_TYPE = {"float32": 0, "bfloat16": 1, "int8": 2}  # the extension's weight type codes


def check_format(weights: str) -> None:
    if weights not in FORMATS:
        raise ValueError(f"packed products take weights in {FORMATS}, not {weights!r}")


def pack(w, transposed: bool = False, device=None, weights: str = "float32") -> jax.Array:
    """A weight [K, N] (or [N, K] with `transposed`, as the tied embedding is) -> packed bytes: float32 numbers
    for the float32 and bfloat16 formats (rounded to nearest even for bfloat16), int8 ones for int8."""
    check_format(weights)
    lib = _lib.lib()
    w = np.ascontiguousarray(np.asarray(w), np.int8 if weights == "int8" else np.float32)
    if w.ndim != 2:
        raise ValueError(f"pack takes a 2-D weight, got shape {w.shape}")
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    size = lib.opt_onednn_packed_bytes_as(k, n, _TYPE[weights])
    if size < 0:
        raise ValueError(f"oneDNN has no {weights} products on this CPU (bfloat16 needs AVX512_BF16 or AMX)")
    out = np.empty(size, np.uint8)
    if lib.opt_onednn_pack_as(w.ctypes.data, k, n, int(transposed), _TYPE[weights], out.ctypes.data) != 0:
        raise RuntimeError(f"oneDNN could not pack a [{k}, {n}] {weights} weight")
    return jax.device_put(out, device or jax.devices("cpu")[0])


def unpack(packed, k: int, n: int, weights: str = "float32") -> np.ndarray:
    """`pack` undone: the plain [K, N] weight (float32; int8 for the int8 format)."""
    check_format(weights)
    lib = _lib.lib()
    src = np.ascontiguousarray(np.asarray(packed))
    if src.nbytes != lib.opt_onednn_packed_bytes_as(k, n, _TYPE[weights]):
        raise ValueError(f"not a packed [{k}, {n}] {weights} weight ({src.nbytes} bytes)")
    out = np.empty((k, n), np.int8 if weights == "int8" else np.float32)
    if lib.opt_onednn_unpack_as(src.ctypes.data, k, n, _TYPE[weights], out.ctypes.data) != 0:
        raise RuntimeError(f"oneDNN could not unpack a [{k}, {n}] {weights} weight")
    return out


def matmul(x, packed, n: int, bias=None, relu: bool = False, weights: str = "float32", scales=None):
    """x [..., K] @ W[K, N] (+ bias) (then ReLU), W packed by `pack`, float32 x and result. int8 weights take
    their `scales` [N] (W = q * scales), and each row of x is quantized to int8 with a scale of its own."""
    check_format(weights)
    _lib.lib()  # its FFI targets registered
    if x.dtype != jnp.float32:
        raise TypeError(f"packed products take float32 inputs, got {x.dtype}")
    if (weights == "int8") != (scales is not None):
        raise ValueError("int8 weights, and only they, come with scales")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [rows, K]
    b = jnp.zeros((0,), jnp.float32) if bias is None else bias
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    if weights == "float32":
        y = jax.ffi.ffi_call(_lib.MATMUL, out)(x2, packed, b, relu=bool(relu))
    else:
        s = jnp.zeros((0,), jnp.float32) if scales is None else scales
        y = jax.ffi.ffi_call(_lib.MATMUL_LOWP, out)(x2, packed, s, b, relu=bool(relu),
                                                     weights=np.int32(_TYPE[weights]))
    return y.reshape(*lead, n)


def bf16_fma_rows(rows: Optional[int] = None) -> int:
    """From how many rows bfloat16 products run as float32 FMAs on widened weights (0: never); `rows` sets
    it (negative: this CPU's default, Settings.bf16_fma_rows). The numbers are the same either way
    (bfloat16 rows and weights, float32 sums); only the order of the sums differs."""
    return int(_lib.lib().opt_bf16_fma_rows(-2 if rows is None else max(rows, -1)))


def bf16_fma_reads(k: int, n: int) -> bool:
    """Whether the float32-FMA kernel can read a packed bfloat16 [k, n] weight on this CPU (its layout)."""
    return bool(_lib.lib().opt_bf16_fma_reads(k, n))


def s8_vnni_rows(rows: Optional[int] = None) -> int:
    """From how many rows int8 products run our VNNI kernel instead of oneDNN's (0: never); `rows` sets it
    (negative: the default, Settings.s8_vnni_rows). The numbers are the same either way."""
    return int(_lib.lib().opt_s8_vnni_rows(-2 if rows is None else max(rows, -1)))


def f32_tile_rows(rows: Optional[int] = None) -> int:
    """Up to how many rows (from 9) float32 products run our tiled kernel instead of oneDNN's (0: never); `rows` sets
    it (negative: this CPU's default, Settings.f32_tile_rows). The numbers differ only in the order of the sums."""
    return int(_lib.lib().opt_f32_tile_rows(-2 if rows is None else max(rows, -1)))


def int8_row_levels() -> int:
    """The levels a side of an int8 product's rows on this CPU: 127 (int8 rows, int32 sums: VNNI or AMX), or 63
    where oneDNN's int8 products add pairs of products in int16 (AVX2, AVX-512 before VNNI), whose sums 7-bit rows
    keep from saturating (csrc/common.h, s8_rows)."""
    return int(_lib.lib().opt_s8_row_levels())


def s8_vnni_reads(k: int, n: int) -> bool:
    """Whether our VNNI kernel can read a packed int8 [k, n] weight on this CPU (its layout, AVX512_VNNI)."""
    return bool(_lib.lib().opt_s8_vnni_reads(k, n))


def head_format(weights: str) -> str:
    """The LM head's packed format under dense weights of `weights`: bfloat16 weights keep a float32 head, so
    a greedy step's screened head (backend/cpu/head.py, exact float32 argmax) and a step that makes the logits
    choose the same token, as under float32; the head is a small part of a large model's bytes."""
    return "float32" if weights == "bfloat16" else weights


def pack_params(params: dict, device, weights: str = "float32") -> dict:
    """Every dense weight packed onto `device` (`kernel` -> `packed`; int8: `qkernel` -> `packed`, its `scale`
    kept), and a packed copy of the tied LM head (`lm_head`, in head_format(weights)) where the params hold it:
    from the embedding, or for int8 from model/quantize.py's `lm_head.qkernel`; the embedding itself stays for
    the lookup."""
    key = "qkernel" if weights == "int8" else "kernel"
    out = _map_dense(params, key, "packed", lambda path, w: pack(w, device=device, weights=weights))
    if weights == "int8" and "lm_head" in params:
        out["lm_head"] = {"packed": pack(params["lm_head"]["qkernel"], device=device, weights=weights),
                          "scale": params["lm_head"]["scale"]}
    elif weights != "int8" and "embed_tokens" in params:  # the LM head (a pipeline's middle stages have none)
        out["lm_head"] = {"packed": pack(params["embed_tokens"]["embedding"], transposed=True, device=device,
                                         weights=head_format(weights))}
    return out


def unpack_params(params: dict, like: dict, weights: str = "float32") -> dict:
    """pack_params undone (exactly for float32 and int8; bfloat16 gives its rounded numbers back). `like`: a
    tree of the plain params' layout (arrays or shapes) giving each packed weight's [K, N]."""
    key = "qkernel" if weights == "int8" else "kernel"

    def plain(path, packed):
        k, n = at(like, path)[key].shape
        return jnp.asarray(unpack(packed, k, n, weights))
    out = _map_dense({name: sub for name, sub in params.items() if name != "lm_head"}, "packed", key, plain)
    if weights == "int8" and "lm_head" in params:
        k, n = like["lm_head"]["qkernel"].shape
        out["lm_head"] = {"qkernel": jnp.asarray(unpack(params["lm_head"]["packed"], k, n, weights)),
                          "scale": params["lm_head"]["scale"]}
    return out


def _map_dense(params: dict, key: str, new_key: str, fn: Callable) -> dict:
    """A new tree with every dense layer's `key` param replaced by `new_key` = fn(path, value); everything
    else shared with `params`."""
    out = dict(params)
    for path in dense_paths(params, key):
        dense = fresh_at(out, path)  # `params` stays as it was
        dense[new_key] = fn(path, dense.pop(key))
    return out

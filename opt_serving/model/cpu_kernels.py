"""CPU kernels as XLA FFI custom calls (opt_serving/_cpu_kernels.cc, built by build.sh): matrix
products against pre-packed weights (oneDNN), an argmax, and a decode step's attention.

XLA CPU re-packs a dense layer's [K, N] weight on every call; a decode step reads every
weight once for a handful of rows, so that packing is most of its cost. `pack_params`
packs each float32 weight once, into the blocked layout oneDNN's matmul reads, and
`matmul` runs the product on it.

On this project's 2-core CPU the OPT-125m set of products (12 layers + logits) takes
~31-35 ms at 16 rows and ~80-85 ms at 64, against ~44 and ~110 ms with XLA's own GEMMs
(benchmark/README.md). Used only where it can be: float32 params on one CPU device, the
extension built; `OPT_SERVING_ONEDNN=0` turns it off. A packed buffer is only meaningful
in the process that made it (its layout depends on the oneDNN build and the CPU), so
packed params are never saved: `unpack_params` gives the plain ones back.

`argmax` is jnp.argmax over the last axis: XLA CPU's own (and its TopK with k=1) run at
~1.5 ns an element, ~4.9 ms a greedy step at batch 64 over OPT's 50272 logits.

`decode_attention` reads only the cache entries written so far; XLA's dots read the whole
static cache, so generate() had to grow its cache a window at a time (copies) to keep reads short.

`greedy_tokens` is a greedy step's argmax over the LM head without its float32 logits: on a CPU with
native bfloat16 products (AVX512_BF16, AMX) a bfloat16 copy of the head is multiplied at twice the
float32 rate, and the few tokens whose proven error interval reaches the best one are scored again
exactly, so the token is the float32 argmax's (the proof is in _cpu_kernels.cc). At batch 64 on
OPT-125m the logits product is ~25 of a ~104 ms step. `OPT_SERVING_BF16_SCREEN=0` turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "opt_onednn_matmul"
ARGMAX_TARGET = "opt_argmax"
ATTENTION_TARGET = "opt_decode_attention"
HEAD_TARGET = "opt_greedy_head"
LIBRARY = Path(__file__).resolve().parent.parent / "_cpu_kernels.so"


@functools.cache
def _lib():
    """The loaded extension with its FFI target registered, or None when it cannot be used."""
    if os.environ.get("OPT_SERVING_ONEDNN", "1") == "0" or not LIBRARY.exists():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError:  # built against a oneDNN that is gone: the plain XLA path still works
        return None
    lib.opt_onednn_packed_bytes.restype = ctypes.c_int64
    lib.opt_onednn_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    for fn in (lib.opt_onednn_pack, lib.opt_onednn_unpack):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.opt_cpu_kernels_set_threads.argtypes = [ctypes.c_int]
    lib.opt_cpu_kernels_set_threads(threads())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.OptOnednnMatmul), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(lib.OptArgmax), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.OptDecodeAttention), platform="cpu")
    jax.ffi.register_ffi_target(HEAD_TARGET, jax.ffi.pycapsule(lib.OptGreedyHead), platform="cpu")
    lib.opt_head_packed_bytes.restype = ctypes.c_int64
    lib.opt_head_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.opt_head_pack.restype = ctypes.c_int
    lib.opt_head_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def threads() -> int:
    """Threads the kernels use: OPT_SERVING_CPU_THREADS, else every CPU this process may run on, as
    XLA's own pool does. OMP_NUM_THREADS is not followed: Ray sets it to a worker's CPU reservation
    (1 for a Serve replica), which would leave the products on one core beside XLA on all."""
    n = os.environ.get("OPT_SERVING_CPU_THREADS")
    if n:
        return max(1, int(n))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available() -> bool:
    return _lib() is not None


def head_available() -> bool:
    """The extension is usable, this CPU runs bfloat16 products natively, and the screen is not turned off."""
    lib = _lib()
    return (lib is not None and os.environ.get("OPT_SERVING_BF16_SCREEN", "1") != "0"
            and bool(lib.opt_head_supported()))


def pack_head(embedding, device=None) -> Optional[dict]:
    """The tied embedding [V, K] -> {"bf16": packed bfloat16 head, "row_norms": [V] float32 (rounded up)},
    or None where the screen cannot be used (see head_available; a non-finite weight has no error bound)."""
    if not head_available():
        return None
    lib = _lib()
    e = np.ascontiguousarray(np.asarray(embedding), np.float32)
    v, k = e.shape
    out = np.empty(lib.opt_head_packed_bytes(k, v), np.uint8)
    norms = np.empty(v, np.float32)
    rc = lib.opt_head_pack(e.ctypes.data, k, v, out.ctypes.data, norms.ctypes.data)
    if rc == 2:
        return None
    if rc != 0:
        raise RuntimeError(f"oneDNN could not pack a bfloat16 [{k}, {v}] head")
    device = device or jax.devices("cpu")[0]
    return {"bf16": jax.device_put(out, device), "row_norms": jax.device_put(norms, device)}


def has_head(params: dict) -> bool:
    """Packed params carrying the screened greedy head (pack_params made one)."""
    return "bf16" in params.get("lm_head", {})


def greedy_tokens(params: dict, h, exclude=None) -> jax.Array:
    """argmax_j h[..., K] . embedding[j] as int32 [...], for params with has_head (float32 h). `exclude`
    [...] (int32, -1 for none): a token each row may not take (EOS while min_new_tokens holds it back)."""
    head, embedding = params["lm_head"], params["embed_tokens"]["embedding"]
    x2 = h.astype(jnp.float32).reshape(-1, h.shape[-1])  # [rows, K]
    ex = jnp.full(h.shape[:-1], -1, jnp.int32) if exclude is None else jnp.asarray(exclude, jnp.int32)
    out = jax.ffi.ffi_call(HEAD_TARGET, jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32))(
        x2, head["bf16"], embedding, head["row_norms"], jnp.broadcast_to(ex, h.shape[:-1]).reshape(-1))
    return out.reshape(h.shape[:-1])


def pack(w, transposed: bool = False, device=None) -> jax.Array:
    """A float32 weight [K, N] (or [N, K] with `transposed`, as the tied embedding is) -> packed bytes."""
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"the oneDNN extension is not available ({LIBRARY} not built or disabled)")
    w = np.ascontiguousarray(np.asarray(w), np.float32)
    if w.ndim != 2:
        raise ValueError(f"pack takes a 2-D weight, got shape {w.shape}")
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    out = np.empty(lib.opt_onednn_packed_bytes(k, n), np.uint8)
    if lib.opt_onednn_pack(w.ctypes.data, k, n, int(transposed), out.ctypes.data) != 0:
        raise RuntimeError(f"oneDNN could not pack a [{k}, {n}] weight")
    return jax.device_put(out, device or jax.devices("cpu")[0])


def unpack(packed, k: int, n: int) -> np.ndarray:
    """`pack` undone: the plain [K, N] float32 weight."""
    lib = _lib()
    src = np.ascontiguousarray(np.asarray(packed))
    if lib is None or src.nbytes != lib.opt_onednn_packed_bytes(k, n):
        raise ValueError(f"not a packed [{k}, {n}] weight ({src.nbytes} bytes)")
    out = np.empty((k, n), np.float32)
    if lib.opt_onednn_unpack(src.ctypes.data, k, n, 0, out.ctypes.data) != 0:
        raise RuntimeError(f"oneDNN could not unpack a [{k}, {n}] weight")
    return out


def matmul(x, packed, n: int, bias=None, relu: bool = False):
    """x [..., K] @ W[K, N] (+ bias) (then ReLU), W packed by `pack`. float32."""
    if x.dtype != jnp.float32:
        raise TypeError(f"packed products are float32, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [rows, K]
    b = jnp.zeros((0,), jnp.float32) if bias is None else bias
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))(
        x2, packed, b, relu=bool(relu))
    return y.reshape(*lead, n)


def argmax(x) -> jax.Array:
    """jnp.argmax(x, -1).astype(int32) for float32 x [..., V] (the first maximum; a NaN wins).
    Traced for every platform: the kernel on the CPU, jnp.argmax elsewhere or without the extension."""
    def reference(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if not available() or x.dtype != jnp.float32:
        return reference(x)

    def kernel(x):
        x2 = x.reshape(-1, x.shape[-1])  # [rows, V]
        out = jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32))(x2)
        return out.reshape(x.shape[:-1])
    return jax.lax.platform_dependent(x, cpu=kernel, default=reference)


def decode_attention(q, k_cache, v_cache, mask, read_len, reference):
    """One decode step's attention: q [B, H, D] over the cache's first `read_len` (traced int32) entries
    of k/v [B, H, T, D] where mask [B, T] -> [B, H, D]. On a CPU the kernel reads only those entries;
    elsewhere, or without the extension, `reference(q, k, v, mask)` (which reads all T) runs."""
    if not available() or q.dtype != jnp.float32 or k_cache.shape[2] > 4096:
        return reference(q, k_cache, v_cache, mask)

    def kernel(q, k, v, mask):
        return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q, k, v, mask, jnp.asarray(read_len, jnp.int32))
    return jax.lax.platform_dependent(q, k_cache, v_cache, mask, cpu=kernel, default=reference)


def devices(params: dict) -> set:
    """The devices a param tree's arrays lie on."""
    return set().union(*(x.sharding.device_set for x in jax.tree_util.tree_leaves(params)
                         if hasattr(x, "sharding")))


def can_pack(params: dict) -> bool:
    """float32 params all on one CPU device, and the extension usable."""
    on = devices(params)
    return (available() and len(on) == 1 and next(iter(on)).platform == "cpu"
            and all(x.dtype in (jnp.float32, jnp.uint8) for x in jax.tree_util.tree_leaves(params)
                    if hasattr(x, "sharding")))


def is_packed(params: dict) -> bool:
    """pack_params made these params (a pipeline stage without the LM head: its layers are packed)."""
    return "lm_head" in params or "packed" in params.get("layers_0", {}).get("fc1", {})


def pack_params(params: dict) -> dict:
    """Every decoder layer's dense weight (`kernel` -> `packed`) and a packed copy of the tied
    embedding for the logits (`lm_head`), with the screened greedy head where this CPU has one
    (pack_head); the embedding itself stays for the lookup.
    Params that cannot be packed (see can_pack), or already are, come back as they are."""
    if is_packed(params) or not can_pack(params):
        return params
    device = next(iter(devices(params)))
    out = _map_dense(params, "kernel", "packed", lambda layer, path, w: pack(w, device=device))
    if "embed_tokens" in params:  # the LM head (a pipeline's middle stages have none)
        out["lm_head"] = {"packed": pack(params["embed_tokens"]["embedding"], transposed=True, device=device)}
        out["lm_head"].update(pack_head(params["embed_tokens"]["embedding"], device) or {})
    return out


def unpack_params(params: dict) -> dict:
    """pack_params undone (exactly: packing only moves the numbers)."""
    if not is_packed(params):
        return params

    def plain(layer, path, packed):
        n = _at(layer, path)["bias"].shape[0]
        return jnp.asarray(unpack(packed, _in_features(layer, path), n))
    out = _map_dense(params, "packed", "kernel", plain)
    out.pop("lm_head", None)
    return out


def _map_dense(params: dict, key: str, new_key: str, fn) -> dict:
    """A new tree with every decoder layer's dense `key` param replaced by `new_key` = fn(layer, path, value);
    everything else shared with `params`."""
    out = dict(params)
    for name, layer in params.items():
        if not name.startswith("layers_"):
            continue
        out[name] = new_layer = dict(layer)
        for path in _dense_paths(layer, key):
            parent = new_layer
            for step in path[:-1]:  # copy the dicts along the path, so `params` stays as it was
                parent[step] = parent = dict(parent[step])
            dense = dict(parent[path[-1]])
            dense[new_key] = fn(layer, path, dense.pop(key))
            parent[path[-1]] = dense
    return out


def _dense_paths(tree: dict, key: str, prefix=()):
    for name, sub in tree.items():
        if isinstance(sub, dict):
            if key in sub:
                yield prefix + (name,)
            else:
                yield from _dense_paths(sub, key, prefix + (name,))


def _at(tree: dict, path):
    for name in path:
        tree = tree[name]
    return tree


def _in_features(layer: dict, path) -> int:
    """K of a packed layer weight: fc2 reads the FFN width (fc1's N); every other one the hidden size."""
    return layer["fc1" if path[-1] == "fc2" else "fc2"]["bias"].shape[0]

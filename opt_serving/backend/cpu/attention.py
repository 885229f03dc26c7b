"""A decode step's attention that reads only the cache entries written so far.

XLA's dots read the cache's whole static length, so without this kernel a decode loop grows its cache a
window at a time (copies) to keep the reads short; with it the cache can be full-size from the start.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opt_serving.backend.cpu import _lib

MAX_ENTRIES = 4096  # the kernel's longest cache; a longer one takes `reference`


def decode_attention(q, k_cache, v_cache, mask, read_len, reference):
    """One decode step's attention: q [B, H, D] over the cache's first `read_len` (traced int32) entries of
    k/v [B, H, T, D] where mask [B, T] -> [B, H, D]; q and mask may have C rows a cache row ([B * C, ...]: row i
    reads cache row i // C, as `reference` must too). The cache is float32 or bfloat16 (as such, or as its bits
    in uint16: the model's, see kv_cache.cache_dtype), bfloat16 half the bytes to read. On a CPU the kernel reads
    only those entries; on another platform, or for what it does not take (q not float32, another cache dtype,
    T over MAX_ENTRIES), `reference(q, k, v, mask)` (which reads all T) runs."""
    kernel_cache = k_cache.dtype in (jnp.float32, jnp.bfloat16, jnp.uint16) and v_cache.dtype == k_cache.dtype
    if q.dtype != jnp.float32 or not kernel_cache or k_cache.shape[2] > MAX_ENTRIES:
        return reference(q, k_cache, v_cache, mask)
    _lib.lib()  # its FFI target registered

    def kernel(q, k, v, mask):
        return jax.ffi.ffi_call(_lib.ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q, k, v, mask, jnp.asarray(read_len, jnp.int32))
    return jax.lax.platform_dependent(q, k_cache, v_cache, mask, cpu=kernel, default=reference)


def ragged_attention(q, k_cache, v_cache, rows, ends, pool_k, pool_v, ptab, plen):
    """A ragged step's attention on a CPU: q [N, H, D] float32, query i reading the entries [0, ends[i]) of cache row
    rows[i] (k/v [B, H, T, D]; a row out of range or ends 0: zeros), a row's first plen[row] entries from the prefix
    pool's blocks ptab[row] (pool k/v [H, P, bs, D], of the cache's dtype) -> [N, H, D] float32. The cache holds
    every query's own k/v already."""
    _lib.lib()  # its FFI target registered
    return jax.ffi.ffi_call(_lib.RAGGED_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k_cache, v_cache, rows.astype(jnp.int32), ends.astype(jnp.int32), pool_k, pool_v,
        ptab.astype(jnp.int32), plen.astype(jnp.int32))

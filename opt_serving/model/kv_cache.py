"""The preallocated KV cache: layout, dtype, init, and insert-a-prefill-into-a-slot.

A cache is a plain dict pytree, so it can be donated to a jitted step and
sharded like any other array tree:

    {"k":    tuple of num_layers arrays [batch, heads, max_len, head_dim],
     "v":    tuple of num_layers arrays [batch, heads, max_len, head_dim],
     "mask": bool [batch, max_len]}   # True where that row's entry holds a real token

One array per layer (not one stacked array) so a step reads and updates each
layer's cache in place; a stacked cache sliced per layer can be copied by XLA.
`[heads, max_len, head_dim]` keeps a decode step's q.k and p.v products plain
batched matrix-vector products over (batch, heads).

Entries are written at explicit indices: prefill writes 0..S-1 of every row,
decode writes each row at its own index, and `mask` says which entries a row
attends to. The engine's slots can therefore hold prompts of different lengths.

A cache's dtype is the model's, or bfloat16 kept as its bits beside the CPU kernels' bfloat16 and int8
weights (`cache_dtype`); `to_cache` / `from_cache` write and read its values.

The prefix cache's pool (`init_pool`) keeps prompts' KV after their requests end, in blocks of a fixed number
of entries: {"k", "v": tuple of num_layers arrays [heads, blocks, block_size, head_dim]}. Heads first, as the
cache's rows are: a batch-1 cache gathered from blocks (`gather_blocks`) is then a reshape of the gathered
blocks, and a tensor-parallel stage splits the pool by heads as it splits the cache.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from opt_serving.backend import Backend
from opt_serving.config import OPTConfig
from opt_serving.model.opt import XLA, param_dtype

# Prompt lengths are padded up to one of these so only a few prefills compile.
MIN_BUCKET = 16


def init_cache(cfg: OPTConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty cache of `max_len` entries per row (nothing valid yet)."""
    return _empty((batch, cfg.num_attention_heads, max_len, cfg.head_dim), cfg.num_hidden_layers, jnp.dtype(dtype))


# one program a cache size, where jnp.zeros run eagerly compiled two for each array shape (its broadcast and its
# dtype's conversion), and a compiled program is held for good
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty(shape: tuple, layers: int, dtype) -> dict:  # shape: [batch, heads, max_len, head_dim]
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(layers))
    return {"k": zeros(), "v": zeros(), "mask": jnp.zeros(shape[:1] + shape[2:3], jnp.bool_)}


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


def as_cached(x, dtype):
    """k or v as a cache of `dtype` gives them back: a prompt's tokens attend to each other's k/v as every later
    step reads them, so a prompt prefilled whole, in chunks, after a cached prefix or joining a step gets the
    same numbers (a bfloat16 cache rounds them)."""
    return x if dtype == x.dtype else from_cache(to_cache(x, dtype), x.dtype)


def cache_max_len(cache: dict) -> int:
    return cache["mask"].shape[1]


def cache_batch(cache: dict) -> int:
    return cache["mask"].shape[0]


def bucket_length(n: int, limit: int, min_bucket: int = MIN_BUCKET) -> int:
    """Smallest power of two >= n (at least `min_bucket`), capped at `limit`."""
    if n > limit:
        raise ValueError(f"length {n} exceeds the limit of {limit} positions")
    b = min_bucket
    while b < n:
        b *= 2
    return min(b, limit)


def windows(limit: int, smallest: int = MIN_BUCKET) -> list[int]:
    """The sizes a cache grows through, a window at a time: `smallest` (a power of two), doubling, then `limit`.
    A decode step's cost is reading its cache, so a short sequence should not read a cache sized for the longest."""
    out = [min(smallest, limit)]
    while out[-1] < limit:
        out.append(min(out[-1] * 2, limit))
    return out


def _insert(decode_cache: dict, prefill_cache: dict, slot) -> dict:
    p_len = cache_max_len(prefill_cache)
    d_len = cache_max_len(decode_cache)
    if p_len > d_len:
        raise ValueError(f"prefill cache holds {p_len} entries, the decode cache only {d_len}")
    if cache_batch(prefill_cache) != 1:
        raise ValueError("insert takes a batch-1 prefill cache")
    slot = jnp.asarray(slot, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    k = tuple(jax.lax.dynamic_update_slice(d, p, (slot, zero, zero, zero))
              for d, p in zip(decode_cache["k"], prefill_cache["k"]))
    v = tuple(jax.lax.dynamic_update_slice(d, p, (slot, zero, zero, zero))
              for d, p in zip(decode_cache["v"], prefill_cache["v"]))
    # the whole mask row is replaced, so stale entries of the slot's last user are invalid
    row = jnp.zeros((1, d_len), jnp.bool_).at[:, :p_len].set(prefill_cache["mask"])
    mask = jax.lax.dynamic_update_slice(decode_cache["mask"], row, (slot, zero))
    return {"k": k, "v": v, "mask": mask}


# slot is traced: one compile per (decode cache, prefill bucket) shape pair.
insert = jax.jit(_insert, donate_argnums=(0,))
insert.__doc__ = """insert(decode_cache, prefill_cache, slot) -> decode_cache

Copy a batch-1 prefilled cache (entries 0..P-1, P = its bucketed length) into
row `slot` of the engine's decode cache; the slot's later entries become invalid.
The decode cache is donated; `slot` may be a traced int32 scalar."""


def _resize(cache: dict, max_len: int) -> dict:
    """The cache with `max_len` entries per row: new entries invalid, or the tail dropped (every valid
    entry must lie below max_len)."""
    n = cache_max_len(cache)
    if max_len >= n:  # into zeros (XLA CPU runs this 5x faster than jnp.pad)
        def pad(a, axis):
            shape = a.shape[:axis] + (max_len,) + a.shape[axis + 1:]
            return jax.lax.dynamic_update_slice(jnp.zeros(shape, a.dtype), a, (0,) * a.ndim)
    else:
        pad = lambda a, axis: jax.lax.slice_in_dim(a, 0, max_len, axis=axis)
    return {"k": tuple(pad(a, 2) for a in cache["k"]), "v": tuple(pad(a, 2) for a in cache["v"]),
            "mask": pad(cache["mask"], 1)}


# one compile per (old, new) length pair; not donated, the result has another size
resize = jax.jit(_resize, static_argnums=(1,))


def free_slot(cache: dict, slot) -> dict:
    """Mark every entry of row `slot` invalid (its k/v stay but are never attended)."""
    return {**cache, "mask": _clear_row(cache["mask"], jnp.asarray(slot, jnp.int32))}


@jax.jit
def _clear_row(mask, slot):
    row = jnp.zeros((1, mask.shape[1]), jnp.bool_)
    return jax.lax.dynamic_update_slice(mask, row, (slot, jnp.int32(0)))


def reorder(cache: dict, index) -> dict:
    """Gather rows of the cache (beam search: each beam continues from a parent beam)."""
    take = lambda a: jnp.take(a, index, axis=0)
    return {"k": tuple(map(take, cache["k"])), "v": tuple(map(take, cache["v"])),
            "mask": take(cache["mask"])}


def init_pool(cfg: OPTConfig, blocks: int, block_size: int, dtype=jnp.float32) -> dict:
    """An empty pool of `blocks` prefix-cache blocks of `block_size` entries (see the module docstring)."""
    shape = (cfg.num_attention_heads, blocks, block_size, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
    return {"k": zeros(), "v": zeros()}


def pool_blocks(pool: dict) -> int:
    return pool["k"][0].shape[1]


def pool_block_size(pool: dict) -> int:
    return pool["k"][0].shape[2]


def gather_blocks(pool: dict, ids, cached) -> dict:
    """A batch-1 cache of len(ids) blocks' entries: block j's from pool block ids[j] (int32 [m]); valid are the
    first `cached` entries (the others hold whatever the blocks held, never attended)."""
    m, bs = ids.shape[0], pool_block_size(pool)

    def take(p):  # [H, P, bs, D] -> [1, H, m * bs, D]
        h, _, _, d = p.shape
        return jnp.take(p, ids, axis=1).reshape(1, h, m * bs, d)
    mask = (jnp.arange(m * bs) < cached)[None]  # [1, m * bs]
    return {"k": tuple(map(take, pool["k"])), "v": tuple(map(take, pool["v"])), "mask": mask}


def store_blocks(pool: dict, cache: dict, ids, row=0) -> dict:
    """The pool with blocks of a cache's row `row` (traced; 0 for a batch-1 cache) written: its entries
    [j * bs, (j + 1) * bs) into pool block ids[j] (int32 [m], m * bs entries at most the cache's; an id past the
    pool, or negative: not written).

    A loop over the blocks kept, each an in-place slice update of every layer's pool: a scatter along the pool's
    blocks axis (not its first) made XLA transpose the row's m blocks and copy the pool around them, about 100 ms
    a row of a 2048-entry window where the loop takes about 3 (benchmark/README.md)."""
    bs, total = pool_block_size(pool), pool_blocks(pool)
    m = ids.shape[0]
    keep = (ids >= 0) & (ids < total)
    src = jnp.nonzero(keep, size=m, fill_value=0)[0]  # the kept blocks' j, first
    row = jnp.asarray(row, jnp.int32)
    zero = jnp.int32(0)

    def put(i, pools):  # the i-th kept block j of the row into pool block ids[j], every layer's k and v
        j = src[i]
        out = []
        for p, c in zip(pools, cache["k"] + cache["v"]):  # p [H, P, bs, D], c [B, H, n, D]
            h, d = c.shape[1], c.shape[3]
            block = jax.lax.dynamic_slice(c, (row, zero, j * bs, zero), (1, h, bs, d)).reshape(h, 1, bs, d)
            out.append(jax.lax.dynamic_update_slice(p, block.astype(p.dtype), (zero, ids[j], zero, zero)))
        return tuple(out)
    layers = len(pool["k"])
    pools = jax.lax.fori_loop(0, jnp.sum(keep, dtype=jnp.int32), put, tuple(pool["k"]) + tuple(pool["v"]))
    return {"k": pools[:layers], "v": pools[layers:]}

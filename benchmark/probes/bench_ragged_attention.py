"""The CPU ragged attention kernel alone (csrc/ragged_attention*.cc), as a served step runs it: one call a layer, each
layer with a cache of its own, so the entries come from memory as in the engine, not from a cache the last call
left warm. Two kinds of work: running rows' newest tokens (one query a row over its entries: a read of the cache)
and one prompt's chunk of tokens continuing its row (a tile of queries over each key block: arithmetic). Prints
each in ms for the layers, the decode rows' GB/s and the chunk's GFLOP/s, the read bandwidth measured beside them,
and the median over --rounds.

    .venv/bin/python benchmark/probes/bench_ragged_attention.py [--cache bfloat16|float32] [--rows 26] [--rounds 3]

OPT_SERVING_NO_AVX512=1 runs the AVX2 loops instead of the AVX-512 tiles.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="bfloat16", choices=["bfloat16", "float32"], help="the KV cache's type")
    ap.add_argument("--rows", type=int, default=26, help="running rows, each with 64-639 entries (seeded)")
    ap.add_argument("--chunk", type=int, default=92, help="a prompt's tokens in the step")
    ap.add_argument("--chunk-from", type=int, default=200, help="the entries its row holds before them")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10, help="timed steps a round (median)")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from benchmark.machine_bounds import read_bandwidth_gbs
    from opt_serving.backend.cpu.attention import ragged_attention
    from opt_serving.model.kv_cache import BF16_BITS, to_cache

    rng = np.random.default_rng(0)
    b, h, t, d = 32, 12, 1024, 64  # OPT-125m's heads, 32 slots of 1024 entries
    if a.rows >= b or a.chunk_from + a.chunk > t:
        ap.error(f"at most {b - 1} rows and {t} entries a row")

    dtype = BF16_BITS if a.cache == "bfloat16" else jnp.float32  # bfloat16 kept as its bits, as the engine's cache

    def cache():  # [B, H, T, D]
        return to_cache(jnp.asarray(rng.standard_normal((b, h, t, d)).astype(np.float32)), dtype)

    ks, vs = [cache() for _ in range(a.layers)], [cache() for _ in range(a.layers)]
    pool = jnp.zeros((h, 0, 16, d), ks[0].dtype)  # no prefix pool
    ptab, plen = jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32)

    @jax.jit
    def step(q, ks, vs, rows, ends):
        for k, v in zip(ks, vs):  # each layer's output feeds the next, as in the model
            q = q + 1e-3 * ragged_attention(q, k, v, rows, ends, pool, pool, ptab, plen)
        return q

    def timed(rows, ends) -> float:
        q = jnp.asarray(rng.standard_normal((len(rows), h, d)).astype(np.float32))
        r, e = jnp.asarray(rows, jnp.int32), jnp.asarray(ends, jnp.int32)
        step(q, ks, vs, r, e).block_until_ready()
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            step(q, ks, vs, r, e).block_until_ready()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    entries = rng.integers(64, 640, a.rows)
    kv_bytes = a.layers * int(entries.sum()) * h * d * 2 * (2 if a.cache == "bfloat16" else 4)
    chunk_ends = [a.chunk_from + 1 + j for j in range(a.chunk)]
    chunk_flop = a.layers * sum(4 * h * d * n for n in chunk_ends)
    decode, prompt = [], []
    print(f"{a.cache} cache, {a.layers} layers each with its own; decode: {a.rows} rows of {entries.mean():.0f} "
          f"entries on average ({kv_bytes / 1e6:.0f} MB); a prompt's {a.chunk} tokens after {a.chunk_from}")
    for r in range(a.rounds):
        bw = read_bandwidth_gbs()
        decode.append(timed(list(range(a.rows)), list(entries)))
        prompt.append(timed([b - 1] * a.chunk, chunk_ends))
        print(f"round {r}: read bandwidth {bw:.1f} GB/s; decode rows {decode[-1]:.2f} ms "
              f"({kv_bytes / decode[-1] / 1e6:.1f} GB/s); the prompt's chunk {prompt[-1]:.2f} ms "
              f"({chunk_flop / prompt[-1] / 1e6:.1f} GFLOP/s)", flush=True)
    dm, pm = statistics.median(decode), statistics.median(prompt)
    print(f"median: decode rows {dm:.2f} ms ({kv_bytes / dm / 1e6:.1f} GB/s), the prompt's chunk {pm:.2f} ms "
          f"({chunk_flop / pm / 1e6:.1f} GFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

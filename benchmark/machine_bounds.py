"""This machine's bounds, measured: the FLOP rate of a large matrix product (what a prefill pass and a large
batch's decode step can reach at best) and the memory read bandwidth (what a small batch's decode step, which reads
every weight and its KV entries once, can reach at best). Every served or offline figure is read against them.

Usage:
  python benchmark/machine_bounds.py                 # both, float32 and bfloat16 products, all cores
  python benchmark/machine_bounds.py --json bounds.json

The product is the one our dense layers run (the CPU kernels' packed oneDNN product, backend/cpu/products.py) on
an OPT-1.3b-wide layer ([M, 2048] x [2048, 8192], M = 2048: weights 64 MB, compute-bound), and plain XLA's dot on
the same shape beside it; bfloat16 is the packed bfloat16 product (float32 sums). The bandwidth is numpy summing a
1 GiB array on every core (benchmark_peers.read_bandwidth_gbs' method). Both are the best of a few passes: a
bound, not a typical figure.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: benchmark.* and its opt_serving
from benchmark.common import machine_description, now, write_json  # noqa: E402

M, K, N = 2048, 2048, 8192  # a prefill chunk through an OPT-1.3b-wide fc1: 68.7 GFLOP a product


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def read_bandwidth_gbs(threads: int | None = None, gib: float = 1.0, reps: int = 5) -> float:
    """Memory read bandwidth (GB/s): `threads` threads (default: every core) each summing its part of a `gib` GiB
    array (numpy releases the GIL), the best of `reps` passes."""
    a = _ones(int(gib * 2 ** 30) // 8)
    parts = np.array_split(a, threads or cores())
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        ts = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


@functools.cache
def _ones(n: int) -> np.ndarray:
    """The array read_bandwidth_gbs reads, made once (its pages written, so reads measure memory)."""
    return np.ones(n, np.int64)


def _best_s(fn, reps: int) -> float:
    fn()  # compiled, packed, warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def product_gflops(weights: str = "float32", kernel: str = "ours", reps: int = 4) -> float:
    """GFLOP/s of one [M, K] x [K, N] product: `kernel` "ours" (the packed product the dense layers run;
    `weights` float32 or bfloat16) or "xla" (jnp.dot, float32)."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, K), np.float32))
    w = rng.standard_normal((K, N), np.float32)
    if kernel == "xla":
        wd = jnp.asarray(w)
        f = jax.jit(lambda a, b: a @ b)
        run = lambda: f(x, wd).block_until_ready()  # noqa: E731
    else:
        from opt_serving.backend.cpu import products
        packed = products.pack(w, weights=weights)
        f = jax.jit(lambda a, p: products.matmul(a, p, N, weights=weights))
        run = lambda: f(x, packed).block_until_ready()  # noqa: E731
    return 2 * M * K * N / _best_s(run, reps) / 1e9


def jax_cpu() -> list:
    import jax
    return jax.devices("cpu")[:1]


def measure(products: bool = True) -> dict:
    """{"bandwidth_gbs", and with `products` "float32_gflops", "bfloat16_gflops", "xla_float32_gflops"}: the
    bounds of this machine now (products: None where the CPU kernels are not built)."""
    out = {"time": now(), "machine": machine_description(), "cores": cores(), "bandwidth_gbs": read_bandwidth_gbs()}
    if products:
        out["xla_float32_gflops"] = product_gflops(kernel="xla")
        try:
            from opt_serving.backend.cpu import _lib
            built = _lib.lib() is not None
        except Exception:  # not built, or no oneDNN
            built = False
        from opt_serving import backend
        for w in ("float32", "bfloat16"):  # bfloat16: None where the CPU has no native bfloat16 products
            runs = built and (w == "float32" or backend.bfloat16_products(jax_cpu()))
            out[f"{w}_gflops"] = product_gflops(w) if runs else None
    return out


def describe(b: dict) -> str:
    """One line of the bounds, for the scripts that print them beside their figures."""
    parts = [f"read bandwidth {b['bandwidth_gbs']:.1f} GB/s"]
    for key, what in (("float32_gflops", "float32 products"), ("bfloat16_gflops", "bfloat16 products"),
                      ("xla_float32_gflops", "XLA's float32 dot")):
        if b.get(key):
            parts.append(f"{what} {b[key]:.0f} GFLOP/s")
    return f"bounds ({b['cores']} cores): " + ", ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    b = measure()
    print(describe(b))
    if args.json:
        write_json(args.json, b)


if __name__ == "__main__":
    main()

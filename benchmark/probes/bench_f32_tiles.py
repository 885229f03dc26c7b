"""Where oneDNN's float32 kernel catches up with our tiles (`csrc/products_f32.cc` `f32_tiles`): the four packed
products of OPT-125m's 12 layers ([768, 2304], [768, 768], [768, 3072], [3072, 768]) at decode-step row counts,
as independent products in one jitted call (XLA may overlap them), under each setting of the threshold in turn (`products.f32_tile_rows`: 0 is oneDNN's
kernel for every row count, -1 the CPU's default). 48 distinct weights, 340 MB, so they come from memory as in a
step. Prints the best of --reps calls a row count and setting; the crossover is where `f32_tile_rows()` defaults
(48 rows on AMD CPUs, 96 on others).

    .venv/bin/python benchmark/probes/bench_f32_tiles.py [--rows 16,32,48,64,80,96] [--settings 0,-1] [--reps 15]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: its opt_serving
SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # [K, N] of qkv, out, fc1, fc2
LAYERS = 12


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="16,32,48,64,80,96", help="comma separated row counts")
    p.add_argument("--settings", default="0,-1", help="f32_tile_rows settings to take turns (0: oneDNN's kernel)")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from opt_serving.backend.cpu import products

    rng = np.random.default_rng(0)
    weights = [[products.pack(rng.standard_normal(s, np.float32)) for s in SHAPES] for _ in range(LAYERS)]

    def chain(xs, ws):
        return [products.matmul(x, w, n) for layer in ws for (_, n), w, x in zip(SHAPES, layer, xs)]

    print(f"f32_tile_rows default on this CPU: {products.f32_tile_rows(-1)}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = [jnp.asarray(rng.standard_normal((m, k), np.float32)) for k, _ in SHAPES]
        flops = 2 * m * sum(k * n for k, n in SHAPES) * LAYERS
        f = jax.jit(chain)  # one program for every setting: the kernel reads the setting when a product runs
        for setting in (int(s) for s in args.settings.split(",")):
            products.f32_tile_rows(setting)
            jax.block_until_ready(f(xs, weights))
            best = float("inf")
            for _ in range(args.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(f(xs, weights))
                best = min(best, time.perf_counter() - t0)
            print(f"rows {m:4d} f32_tile_rows {products.f32_tile_rows():3d}: {best * 1e3:7.2f} ms for {LAYERS} "
                  f"layers, {flops / best / 1e9:6.1f} GFLOP/s", flush=True)
    products.f32_tile_rows(-1)


if __name__ == "__main__":
    main()

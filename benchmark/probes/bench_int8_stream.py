"""What bounds a batch-1 int8 decode step on a CPU: the step's int8 products alone (every layer's four packed
weights and the LM head, as the CPU backend runs them, chained in one jitted call) against this machine's read
bandwidth, measured beside them.

A batch-1 decode step reads every weight once, so it can go no faster than the weights' bytes over the read
bandwidth (benchmark_peers.py prints the whole step against that bound). This takes the products out of the
step: if they alone run near the bound, the rest of the step (norms, attention, the sampler, dispatch) is what
is left to win; if not, the kernels are. Each round measures the bandwidth, then times the chain under
oneDNN's int8 kernel and under ours (`s8_vnni`, switched at run time: `products.s8_vnni_rows`), then measures
the bandwidth again: on a shared host the bandwidth moves between rounds, so a round compares with itself.
With --generate, the same two kernels in turn under the whole model instead (`get_model("jax/opt-<size>",
dummy=True, quantize="int8")`, greedy, prompt 16, 64 new tokens, --rows rows): tokens/s, the best of --reps
calls a kernel and round.

    .venv/bin/python benchmark/probes/bench_int8_stream.py --size 1.3b [--rows 1] [--rounds 4] [--reps 10] [--generate]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
KERNELS = {"oneDNN": 0, "s8_vnni": 1}  # products.s8_vnni_rows: 0 never, 1 from one row up


def in_turn(r: int, measure) -> dict:
    """{kernel: measure()} with each kernel set in turn (oneDNN's first in even rounds, ours in odd ones), the
    setting as it was afterwards."""
    from opt_serving.backend.cpu import products as P
    default = P.s8_vnni_rows()
    try:
        out = {}
        for name, rows in (KERNELS.items() if r % 2 == 0 else reversed(KERNELS.items())):
            P.s8_vnni_rows(rows)
            out[name] = measure()
        return out
    finally:
        P.s8_vnni_rows(default)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.3b", help="an OPT size (opt_serving.config.get_config)")
    ap.add_argument("--rows", type=int, default=1, help="rows a product multiplies (the decode batch)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10, help="timed chains a kernel and round (median)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the bandwidth measurement")
    ap.add_argument("--generate", action="store_true", help="the whole model's generate() instead of the products")
    a = ap.parse_args(argv)
    if a.generate:
        return generate_rounds(a)

    import jax
    import jax.numpy as jnp
    from benchmark.machine_bounds import read_bandwidth_gbs
    from opt_serving.backend.cpu import products as P
    from opt_serving.config import get_config

    cfg = get_config(a.size)
    d, f, layers, vocab = cfg.hidden_size, cfg.ffn_dim, cfg.num_hidden_layers, cfg.vocab_size
    shapes = [(d, 3 * d), (d, d), (d, f), (f, d)]  # fused q/k/v, out, fc1, fc2: [K, N]
    rng = np.random.default_rng(0)

    def packed(k, n, transposed=False):
        w = rng.integers(-127, 128, (n, k) if transposed else (k, n), dtype=np.int8)
        return P.pack(w, transposed=transposed, weights="int8"), jnp.asarray(rng.random(n, dtype=np.float32) / 100)

    t0 = time.perf_counter()
    weights = [[packed(k, n) for k, n in shapes] for _ in range(layers)]
    head = packed(d, vocab, transposed=True)  # the tied embedding, [V, d], as the LM head
    nbytes = layers * sum(k * n for k, n in shapes) + vocab * d
    print(f"OPT-{a.size} int8 products: {layers} layers x {len(shapes)} + the head, {nbytes / 1e9:.3f} GB, "
          f"packed in {time.perf_counter() - t0:.0f} s; {a.rows} row(s)")

    @jax.jit
    def chain(x, weights, head):  # x [rows, d]
        for (wq, sq), (wo, so), (w1, s1), (w2, s2) in weights:
            q = P.matmul(x, wq, 3 * d, weights="int8", scales=sq)                # [rows, 3d]
            o = P.matmul(q[:, :d], wo, d, weights="int8", scales=so)             # [rows, d]
            h = P.matmul(o, w1, f, relu=True, weights="int8", scales=s1)         # [rows, f]
            x = x + P.matmul(h, w2, d, weights="int8", scales=s2) / 100          # [rows, d]
        return P.matmul(x, head[0], vocab, weights="int8", scales=head[1])      # [rows, V]

    x = jnp.asarray(rng.random((a.rows, d), dtype=np.float32))

    def timed() -> float:
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            chain(x, weights, head).block_until_ready()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    in_turn(0, lambda: chain(x, weights, head).block_until_ready())  # compiled once; the kernel is chosen at run time
    print(f"{'round':>5} {'bw before':>9} {'bw after':>8} {'bound ms':>8}  "
          + "  ".join(f"{k + ' ms':>10} {'x bound':>7}" for k in KERNELS))
    for r in range(a.rounds):
        before = read_bandwidth_gbs(a.threads)
        ms = {k: 1e3 * t for k, t in in_turn(r, timed).items()}
        after = read_bandwidth_gbs(a.threads)
        bound = 1e3 * nbytes / (max(before, after) * 1e9)  # at the faster reading: the stricter bound
        print(f"{r:>5} {before:>9.1f} {after:>8.1f} {bound:>8.2f}  "
              + "  ".join(f"{ms[k]:>10.2f} {bound / ms[k]:>7.0%}" for k in KERNELS))
    print("(bw: GB/s read by numpy's sum on --threads threads; bound: the chain's bytes at the higher reading; "
          "x bound: how near the products run to it)")
    return 0


def generate_rounds(a) -> int:
    """The two kernels in turn under the whole model's greedy generate()."""
    from opt_serving.models import get_model

    t0 = time.perf_counter()
    model = get_model(f"jax/opt-{a.size}", dummy=True, quantize="int8")
    ids = np.random.default_rng(0).integers(4, 50000, (a.rows, 16)).astype(np.int32)
    print(f"OPT-{a.size} int8, drawn and quantized in {time.perf_counter() - t0:.0f} s; generate() of {a.rows} "
          "row(s), prompt 16, 64 new tokens: tokens/s, the best of --reps calls")

    def best_rate() -> float:
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            times.append(time.perf_counter() - t)
        return a.rows * 64 / min(times)

    model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)  # compiled
    print(f"{'round':>5}  " + "  ".join(f"{k:>9}" for k in KERNELS) + "  s8_vnni / oneDNN")
    for r in range(a.rounds):
        rate = in_turn(r, best_rate)
        print(f"{r:>5}  " + "  ".join(f"{rate[k]:>9.1f}" for k in KERNELS)
              + f"  {rate['s8_vnni'] / rate['oneDNN']:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cython vs pure Python for the host-side hot path in opt_serving/text/packing.py (stop strings).

    .venv/bin/python benchmark/probes/bench_packing.py [--repeat 5]

Prints the time per call of each implementation and the speedup. Needs the
extension built (`PYTHON=.venv/bin/python ./build.sh`).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from opt_serving.text import packing

try:
    from opt_serving import _speedups as C
except ImportError:
    sys.exit("opt_serving._speedups is not built: run `PYTHON=.venv/bin/python ./build.sh` first")
PY = packing.PY

WORDS = ("the of and to in is was that for on as with by he at from his an were are which this "
         "be or has had one their its new after who first two also been they have her she more "
         "time up other into year all when than people over only some many most").split()


def best_time(fn, repeat: int, number: int) -> float:
    """Best of `repeat` runs of `number` calls, in seconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def stream_text(rng: random.Random, n_tokens: int) -> list[str]:
    """Streamed generation: one detokenised piece (~a word) per step."""
    return [(" " if rng.random() < 0.9 else "\n") + rng.choice(WORDS) for _ in range(n_tokens)]


def scan_stream(find_stop, pieces, stops, incremental: bool):
    text, safe = "", 0
    for piece in pieces:
        text += piece
        cut, safe_new = find_stop(text, stops, safe if incremental else 0)
        safe = safe_new
        if cut >= 0:
            break
    return safe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []

    def add(name, make_call, number):
        t_py = best_time(make_call(PY), args.repeat, number)
        t_c = best_time(make_call(C), args.repeat, number)
        rows.append((name, t_py * 1e6, t_c * 1e6, t_py / t_c))

    stops = ["\n\nUser:", "###", "</s>"]   # none occurs: the whole stream is scanned
    pieces = stream_text(rng, 512)
    add("find_stop: 512-step stream, 3 stops, start=prev safe (whole stream)",
        lambda m: lambda: scan_stream(m.find_stop, pieces, stops, True), 5)
    add("find_stop: 512-step stream, 3 stops, rescans from 0 (whole stream)",
        lambda m: lambda: scan_stream(m.find_stop, pieces, stops, False), 3)

    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'python us':>11}  {'cython us':>11}  {'speedup':>7}")
    for name, p, c, s in rows:
        print(f"{name:<{width}}  {p:>11.1f}  {c:>11.1f}  {s:>6.1f}x")


if __name__ == "__main__":
    main()

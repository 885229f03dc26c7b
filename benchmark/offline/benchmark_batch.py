"""Offline batch runner vs. the same requests sent one by one.

Writes a file of mixed requests (prompt lengths, max_tokens, temperature, n, stop, logprobs all
varying, as a real prompt set does), runs it through `opt_serving.batch.run_file` under a token
budget, then sends every request alone (one `complete_n` call each, awaited before the next, as a
client looping over the file would) and prints both throughputs. Defaults: 1,000 requests, the
embedded tiny model.

    python benchmark/offline/benchmark_batch.py [--requests 1000] [--budget 16384] [--model M --path P]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving

from opt_serving import batch as B  # noqa: E402

WORDS = ("the cat sat on a mat while rain fell over quiet hills and old roads "
         "north south east west garden kitchen office hallway bedroom bathroom").split()


def make_requests(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        req = {"engine": "opt-tiny", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(4, 48))),
               "max_tokens": rng.choice([4, 8, 16, 32]), "temperature": rng.choice([0.0, 0.7, 1.0]),
               "top_p": rng.choice([1, 0.9]), "n": rng.choice([1, 1, 1, 2]), "echo": rng.random() < 0.1,
               "logprobs": rng.choice([None, 1, 5]), "stop": rng.choice([None, ["\n"], [" west"]]),
               "request_id": i}
        req["best_of"] = req["n"]
        reqs.append(req)
    return reqs


async def one_by_one(gen, reqs: list[B.Request]) -> tuple[float, int]:
    """Each request alone, waiting for its answer before sending the next (a client looping over the file)."""
    t, tokens = time.perf_counter(), 0
    for r in reqs:
        completions = await gen.complete_n(r.prompt, B.sampling_params(r), n=r.params["n"],
                                           best_of=r.params["best_of"])
        tokens += sum(c.completion_tokens for c in completions)
    return time.perf_counter() - t, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--sequential", type=int, default=None,
                    help="time the one-by-one baseline on only the first N requests (default: all)")
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--max-batch-size", type=int, default=16, help="engine decode slots")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--path", default=None)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    t = time.perf_counter()
    gen = B.load_generator(args.model, args.path, args.dtype, args.max_batch_size, args.max_seq_len)
    name = args.model or "embedded opt-tiny"
    print(f"model loaded and compiled in {time.perf_counter() - t:.1f}s ({name}, "
          f"{args.max_batch_size} slots, budget {args.budget})")
    reqs = make_requests(args.requests)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inp, out = Path(tmp) / "requests.jsonl", Path(tmp) / "results.jsonl"
            inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
            s = B.run_file(inp, out, gen, budget=args.budget, progress=False)
            assert s.done + s.failed == len(reqs), s
            print(f"batch runner : {s.done} requests ({s.failed} failed) in {s.seconds:.1f}s = "
                  f"{s.done / s.seconds:.1f} req/s, {s.tokens_per_s:.1f} generated tokens/s "
                  f"(up to {s.peak_requests} requests in flight)")

        parsed = [B.parse_request(i + 1, json.dumps(r)) for i, r in enumerate(reqs)][:args.sequential]
        dt, tokens = asyncio.run(one_by_one(gen, parsed))
        print(f"one by one   : {len(parsed)} requests in {dt:.1f}s = {len(parsed) / dt:.1f} req/s, "
              f"{tokens / dt:.1f} generated tokens/s")
        print(f"speed-up     : {(s.done / s.seconds) / (len(parsed) / dt):.1f}x requests/s, "
              f"{s.tokens_per_s / (tokens / dt):.1f}x tokens/s")
    finally:
        gen.close()


if __name__ == "__main__":
    main()

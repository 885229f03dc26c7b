"""The continuous-batching engine alone, in process (no HTTP, no client on the same cores): a closed loop.

Usage:
  python benchmark/offline/benchmark_engine.py --model jax/opt-125m --quantize int8
  python benchmark/offline/benchmark_engine.py --model jax/opt-125m --dtype bfloat16 --clients 32 --requests 128

--clients requests run at once; each client asks again as soon as its request is done, until --requests
have run. The first round is staggered (client i's first request makes 1 + 2i tokens), so requests finish
and arrive one every two steps or so, as a served load settles to; --no-stagger starts them together (they
then run in waves). Prompts are random ids of --prompt-len; every request is greedy and makes --gen-len tokens
(no EOS). Prints tokens/s of each timed run (after a warm one) and how prompts were admitted: joined to a
decode step, or prefilled in passes of their own.
"""
from __future__ import annotations

import argparse
import gc
import threading
import time

import numpy as np


def closed_loop(engine, settings_for, prompt_len: int, clients: int, requests: int, stagger: bool, rng) -> float:
    """Run `requests` requests `clients` at a time -> generated tokens/s."""
    lock, done = threading.Lock(), threading.Semaphore(0)
    left, tokens = [requests - clients], [0]

    def submit(n: int) -> None:
        tokens[0] += n
        engine.submit(rng.integers(4, 50000, prompt_len).tolist(), settings_for(n), on_output)

    def on_output(out) -> None:
        if out.finish_reason is None:
            return
        with lock:
            go = left[0] > 0
            left[0] -= 1
        if go:
            submit(settings_for.gen_len)
        done.release()

    t0 = time.perf_counter()
    for i in range(clients):
        submit(min(1 + 2 * i, settings_for.gen_len) if stagger else settings_for.gen_len)
    for _ in range(requests):
        done.acquire()
    return tokens[0] / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="jax/opt-125m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", default=None, choices=[None, "int8"])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--no-stagger", action="store_true")
    p.add_argument("--decode-steps", type=int, default=1, help="decode steps in one call (engine.Engine)")
    p.add_argument("--ahead", action="store_true", help="each call sent before the one in flight is read (Engine)")
    args = p.parse_args()

    from opt_serving.engine.scheduler import SlotSettings
    from opt_serving.text.loading import load_engine
    plan = {"quantize": args.quantize} if args.quantize else {}
    engine = load_engine(args.model, None, dtype=args.dtype, num_slots=args.clients, max_seq_len=args.max_seq_len,
                         dummy=True, decode_steps=args.decode_steps, **plan)
    engine.ahead = args.ahead

    def settings_for(n: int) -> SlotSettings:
        return SlotSettings(max_tokens=n, logprob=False, top_logprobs=False)
    settings_for.gen_len = args.gen_len
    rng = np.random.default_rng(0)
    gc.collect()
    gc.freeze()  # as the Serve replica does after loading
    try:
        closed_loop(engine, settings_for, args.prompt_len, args.clients, args.clients, not args.no_stagger, rng)
        for _ in range(args.runs):
            before = engine.stats()
            rate = closed_loop(engine, settings_for, args.prompt_len, args.clients, args.requests,
                               not args.no_stagger, rng)
            after = engine.stats()
            joined = after.joined - before.joined
            print(f"{args.model} {args.quantize or args.dtype} decode_steps={args.decode_steps}"
                  f"{' ahead' if args.ahead else ''}: {rate:.1f} tokens/s, {after.steps - before.steps} "
                  f"steps, {joined} prompts joined a step, {after.prefills - before.prefills - joined} prefilled",
                  flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()

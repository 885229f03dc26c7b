"""Structured output's cost to the streams beside it: 32 streams, 8 of them constrained by a JSON schema, against
32 unconstrained, on the same engine, alternating.

    .venv/bin/python benchmark/offline/bench_structured.py [--model jax/opt-125m] [--tokenizer ../shared/opt-assets]
        [--streams 32] [--constrained 8] [--seconds 40] [--rounds 3] [--temperature 0]

Random weights of the model's size (float32), the real OPT tokenizer, the engine as `opt-serving serve` runs it
(decode_steps 4, prefill_chunk 256), the generator's asyncio API in this process (no HTTP). Each stream sends
requests one after another for `--seconds` (then finishes the one it has): unconstrained ones ask for 64 tokens,
constrained ones for an object of SCHEMA (up to 64 tokens; it ends at the object's end). Prints, per run, the
tokens the engine generated per second while every stream was busy (after the first 5 s), and per second of this
process's CPU time (a figure a machine shared with other work disturbs less than the wall clock), the steps per
engine call, and for the constrained streams the objects made and how many of them parse and match the schema
(jsonschema); then the ratio of the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import jsonschema

from opt_serving.text.generator import SamplingParams
from opt_serving.text.loading import load_generator
from opt_serving.text.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
PROMPTS = ["Hello, my name is", "The capital of France is", "Here is a JSON record of a user:",
           "In 1905, Albert Einstein", "The best way to cook rice is", "Once upon a time, there was",
           "The weather today is", "My favourite programming language is"]


async def stream(g, i: int, params: SamplingParams, deadline: float, out: dict) -> None:
    """Requests one after another until the deadline: their tokens, and each constrained text."""
    k = 0
    while time.perf_counter() < deadline:
        c = await g.complete(PROMPTS[(i + k) % len(PROMPTS)], params)
        k += 1
        out["tokens"] += c.completion_tokens
        if params.structured is not None:
            out["objects"].append(c.text)


async def one_run(g, streams: int, constrained: int, seconds: float, temperature: float, settle: float = 5) -> dict:
    """One run: the streams start together; the tokens/s are the engine's over [settle, seconds] (every stream
    busy), the objects every constrained request made."""
    plain = SamplingParams(max_tokens=64, temperature=temperature, ignore_eos=True, seed=1)
    schema = StructuredOutput.of("json", SCHEMA, "response_format")
    json_params = SamplingParams(max_tokens=64, temperature=temperature, seed=1, structured=schema)
    out = {"tokens": 0, "objects": []}
    t0 = time.perf_counter()
    runs = asyncio.gather(*(stream(g, i, json_params if i < constrained else plain, t0 + seconds, out)
                            for i in range(streams)))
    await asyncio.sleep(settle)  # (the measuring window's start: every stream has its first request running)
    before, w0, c0 = g.engine.stats(), time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds - settle)
    after, w1, c1 = g.engine.stats(), time.perf_counter(), time.process_time()
    await runs
    valid = 0
    for text in out["objects"]:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    tokens = after.generated_tokens - before.generated_tokens
    return {"tokens_per_s": tokens / (w1 - w0), "wall_s": w1 - w0, "tokens_per_cpu_s": tokens / (c1 - c0),
            "objects": len(out["objects"]), "valid": valid,
            "steps_per_call": (after.steps - before.steps) / max(after.step_calls - before.step_calls, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="jax/opt-125m")
    p.add_argument("--tokenizer", default="../shared/opt-assets")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--constrained", type=int, default=8)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--decode-call-s", type=float, default=None,
                   help="the engine's bound on a call's steps (default: its own, 0.15 s); a machine loaded by others "
                        "makes steps slow enough that the default takes one a call")
    args = p.parse_args()
    g = load_generator(args.model, dummy=True, tokenizer=args.tokenizer, max_batch_size=args.streams,
                       max_seq_len=256, decode_steps=args.decode_steps)
    if args.decode_call_s is not None:
        g.engine.decode_call_s = args.decode_call_s
    g.grammar_tokenizer(StructuredOutput("json_object"))  # llguidance's tables, once, before timing
    try:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(one_run(g, args.streams, args.constrained, 8, args.temperature, 2))  # compiles
        rates = {(k, m): [] for k in (0, args.constrained) for m in ("tokens_per_s", "tokens_per_cpu_s")}
        for r in range(args.rounds):
            for k in (0, args.constrained):
                res = loop.run_until_complete(one_run(g, args.streams, k, args.seconds, args.temperature))
                for m in ("tokens_per_s", "tokens_per_cpu_s"):
                    rates[k, m].append(res[m])
                what = f"{k} of {args.streams} constrained" if k else f"{args.streams} unconstrained"
                extra = f", {res['valid']}/{res['objects']} objects parse and match" if k else ""
                print(f"round {r} {what:>24}: {res['tokens_per_s']:7.1f} tokens/s, {res['tokens_per_cpu_s']:6.1f} "
                      f"tokens per CPU-second ({res['wall_s']:.1f} s, {res['steps_per_call']:.2f} steps a call{extra})",
                      flush=True)
        for m, unit in (("tokens_per_s", "tokens/s"), ("tokens_per_cpu_s", "tokens per CPU-second")):
            base, mixed = statistics.median(rates[0, m]), statistics.median(rates[args.constrained, m])
            pairs = [b / a for a, b in zip(rates[0, m], rates[args.constrained, m])]  # each against the run before
            print(f"median {unit}: {args.streams} unconstrained {base:.1f}, {args.constrained} constrained {mixed:.1f}: "
                  f"{mixed / base:.3f}x; run by run {', '.join(f'{r:.3f}' for r in pairs)} "
                  f"(median {statistics.median(pairs):.3f}x)")
    finally:
        g.close()


if __name__ == "__main__":
    main()

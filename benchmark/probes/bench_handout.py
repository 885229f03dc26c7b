"""The engine thread's hand-out of one decode call: a step's tokens to each request's text state.

    .venv/bin/python benchmark/probes/bench_handout.py [--tokenizer ../shared/opt-assets] [--slots 32] [--steps 4]

What runs between two decode calls while the kernels wait: for every slot, `StepResult.token` for each of the
call's steps, then `RequestText.on_output` (detokenising, text offsets, the delta) with a sink that drops the
delta. Prints the time of one call's hand-out with the tokenizer's text decoded as the engine does
(`tokenizer.text_decoder`: the Rust backend's decode) and through transformers' `decode`, alternately.
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from opt_serving.text.completion import RequestText
from opt_serving.text.request import SamplingParams
from opt_serving.runner.types import MAX_TOP_LOGPROBS, EngineOutput, SlotSettings, StepResult
from opt_serving.text.token_text import TokenTexts
from opt_serving.text.tokenizer import load_tokenizer


def call_results(rng, slots: int, steps: int, vocab: int) -> list[StepResult]:
    """One decode call's results: random tokens, no scores or alternatives asked for (the served default)."""
    return [StepResult(rng.integers(4, vocab, slots).astype(np.int32), np.zeros(slots, np.float32),
                       np.full((slots, MAX_TOP_LOGPROBS), -1, np.int32),
                       np.zeros((slots, MAX_TOP_LOGPROBS), np.float32)) for _ in range(steps)]


def hand_out_time(tokenizer, calls: list[list[StepResult]], slots: int, via_transformers: bool) -> float:
    """Seconds per call to hand every slot its tokens, as Engine._step and the generator's text state do."""
    settings = SlotSettings(max_tokens=10**6, logprob=False, top_logprobs=False)
    texts = [RequestText(tokenizer, TokenTexts(tokenizer), [2], "", SamplingParams(max_tokens=10**6), settings,
                         lambda d: None) for _ in range(slots)]
    if via_transformers:
        for t in texts:
            t.detok._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True,
                                                           clean_up_tokenization_spaces=False)
    gc.collect()
    t0 = time.perf_counter()
    for results in calls:
        for s in range(slots):
            texts[s].on_output(EngineOutput([r.token(s, logprob=False) for r in results]))
    return (time.perf_counter() - t0) / len(calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default="../shared/opt-assets")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="decode steps a call (serve --decode-steps)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        for via in (False, True):
            calls = [call_results(rng, args.slots, args.steps, len(tokenizer)) for _ in range(args.calls)]
            ms = 1e3 * hand_out_time(tokenizer, calls, args.slots, via)
            name = "transformers' decode" if via else "the backend's decode"
            print(f"round {r + 1}: {name}: {ms:.3f} ms a call of {args.steps} steps x {args.slots} slots "
                  f"({1e6 * ms / 1e3 / (args.steps * args.slots):.2f} us a token)")


if __name__ == "__main__":
    main()

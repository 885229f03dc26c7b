"""`opt-serving batch`: run a jsonl file of OpenAI-style completion requests offline, resumably.

Input: one request per line in the seed "FM inference" format (`prompt` as text or token ids,
`max_tokens`, `temperature`, `top_p`, `n`, `best_of`, `logprobs`, `echo`, `stop`, optional `seed`;
other fields such as `engine` are kept but ignored; an optional `custom_id`/`request_id`/`id`).
Output: one line per request, `{"request": <the input line>, "result": {"choices": [...],
"request_time": {"batch_time", "batch_size"}}}`, or `{"request": ..., "error": {"message": ...}}` for a
malformed line or an impossible request. Lines are appended in the order requests finish. A line's
fields map onto the generator's `SamplingParams` (batch_io.py) and are checked as the generator checks any
request (request.py), so a request the service would refuse is refused here with the same message.

Batching choice: the continuous-batching engine does the packing and the token budget limits
admission. Requests are read in windows (`--window` lines) and sorted longest first; each is handed to
the generator (`complete_n`, per-request settings and n/best_of, so mixed settings share every decode
step) as soon as the requests in flight, counted as best_of x (prompt + max_tokens) tokens, leave room
for it under `--budget`. Fixed batches would pad every row to the longest and leave slots idle while a
batch's stragglers finish; the engine has no padding (each slot holds its own sequence) and refills a
slot the step after it frees. Longest first still matters: long requests start early, so the end of the
run is not one long request decoding alone. The budget bounds what a kill can lose (only requests in
flight are not yet on disk) and the engine's queue; the engine's slots (`--max-batch-size`) bound the
decode batch and its KV cache. In the output, `batch_time` is the request's own time from admission to
its last token and `batch_size` the number of requests in flight when it was admitted.

Resume: a request is done when the output has a line for it, matched by its id field when it has one,
else by its content (the echoed request; identical lines are interchangeable, so counting occurrences
is matching by line number). A torn last line (a kill mid-write) is cut off and its request redone.
Error records count as done (the same line would fail the same way); an engine failure is not written
as an error record: the run stops with a non-zero exit, and a re-run redoes what was in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import gc
import os
import signal
import sys
import time
from pathlib import Path

from opt_serving.batch_io import (Output, Request, RequestError, error_record, parse_request, read_done,
                                  read_pending, request_key, to_choices)
from opt_serving.engine.admission import PREFILL_CHUNK
from opt_serving.engine.scheduler import QueueFull
from opt_serving.errors import InvalidRequest
from opt_serving.text.loading import load_generator
from opt_serving.spec import is_parallel

# what the CLI, tests and benchmarks reach through this module
__all__ = ["Request", "RequestError", "Summary", "add_arguments", "load_generator", "parse_request", "read_done",
           "read_pending", "request_key", "run", "run_file", "to_choices"]


@dataclasses.dataclass
class Summary:
    done: int = 0
    failed: int = 0
    skipped: int = 0
    tokens: int = 0       # generated tokens of the returned choices
    seconds: float = 0.0
    peak_tokens: int = 0    # most budget tokens in flight at once
    peak_requests: int = 0  # most requests in flight at once

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        return (f"done {self.done}, failed {self.failed}, skipped {self.skipped} (already in the output); "
                f"{self.tokens} tokens generated in {self.seconds:.1f}s = {self.tokens_per_s:.1f} tokens/s; "
                f"at most {self.peak_requests} requests ({self.peak_tokens} budget tokens) in flight")


# ---- the run ---------------------------------------------------------------------------------

def run_file(input_path: str | os.PathLike, output_path: str | os.PathLike, generator,
             budget: int = 16384, window: int = 4096, progress: bool = True) -> Summary:
    """Answer every request of `input_path` not yet in `output_path`, appending to it.

    `generator` is an `opt_serving.text.generator.Generator` (the caller owns it and closes it).
    Raises on an engine failure, after writing every request that finished."""
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"batch: input file {input_path} does not exist")
    if budget <= 0:
        raise ValueError(f"batch: budget must be positive, got {budget}")
    if window <= 0:
        raise ValueError(f"batch: window must be positive, got {window}")
    done = read_done(output_path)
    out = Output(output_path)
    try:
        return asyncio.run(_run(input_path, done, out, generator, budget, window, progress))
    finally:
        out.close()


async def _run(input_path: Path, done: collections.Counter, out: Output, gen, budget: int, window: int,
               progress: bool) -> Summary:
    from tqdm import tqdm
    skipped = [0]
    with open(input_path, "rb") as f:
        total = sum(1 for line in f if line.strip())
    bar = tqdm(total=total, unit="req", disable=not progress, desc="batch", dynamic_ncols=True)
    run = _Run(gen, out, budget, bar)
    try:
        for reqs, errors in read_pending(input_path, done, window, skipped):
            run.skip(skipped[0])
            runnable = run.screen(reqs, errors)
            runnable.sort(key=lambda r: (r.length, r.prompt_len), reverse=True)
            for r in runnable:
                if not await run.admit(r):
                    break
            if run.failure:
                break
        run.skip(skipped[0])
        await run.wait()
    finally:
        run.close()
    if run.failure:
        e, summary = run.failure[0], run.summary
        raise RuntimeError(f"batch: the engine failed ({type(e).__name__}: {e}); "
                           f"{summary.done + summary.failed} lines written, re-run to finish") from e
    return run.summary


class _Run:
    """One run's admission: requests start as the ones in flight, counted as best_of x (prompt + max_tokens)
    tokens, leave room under the budget; each is written as it finishes. An engine failure stops admission
    and leaves the requests in flight undone."""

    def __init__(self, gen, out: Output, budget: int, bar):
        self.gen, self.out, self.budget, self.bar = gen, out, budget, bar
        self.summary = Summary()
        self.t0 = time.perf_counter()
        # the queue never overflows if no more sequences are in flight than slots + queue places
        self.max_rows = gen.engine.num_slots + getattr(gen.engine, "max_queue", 0)
        self.room = asyncio.Condition()
        self.tokens = self.rows = self.requests = 0  # in flight
        self.failure: list[BaseException] = []
        self.tasks: set[asyncio.Task] = set()

    def record(self, records: list[dict], tokens: int = 0) -> None:
        self.out.write(records)
        s = self.summary
        s.done += sum("result" in r for r in records)
        s.failed += sum("error" in r for r in records)
        s.tokens += tokens
        self.bar.update(len(records))
        self.bar.set_postfix(tok_s=f"{s.tokens / (time.perf_counter() - self.t0):.1f}", refresh=False)

    def skip(self, skipped: int) -> None:
        self.bar.update(skipped - self.summary.skipped)
        self.summary.skipped = skipped

    def screen(self, reqs: list[Request], errors: list[dict]) -> list[Request]:
        """Check a window's requests against the model (the generator's own checks, its texts tokenised
        in one call) before they take budget; what cannot run is written as an error record."""
        runnable = []
        prepared = self.gen.prepare_many([r.prompt for r in reqs], [r.sampling for r in reqs])
        for r, ids in zip(reqs, prepared):
            if isinstance(ids, InvalidRequest):
                errors.append(error_record(r.request, f"line {r.line_no}: {ids}"))
            else:
                r.ids, r.prompt_len = ids, len(ids)
                runnable.append(r)
        self.record(errors)
        return runnable

    def fits(self, r: Request) -> bool:
        if self.failure:
            return True  # wake up to stop
        if self.requests == 0:
            return True  # over the budget alone: runs alone
        return self.tokens + r.cost <= self.budget and self.rows + r.rows <= self.max_rows

    async def admit(self, r: Request) -> bool:
        """Wait for room and start `r`; False once the engine has failed."""
        async with self.room:
            await self.room.wait_for(lambda: self.fits(r))
            if self.failure:
                return False
            self.tokens += r.cost
            self.rows += r.rows
            self.requests += 1
            self.summary.peak_tokens = max(self.summary.peak_tokens, self.tokens)
            self.summary.peak_requests = max(self.summary.peak_requests, self.requests)
            task = asyncio.create_task(self.one(r, self.requests))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def one(self, r: Request, in_flight: int) -> None:
        start = time.perf_counter()
        try:
            while True:
                try:
                    completions = await self.gen.complete_n(r.prompt, r.sampling, n=r.params["n"],
                                                            best_of=r.params["best_of"], ids=r.ids)
                    break
                except QueueFull:  # someone else shares the engine: wait for a place
                    await asyncio.sleep(0.05)
            result = {"choices": to_choices(completions),
                      "request_time": {"batch_time": time.perf_counter() - start, "batch_size": in_flight}}
            self.record([{"request": r.request, "result": result}], sum(c.completion_tokens for c in completions))
        except ValueError as e:  # the request's own fault
            self.record([error_record(r.request, f"line {r.line_no}: {e}")])
        except Exception as e:  # noqa: BLE001 - the engine's fault: stop, leave the request undone
            self.failure.append(e)
        finally:
            async with self.room:
                self.tokens -= r.cost
                self.rows -= r.rows
                self.requests -= 1
                self.room.notify_all()

    async def wait(self) -> None:
        if self.tasks:
            await asyncio.gather(*self.tasks)

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.bar.close()
        self.summary.seconds = time.perf_counter() - self.t0


# ---- CLI -------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="jsonl file, one OpenAI-style request per line")
    parser.add_argument("--output", required=True,
                        help="jsonl results; appended to, and requests already in it are skipped")
    parser.add_argument("--model", default=None,
                        help="jax/opt-125m, alpa/opt-175b, ... (default: the embedded tiny model)")
    parser.add_argument("--path", default=None, help="numpy weights folder (or its parent)")
    parser.add_argument("--dummy", action="store_true", help="random weights of --model's size (no weight files)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --dummy weights")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer folder (vocab.json + merges.txt, tokenizer.json, or metaseq's "
                             "gpt2-vocab.json + gpt2-merges.txt); needed with --dummy beyond opt-tiny")
    parser.add_argument("--budget", type=int, default=16384,
                        help="most prompt + generated tokens (x best_of) in flight at once (default 16384)")
    parser.add_argument("--max-batch-size", type=int, default=16,
                        help="decode slots: most sequences advanced together per step (default 16)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="prompt + generated tokens per request (default: the model's positions); "
                             "smaller means a smaller KV cache and fewer prompt buckets to compile")
    parser.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                        help=f"prompts longer than N tokens are prefilled N at a time, between decode steps "
                             f"(default {PREFILL_CHUNK}; 0: whole)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="do not reuse the KV cache of prompts that start the same way (on by default)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): float16 on GPUs, float32 on CPUs")
    parser.add_argument("--quantize", choices=["int8"], default=None,
                        help="int8 weights with a scale per output channel (jax/ and alpa/ models)")
    parser.add_argument("--window", type=int, default=4096,
                        help="requests read and sorted together (bounds memory on huge files)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="TP",
                        help="alpa/ models: the plan's tensor-parallel degree (default: the planner's)")
    parser.add_argument("--pipeline-parallel", type=int, default=None, metavar="PP",
                        help="alpa/ models: pipeline stages on the Ray cluster (default: the planner's)")
    parser.add_argument("--device-memory", default=None, metavar="BYTES",
                        help="alpa/ models: what each device may hold, e.g. 16GB")
    parser.add_argument("--handoff", default="auto", choices=["auto", "cgraph", "refs"],
                        help="pipelined plans: how stages hand hidden states on: a Ray Compiled Graph (cgraph), "
                             "Ray object refs (refs), or auto: refs, the one measured faster "
                             "(pipeline.choose_handoff says why)")


def _interrupt(*_):
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if not Path(args.input).is_file():
        print(f"batch: input file {args.input} does not exist", file=sys.stderr)
        return 2
    for name in ("budget", "window", "max_batch_size", "max_seq_len"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            print(f"batch: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    if args.prefill_chunk < 0:
        print(f"batch: --prefill-chunk must be 0 (off) or positive, got {args.prefill_chunk}", file=sys.stderr)
        return 2
    # SIGTERM ends like Ctrl-C: every finished line is already flushed, requests in flight are redone
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        plan = {} if not is_parallel(args.model) else dict(
            tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
            device_memory=args.device_memory, handoff=args.handoff)
        gen = load_generator(args.model, args.path, args.dtype, args.max_batch_size, args.max_seq_len,
                             dummy=args.dummy, seed=args.seed, tokenizer=args.tokenizer, quantize=args.quantize,
                             prefill_chunk=args.prefill_chunk, prefix_caching=args.prefix_caching, **plan)
    except (OSError, ValueError, NotImplementedError) as e:  # missing folder, unknown name, alpa/ not ready
        print(f"batch: cannot load {args.model}: {e}", file=sys.stderr)
        return 2
    # what is loaded (model, compiled steps, libraries) lives as long as the job: frozen, Python's full
    # collections stop walking it between steps (as the Serve replica does; benchmark/README.md)
    gc.collect()
    gc.freeze()
    try:
        summary = run_file(args.input, args.output, gen, budget=args.budget, window=args.window,
                           progress=not args.no_progress)
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        gen.close()
    print(f"batch: {summary}", file=sys.stderr)
    return 0

"""`opt-serving batch`: run a jsonl file of OpenAI-style completion requests offline, resumably.

Input: one request per line in the seed "FM inference" format (`prompt` as text or token ids,
`max_tokens`, `temperature`, `top_p`, `n`, `best_of`, `logprobs`, `echo`, `stop`, optional `seed`;
other fields such as `engine` are kept but ignored; an optional `custom_id`/`request_id`/`id`).
Output: one line per request, `{"request": <the input line>, "result": {"choices": [...],
"request_time": {"batch_time", "batch_size"}}}`, or `{"request": ..., "error": {"message": ...}}` for a
malformed line or an impossible request. Lines are appended in the order requests finish.

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
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ID_FIELDS = ("custom_id", "request_id", "id")
MAX_LOGPROBS = 5
MAX_STOP = 4
# OpenAI's defaults for fields a line leaves out
DEFAULTS = dict(max_tokens=16, temperature=1.0, top_p=1.0, n=1, best_of=None, logprobs=None,
                echo=False, stop=None, seed=None)
FSYNC_EVERY_S = 1.0  # each line is flushed at once (a kill loses nothing written); fsync is for power loss


class RequestError(ValueError):
    """A line that cannot be run; its message goes into the error record."""


@dataclasses.dataclass
class Request:
    line_no: int          # 1-based, for messages
    request: Any          # the input line as given (parsed), echoed in the output
    key: str              # resume key
    prompt: str | list[int]
    params: dict          # validated settings, DEFAULTS filled in
    prompt_len: int = 0   # tokens, set once tokenised

    @property
    def rows(self) -> int:  # sequences this request decodes
        return self.params["best_of"]

    @property
    def length(self) -> int:
        return self.prompt_len + self.params["max_tokens"]

    @property
    def cost(self) -> int:  # tokens it holds while in flight
        return self.rows * self.length


# ---- parsing and validation -------------------------------------------------------------------

def request_key(request: Any) -> str:
    if isinstance(request, dict):
        for f in ID_FIELDS:
            if request.get(f) is not None:
                return f"id:{request[f]}"
        return "body:" + json.dumps(request, sort_keys=True)
    return "raw:" + str(request)


def _int(p: dict, name: str, lo: int, hi: int | None = None) -> int:
    v = p[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise RequestError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _float(p: dict, name: str, lo: float, hi: float) -> float:
    v = p[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"{name} must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise RequestError(f"{name} must be in [{lo}, {hi}], got {v}")
    return float(v)


def _err(request: Any, message: str) -> RequestError:
    e = RequestError(message)
    e.request = request
    return e


def parse_request(line_no: int, text: str) -> Request:
    """Parse and check one line; raises RequestError (with `.request` set) when it cannot run."""
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        raise _err(text.strip(), f"line {line_no}: not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise _err(req, f"line {line_no}: a request must be a JSON object, got {type(req).__name__}")
    try:
        return _check(line_no, req)
    except RequestError as e:
        raise _err(req, f"line {line_no}: {e}") from None


def _check(line_no: int, req: dict) -> Request:
    if "prompt" not in req:
        raise RequestError("missing field 'prompt'")
    prompt = req["prompt"]
    # OpenAI allows a one-element list of prompts; a file has one prompt per line
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise RequestError("prompt must be a string or a non-empty list of token ids "
                               "(one prompt per line)")
    elif not isinstance(prompt, str) or not prompt:
        raise RequestError(f"prompt must be a non-empty string or a list of token ids, got {prompt!r:.60}")
    p = {k: req.get(k) if req.get(k) is not None else d for k, d in DEFAULTS.items()}
    p["max_tokens"] = _int(p, "max_tokens", 0)
    p["temperature"] = _float(p, "temperature", 0.0, 100.0)
    p["top_p"] = _float(p, "top_p", 0.0, 1.0)
    if p["top_p"] == 0.0:
        raise RequestError("top_p must be > 0")
    p["n"] = _int(p, "n", 1, 128)
    p["best_of"] = p["n"] if p["best_of"] is None else _int(p, "best_of", 1, 128)
    if p["best_of"] < p["n"]:
        raise RequestError(f"best_of ({p['best_of']}) must be >= n ({p['n']})")
    if p["logprobs"] is not None:
        p["logprobs"] = _int(p, "logprobs", 0, MAX_LOGPROBS)
    if not isinstance(p["echo"], bool):
        raise RequestError(f"echo must be true or false, got {p['echo']!r}")
    stop = [p["stop"]] if isinstance(p["stop"], str) else p["stop"]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP
                             or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(f"stop must be a string or a list of up to {MAX_STOP} non-empty strings, "
                           f"got {p['stop']!r}")
    p["stop"] = stop or []
    if p["seed"] is not None:
        p["seed"] = _int(p, "seed", 0)
    if p["max_tokens"] == 0 and not p["echo"]:
        raise RequestError("max_tokens 0 only makes sense with echo (scoring the prompt)")
    return Request(line_no, req, request_key(req), prompt, p)


# ---- resume ----------------------------------------------------------------------------------

def read_done(output: Path) -> collections.Counter:
    """Keys already answered in `output`, counted; cuts a torn last line off the file."""
    done: collections.Counter = collections.Counter()
    if not output.exists():
        return done
    with open(output, "rb+") as f:
        lines = f.read().split(b"\n")
        good_end = 0
        for i, raw in enumerate(lines):
            last = i == len(lines) - 1
            if last and raw == b"":
                break
            try:
                rec = json.loads(raw)
                if not (isinstance(rec, dict) and "request" in rec and ("result" in rec or "error" in rec)):
                    raise ValueError("not a result record")
            except ValueError as e:
                # only the end of the file can be torn by a kill; anything else is someone else's file
                if not all(not x.strip() for x in lines[i + 1:]):
                    raise SystemExit(f"batch: {output} line {i + 1} is not a result record ({e}); "
                                     "refusing to append to it") from None
                print(f"batch: {output}: dropping a torn last line ({len(raw)} bytes); "
                      "its request will be redone", file=sys.stderr)
                f.truncate(good_end)
                break
            if last:  # complete JSON but no newline: finish the line
                f.write(b"\n")
            done[request_key(rec["request"])] += 1
            good_end += len(raw) + 1
    return done


# ---- reading the input -----------------------------------------------------------------------

def read_pending(path: Path, done: collections.Counter, window: int, skipped: list[int]
                 ) -> Iterator[tuple[list[Request], list[dict]]]:
    """Requests not yet in the output, a window at a time, with error records for lines that cannot
    run. Decrements `done` as it matches; counts matches in skipped[0]."""
    reqs: list[Request] = []
    errors: list[dict] = []
    seen_ids: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                r = parse_request(line_no, text)
                request, key, error = r.request, r.key, None
            except RequestError as e:
                r, request, key, error = None, e.request, request_key(e.request), str(e)
            if done[key] > 0:
                done[key] -= 1
                skipped[0] += 1
                continue
            if key.startswith("id:"):
                if key in seen_ids:
                    r, error = None, f"line {line_no}: duplicate request id {key[3:]}"
                seen_ids.add(key)
            if r is None:
                errors.append({"request": request, "error": {"message": error}})
            else:
                reqs.append(r)
            if len(reqs) >= window:
                yield reqs, errors
                reqs, errors = [], []
    if reqs or errors:
        yield reqs, errors


# ---- one request through the generator -------------------------------------------------------

def to_choices(completions) -> list[dict]:
    """generator.Completion objects -> the seed's / OpenAI's choice dicts."""
    return [{"text": c.text, "index": i,
             "logprobs": {"tokens": c.tokens, "token_logprobs": c.token_logprobs,
                          "top_logprobs": c.top_logprobs, "text_offset": c.text_offset},
             "finish_reason": c.finish_reason}
            for i, c in enumerate(completions)]


def sampling_params(r: Request):
    from opt_serving.generator import SamplingParams
    p = r.params
    return SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"], top_p=p["top_p"],
                          seed=p["seed"], stop=list(p["stop"]), logprobs=p["logprobs"], echo=p["echo"])


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


class _Output:
    """Appends complete lines, flushed one by one, fsynced now and then."""

    def __init__(self, path: Path):
        self.f = open(path, "a", encoding="utf-8")
        self.synced = time.monotonic()

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        self.f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.f.flush()
        if time.monotonic() - self.synced > FSYNC_EVERY_S:
            os.fsync(self.f.fileno())
            self.synced = time.monotonic()

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


# ---- the run ---------------------------------------------------------------------------------

def run_file(input_path: str | os.PathLike, output_path: str | os.PathLike, generator,
             budget: int = 16384, window: int = 4096, progress: bool = True) -> Summary:
    """Answer every request of `input_path` not yet in `output_path`, appending to it.

    `generator` is an `opt_serving.generator.Generator` (the caller owns it and closes it).
    Raises on an engine failure, after writing every request that finished."""
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"batch: input file {input_path} does not exist")
    if budget <= 0:
        raise ValueError(f"batch: budget must be positive, got {budget}")
    if window <= 0:
        raise ValueError(f"batch: window must be positive, got {window}")
    done = read_done(output_path)
    out = _Output(output_path)
    try:
        return asyncio.run(_run(input_path, done, out, generator, budget, window, progress))
    finally:
        out.close()


async def _run(input_path: Path, done: collections.Counter, out: _Output, gen, budget: int, window: int,
               progress: bool) -> Summary:
    from tqdm import tqdm

    from opt_serving.engine import QueueFull

    summary, skipped = Summary(), [0]
    with open(input_path, "rb") as f:
        total = sum(1 for line in f if line.strip())
    bar = tqdm(total=total, unit="req", disable=not progress, desc="batch", dynamic_ncols=True)
    t0 = time.perf_counter()
    # the queue never overflows if no more sequences are in flight than slots + queue places
    max_rows = gen.engine.num_slots + getattr(gen.engine, "max_queue", 0)
    room = asyncio.Condition()
    flight = {"tokens": 0, "rows": 0, "requests": 0}
    failure: list[BaseException] = []

    def record(records: list[dict], tokens: int = 0) -> None:
        out.write(records)
        summary.done += sum("result" in r for r in records)
        summary.failed += sum("error" in r for r in records)
        summary.tokens += tokens
        bar.update(len(records))
        bar.set_postfix(tok_s=f"{summary.tokens / (time.perf_counter() - t0):.1f}", refresh=False)

    async def one(r: Request, in_flight: int) -> None:
        start = time.perf_counter()
        try:
            while True:
                try:
                    completions = await gen.complete_n(r.prompt, sampling_params(r), n=r.params["n"],
                                                       best_of=r.params["best_of"])
                    break
                except QueueFull:  # someone else shares the engine: wait for a place
                    await asyncio.sleep(0.05)
            result = {"choices": to_choices(completions),
                      "request_time": {"batch_time": time.perf_counter() - start, "batch_size": in_flight}}
            record([{"request": r.request, "result": result}], sum(c.completion_tokens for c in completions))
        except ValueError as e:  # the request's own fault (the generator's checks)
            record([{"request": r.request, "error": {"message": f"line {r.line_no}: {e}"}}])
        except Exception as e:  # noqa: BLE001 - the engine's fault: stop, leave the request undone
            failure.append(e)
        finally:
            async with room:
                flight["tokens"] -= r.cost
                flight["rows"] -= r.rows
                flight["requests"] -= 1
                room.notify_all()

    def fits(r: Request) -> bool:
        if failure:
            return True  # wake up to stop
        if flight["requests"] == 0:
            return True  # over the budget alone: runs alone
        return flight["tokens"] + r.cost <= budget and flight["rows"] + r.rows <= max_rows

    tasks: set[asyncio.Task] = set()
    try:
        for reqs, errors in read_pending(input_path, done, window, skipped):
            bar.update(skipped[0] - summary.skipped)
            summary.skipped = skipped[0]
            runnable = []
            for r, ids in zip(reqs, _encode(gen, [r.prompt for r in reqs])):
                r.prompt_len = len(ids)
                bad = _impossible(gen, r)
                if bad:
                    errors.append({"request": r.request, "error": {"message": f"line {r.line_no}: {bad}"}})
                else:
                    runnable.append(r)
            record(errors)
            runnable.sort(key=lambda r: (r.length, r.prompt_len), reverse=True)
            for r in runnable:
                async with room:
                    await room.wait_for(lambda: fits(r))
                    if failure:
                        break
                    flight["tokens"] += r.cost
                    flight["rows"] += r.rows
                    flight["requests"] += 1
                    summary.peak_tokens = max(summary.peak_tokens, flight["tokens"])
                    summary.peak_requests = max(summary.peak_requests, flight["requests"])
                    task = asyncio.create_task(one(r, flight["requests"]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if failure:
                break
        bar.update(skipped[0] - summary.skipped)
        summary.skipped = skipped[0]
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
        summary.seconds = time.perf_counter() - t0
    if failure:
        raise RuntimeError(f"batch: the engine failed ({type(failure[0]).__name__}: {failure[0]}); "
                           f"{summary.done + summary.failed} lines written, re-run to finish") from failure[0]
    return summary


def _encode(gen, prompts: list) -> list[list[int]]:
    """Token ids of every prompt, the texts in one tokenizer call."""
    encoded = iter(gen.encode_batch([p for p in prompts if isinstance(p, str)]))
    return [list(p) if isinstance(p, list) else next(encoded) for p in prompts]


def _impossible(gen, r: Request) -> str | None:
    """Why the model cannot run this request (checked before it takes budget), or None."""
    try:
        sampling_params(r).validate()
    except ValueError as e:
        return str(e)
    if isinstance(r.prompt, list):
        vocab = gen.vocab_size
        bad = [t for t in r.prompt if t >= vocab]
        if bad:
            return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
    if r.length > gen.max_seq_len:
        return (f"prompt ({r.prompt_len} tokens) + max_tokens ({r.params['max_tokens']}) = {r.length} "
                f"exceeds the model's maximum context length of {gen.max_seq_len} tokens")
    return None


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
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): float16 on GPUs, float32 on CPUs")
    parser.add_argument("--window", type=int, default=4096,
                        help="requests read and sorted together (bounds memory on huge files)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="TP",
                        help="alpa/ models: the plan's tensor-parallel degree (default: the planner's)")
    parser.add_argument("--pipeline-parallel", type=int, default=None, metavar="PP",
                        help="alpa/ models: pipeline stages on the Ray cluster (default: the planner's)")
    parser.add_argument("--device-memory", default=None, metavar="BYTES",
                        help="alpa/ models: what each device may hold, e.g. 16GB")


def load_generator(model: str | None, path: str | None, dtype: str = "float32", max_batch_size: int = 16,
                   max_seq_len: int | None = None, dummy: bool = False, seed: int = 0,
                   tokenizer: str | None = None, **plan):
    """The named model from `path` (random weights of its size with `dummy`), or the embedded tiny one,
    as the service loads it."""
    from opt_serving.generator import Generator
    if dummy:
        if model is None or path is not None:
            raise SystemExit("batch: --dummy needs --model (e.g. --model jax/opt-125m) and no --path")
        return Generator.from_pretrained(model, None, dtype=dtype, max_batch_size=max_batch_size,
                                         max_seq_len=max_seq_len, dummy=True, seed=seed, tokenizer=tokenizer, **plan)
    if path is None:
        if model is not None:
            raise SystemExit("batch: --model needs --path (the numpy weights folder)")
        from opt_serving.embedded import ensure_embedded_model
        path, model = str(ensure_embedded_model()), "jax/opt-tiny"
    elif model is None:
        raise SystemExit("batch: --path needs --model (e.g. --model jax/opt-125m)")
    return Generator.from_pretrained(model, path, dtype=dtype, max_batch_size=max_batch_size,
                                     max_seq_len=max_seq_len, tokenizer=tokenizer, **plan)


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
    # SIGTERM ends like Ctrl-C: every finished line is already flushed, requests in flight are redone
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        plan = {} if not (args.model or "").startswith("alpa/") else dict(
            tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
            device_memory=args.device_memory)
        gen = load_generator(args.model, args.path, args.dtype, args.max_batch_size, args.max_seq_len,
                             dummy=args.dummy, seed=args.seed, tokenizer=args.tokenizer, **plan)
    except (OSError, ValueError, NotImplementedError) as e:  # missing folder, unknown name, alpa/ not ready
        print(f"batch: cannot load {args.model}: {e}", file=sys.stderr)
        return 2
    # what is loaded (model, compiled steps, libraries) lives as long as the job: frozen, Python's full
    # collections stop walking it between steps (as the Serve replica does; benchmark/README.md)
    import gc
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

"""The batch runner's files (batch.py runs them): jsonl request lines mapped onto the request module's
checks, the output's records, and what a re-run finds already done in it."""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from opt_serving.errors import InvalidRequest
from opt_serving.text.request import BATCH_MAX_N, LEGACY_MAX_LOGPROBS, SamplingParams, check_n, prompt_form

ID_FIELDS = ("custom_id", "request_id", "id")
# OpenAI's defaults for fields a line leaves out
DEFAULTS = dict(max_tokens=16, temperature=1.0, top_p=1.0, n=1, best_of=None, logprobs=None,
                echo=False, stop=None, seed=None)
FSYNC_EVERY_S = 1.0  # each line is flushed at once (a kill loses nothing written); fsync is for power loss


class RequestError(InvalidRequest):
    """A line that cannot be run; its message (with the line number) goes into the error record, and
    `request` is the line as given (parsed where it parses), echoed there."""

    def __init__(self, message: str, request: Any, param: Optional[str] = None):
        super().__init__(message, param=param)
        self.request = request


@dataclasses.dataclass
class Request:
    line_no: int          # 1-based, for messages
    request: Any          # the input line as given (parsed), echoed in the output
    key: str              # resume key
    prompt: str | list[int]
    params: dict          # the line's settings, DEFAULTS filled in and best_of resolved
    sampling: SamplingParams  # the same, as the generator takes them (checked)
    prompt_len: int = 0   # tokens, set once tokenised
    ids: Optional[list[int]] = None  # the prompt, tokenised and checked against the model

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


def parse_request(line_no: int, text: str) -> Request:
    """Parse and check one line (everything that needs no model); raises RequestError when it cannot run."""
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"line {line_no}: not valid JSON: {e}", text.strip()) from None
    if not isinstance(req, dict):
        raise RequestError(f"line {line_no}: a request must be a JSON object, got {type(req).__name__}", req)
    try:
        return _request(line_no, req)
    except InvalidRequest as e:
        raise RequestError(f"line {line_no}: {e}", req, e.param) from None


def _request(line_no: int, req: dict) -> Request:
    """A line's fields onto SamplingParams, checked as the generator checks them (request.py)."""
    if "prompt" not in req:
        raise InvalidRequest("missing field 'prompt'", param="prompt")
    prompt = req["prompt"]
    # OpenAI allows a one-element list of prompts; a file has one prompt per line
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest(f"prompt holds {len(prompt)} prompts; a file has one prompt per line", param="prompt")
    prompt = prompt_form(prompt)
    p = {k: req.get(k) if req.get(k) is not None else d for k, d in DEFAULTS.items()}
    p["best_of"] = check_n(p["n"], p["best_of"], BATCH_MAX_N)
    # score_tokens: the output always carries token_logprobs (to_choices)
    sampling = SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"], top_p=p["top_p"],
                              seed=p["seed"], stop=p["stop"] or [], logprobs=p["logprobs"], echo=p["echo"],
                              score_tokens=True)
    sampling.validate(max_logprobs=LEGACY_MAX_LOGPROBS)
    p["stop"] = list(sampling.stop)  # a string is one stop string
    return Request(line_no, req, request_key(req), prompt, p, sampling)


def to_choices(completions) -> list[dict]:
    """generator.Completion objects -> the seed's / OpenAI's choice dicts."""
    return [{"text": c.text, "index": i,
             "logprobs": {"tokens": c.tokens, "token_logprobs": c.token_logprobs,
                          "top_logprobs": c.top_logprobs, "text_offset": c.text_offset},
             "finish_reason": c.finish_reason}
            for i, c in enumerate(completions)]


def error_record(request: Any, message: str) -> dict:
    return {"request": request, "error": {"message": message}}


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
                errors.append(error_record(request, error))
            else:
                reqs.append(r)
            if len(reqs) >= window:
                yield reqs, errors
                reqs, errors = [], []
    if reqs or errors:
        yield reqs, errors


# ---- writing the output ----------------------------------------------------------------------

class Output:
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

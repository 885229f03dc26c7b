"""Beam search beside the engine: it does not fit the engine's one-token-per-slot step, so `Generator.beam()`
runs the model's own jitted HF-style `generate(num_beams=...)` on one worker thread (searches one after
another, each with the whole device; the event loop stays free).

What may wait is bounded twice: at most `max_queue` searches, and a budget of beam tokens, a search costing
num_beams x (prompt + max_tokens) tokens (the KV cache rows it fills; the default budget is what the engine's
decode slots hold). A request whose searches do not fit what is left of the budget is refused with
Overloaded (429, Retry-After) rather than queued behind minutes of other searches; one larger than the whole
budget could never run and is an InvalidRequest (400) naming it. A search whose caller gives up (`BeamJob.
cancel()`: a client gone, a timeout) is dropped if it has not started and stopped before its next step if it
has (`generate(should_stop=...)`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import Callable, Optional, Sequence

import numpy as np

from opt_serving.text.completion import Completion
from opt_serving.engine.scheduler import EngineClosed, QueueFull
from opt_serving.errors import InvalidRequest
from opt_serving.text.packing import find_stop
from opt_serving.text.request import SamplingParams


def beam_cost(num_beams: int, prompt_tokens: int, max_tokens: int) -> int:
    """A search's beam tokens: each beam's prompt and new tokens (its KV cache row)."""
    return num_beams * (prompt_tokens + max_tokens)


class BeamJob:
    """A submitted search: its future, and the flag its search polls before every step."""

    def __init__(self, future: "concurrent.futures.Future[Completion]", stop: threading.Event):
        self.future, self._stop = future, stop

    def cancel(self) -> None:
        """Drop the search if it has not started; stop it before its next step if it has."""
        self._stop.set()
        self.future.cancel()


class BeamQueue:
    """One worker thread; the searches submitted and not finished are bounded in count and in beam tokens."""

    def __init__(self, max_queue: int, budget: int):
        self.max_queue, self.budget = max_queue, budget
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._pending = 0
        self._pending_cost = 0
        self._stops: set[threading.Event] = set()
        self._closed = False

    @property
    def pending(self) -> tuple[int, int]:
        """(searches, beam tokens) submitted and not finished."""
        with self._lock:
            return self._pending, self._pending_cost

    def submit_all(self, searches: Sequence[tuple[int, Callable[..., Completion], tuple]]) -> list[BeamJob]:
        """Queue every (cost, fn, args) of one request, or none: `fn(*args, should_stop)` runs on the worker.
        Raises EngineClosed after close(), InvalidRequest when their cost is over the whole budget, QueueFull
        (Overloaded) when they do not fit what is left of it or of max_queue."""
        cost = sum(c for c, _, _ in searches)
        with self._lock:
            if self._closed:
                raise EngineClosed("the generator is shut down")
            if cost > self.budget:
                raise InvalidRequest(f"beam search of {cost} beam tokens (num_beams x (prompt + max_tokens), "
                                     f"summed over the prompts) is over this server's budget of {self.budget}",
                                     param="num_beams", code="beam_budget_exceeded")
            if self._pending + len(searches) > self.max_queue:
                raise QueueFull(f"beam search queue is full ({self._pending} waiting)")
            if self._pending_cost + cost > self.budget:
                raise QueueFull(f"beam searches of {self._pending_cost} beam tokens are running or waiting; "
                                f"{cost} more would pass the budget of {self.budget}")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="opt-beam")
            jobs = []
            for c, fn, args in searches:
                stop = threading.Event()
                self._pending += 1
                self._pending_cost += c
                self._stops.add(stop)
                jobs.append((c, BeamJob(self._pool.submit(self._run, fn, args, stop), stop)))
        for c, job in jobs:  # (outside the lock: a search already done calls back at once)
            job.future.add_done_callback(lambda _f, c=c, stop=job._stop: self._done(c, stop))
        return [job for _, job in jobs]

    def _run(self, fn: Callable[..., Completion], args: tuple, stop: threading.Event) -> Completion:
        try:
            return fn(*args, stop.is_set)
        except Exception as e:  # stopped by close(): the caller is told the server is shutting down
            if stop.is_set() and self._closed:
                raise EngineClosed("the generator is shut down") from e
            raise

    def _done(self, cost: int, stop: threading.Event) -> None:
        with self._lock:
            self._pending -= 1
            self._pending_cost -= cost
            self._stops.discard(stop)

    def close(self) -> None:
        """Refuse new searches, drop the waiting ones and stop the running one before its next step."""
        with self._lock:
            self._closed = True
            pool = self._pool
            for stop in self._stops:
                stop.set()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class BeamSearch:
    """How a search runs: `num_beams` beams, the `num_return` best returned (best first), HF's `length_penalty`
    (a finished beam's score is its logprob sum over its length ** length_penalty) and `early_stopping`."""
    num_beams: int
    num_return: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False


def run_beam(model, ids: list[int], params: SamplingParams, search: BeamSearch, eos_token_id: Optional[int],
             decode: Callable[[list[int]], str], token_text: Callable[[int], str],
             should_stop: Optional[Callable[[], bool]] = None) -> list[Completion]:
    """One search (on the worker thread): its `search.num_return` best beams as Completions, best first, each cut
    at a stop string. Uses max_tokens, min_tokens, repetition_penalty, no_repeat_ngram_size, bad_words_ids, stop
    and ignore_eos. `should_stop`: asked before every step; the model raises SearchStopped once it is true."""
    eos = None if params.ignore_eos else eos_token_id
    out = model.generate(
        input_ids=np.asarray([ids], np.int32), do_sample=False, num_beams=search.num_beams,
        num_return_sequences=search.num_return, length_penalty=search.length_penalty,
        max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens or None,
        repetition_penalty=params.repetition_penalty, no_repeat_ngram_size=params.no_repeat_ngram_size,
        bad_words_ids=[list(w) for w in params.bad_words_ids] or None, early_stopping=search.early_stopping,
        eos_token_id=-1 if eos is None else eos, should_stop=should_stop)
    rows = np.asarray(getattr(out, "sequences", out))[:, len(ids):].tolist()
    return [_beam_completion(row, ids, params, eos, decode, token_text) for row in rows]


def _beam_completion(new: list[int], ids: list[int], params: SamplingParams, eos: Optional[int],
                     decode: Callable[[list[int]], str], token_text: Callable[[int], str]) -> Completion:
    """One returned beam (its new tokens, padded after an EOS) as a Completion."""
    reason, generated = "length", list(new)
    if eos is not None and eos in new:  # the beam ended; generate() pads after its EOS
        new, reason = new[:new.index(eos)], "stop"
        generated = new + [eos]
    c = Completion(text=decode(new), token_ids=new, tokens=[token_text(t) for t in new],
                   finish_reason=reason, prompt_tokens=len(ids), completion_tokens=len(generated),
                   prompt_token_ids=list(ids), output_token_ids=generated)
    if params.stop:
        cut, _ = find_stop(c.text, params.stop)
        if cut >= 0:
            c.text, c.finish_reason = c.text[:cut], "stop"
    return c


def run_best_beam(*args, **kwargs) -> Completion:
    """`run_beam`'s best beam alone."""
    return run_beam(*args, **kwargs)[0]


class BeamStream:
    """One returned beam of a search as a stream of deltas (the whole Completion, once the search ends), so a
    server streams or joins the choices of a beam search as it does sampled ones. The choices of one search share
    its future: `cancel()` on any stops the search; `expire_at(when)` (loop.time()) stops it then and ends the
    stream with a TimeoutError, as DeltaStream's does."""

    def __init__(self, future: "asyncio.Future[list[Completion]]", index: int):
        self._future, self._index, self._done = future, index, False
        self._expiry: Optional[asyncio.TimerHandle] = None
        self._expired = False

    def expire_at(self, when: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._future.cancel()

    def __aiter__(self) -> "BeamStream":
        return self

    async def __anext__(self) -> Completion:
        if self._done:
            raise StopAsyncIteration
        self._done = True
        try:
            return (await asyncio.shield(self._future))[self._index]  # (one choice's waiter leaving stops no other)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._expired and not (current is not None and current.cancelling()):  # the deadline, not our reader
                raise TimeoutError("request timed out") from None
            raise
        finally:
            self._drop_expiry()

    def _drop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def cancel(self) -> None:
        self._done = True
        self._drop_expiry()
        self._future.cancel()

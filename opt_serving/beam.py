"""Beam search beside the engine: it does not fit the engine's one-token-per-slot step, so `Generator.beam()`
runs the model's own jitted HF-style `generate(num_beams=...)` on one worker thread (searches one after
another, each with the whole device; the event loop stays free), at most `max_queue` waiting."""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, Optional

import numpy as np

from opt_serving.completion import Completion
from opt_serving.engine import EngineClosed, QueueFull
from opt_serving.packing import find_stop
from opt_serving.request import SamplingParams


class BeamQueue:
    """One worker thread and a bounded count of searches submitted and not finished."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False

    def submit(self, fn: Callable[..., Completion], *args) -> "concurrent.futures.Future[Completion]":
        """Queue `fn(*args)`; raises EngineClosed after close(), QueueFull when max_queue are waiting.
        Cancelling the future drops a search that has not started (a running one finishes first)."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the generator is shut down")
            if self._pending >= self.max_queue:
                raise QueueFull(f"beam search queue is full ({self._pending} waiting)")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="opt-beam")
            self._pending += 1
            job = self._pool.submit(fn, *args)
        job.add_done_callback(self._done)
        return job

    def _done(self, _job) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def run_beam(model, ids: list[int], params: SamplingParams, num_beams: int, early_stopping: bool,
             eos_token_id: Optional[int], decode: Callable[[list[int]], str],
             token_text: Callable[[int], str]) -> Completion:
    """One search (on the worker thread): the best beam as a Completion, cut at a stop string. Uses
    max_tokens, min_tokens, repetition_penalty, no_repeat_ngram_size, bad_words_ids, stop and ignore_eos."""
    eos = None if params.ignore_eos else eos_token_id
    out = model.generate(
        input_ids=np.asarray([ids], np.int32), do_sample=False, num_beams=num_beams,
        max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens or None,
        repetition_penalty=params.repetition_penalty, no_repeat_ngram_size=params.no_repeat_ngram_size,
        bad_words_ids=[list(w) for w in params.bad_words_ids] or None, early_stopping=early_stopping,
        eos_token_id=-1 if eos is None else eos)
    new = np.asarray(getattr(out, "sequences", out))[0, len(ids):].tolist()
    reason = "length"
    if eos is not None and eos in new:  # the best beam ended; generate() pads after its EOS
        new, reason = new[:new.index(eos)], "stop"
    c = Completion(text=decode(new), token_ids=new, tokens=[token_text(t) for t in new],
                   finish_reason=reason, prompt_tokens=len(ids), completion_tokens=len(new) + (reason == "stop"))
    if params.stop:
        cut, _ = find_stop(c.text, params.stop)
        if cut >= 0:
            c.text, c.finish_reason = c.text[:cut], "stop"
    return c

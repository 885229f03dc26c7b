"""Continuous batching over a fixed number of decode slots (JetStream's shape).

  * a slot model (`runner.slots.Slots` for every plan: one device, a tensor-parallel mesh or pipeline stages;
    `FakeSlots` in `engine/fake.py`) owns the KV cache and the jitted steps: `prefill(tokens,
    settings) -> Prefix`, `insert(prefix, slot)`, `step() -> StepResult` (one decode over every slot, or, for a
    pipeline, over one micro-batch group of them: `StepResult.rows`), `free(slot)`. Sampling settings are
    per-slot arrays, so requests with different settings share a step.
  * `Engine`, this module, the scheduler: a bounded queue and a background thread that admits queued requests into free
    slots (a short prompt joins the next decode step where the slot model has `join`, or the one after where
    that step's block is full; the others are prefilled,
    together when it has `prefill_batch`, up to a budget of prompt tokens an iteration; a prompt with more than
    `prefill_chunk` tokens to compute in chunks, between decode steps: admission.py), steps (`decode_steps` at a
    time while nobody waits for a slot), and hands each request its tokens through a callback (called on the engine
    thread; the generator forwards them to asyncio, a step's for every stream in one wake-up of the event loop).
    EOS, max_tokens, the context limit, a callback asking to stop (stop strings) and `cancel()` (client
    disconnects) free the slot before the next step.
No HTTP and no Ray here.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Optional, Sequence

from opt_serving.engine import admission
from opt_serving.engine.counters import EngineCounters
from opt_serving.engine.stepping import DecodeCalls
from opt_serving.engine.types import (Callback, EngineClosed, EngineRequest, EngineStats, QueueFull, SlotModel,
                                      check_bad_words, check_prompt)
from opt_serving.runner.types import MAX_TOP_LOGPROBS, EngineOutput, Prefix, SlotSettings, StepResult, TokenInfo

# the engine's vocabulary (engine/types.py, runner/types.py), re-exported for the generator and the service
__all__ = ["Engine", "EngineClosed", "EngineOutput", "EngineRequest", "EngineStats", "MAX_TOP_LOGPROBS", "OPTSlots",
           "Prefix", "QueueFull", "SlotModel", "SlotSettings", "StepResult", "TokenInfo"]

log = logging.getLogger(__name__)

# longest a busy engine may go without finishing a prefill or a decode step before check_health() calls it stuck
# (a step of OPT-175B is well under a second; compiling an unseen shape takes tens of seconds on a CPU)
HEALTH_STALL_S = 120.0


class Engine(DecodeCalls):
    """Scheduler thread over a slot model: bounded queue, admission into free slots, one step for all."""

    def __init__(self, model: SlotModel, max_queue: int = 256, start: bool = True,
                 health_stall_s: float = HEALTH_STALL_S, prefill_chunk: Optional[int] = admission.PREFILL_CHUNK,
                 prefill_budget: Optional[int] = None, decode_steps: int = 1,
                 decode_call_s: float = admission.DECODE_CALL_S, ahead: bool = False):
        """`prefill_chunk`: prompts with more than this many tokens to compute are prefilled in chunks of it,
        between decode steps (where the slot model can; 0 or None: every prompt whole); `prefill_budget`: the
        prompt tokens an iteration prefills, whole prompts and chunks (default admission.PREFILL_BUDGET, at least
        one prompt or chunk). `decode_steps`: decode steps taken in one call of the slot model (where it has
        `step_many`) while no queued request could take a free slot and no prompt is being prefilled in chunks,
        and while that many steps take at most `decode_call_s` seconds (as the steps so far went); each request
        gets the call's tokens in one output. Fewer calls, less of the host's work a token; a
        request finishing at the first of them holds its slot until the last, one arriving meanwhile waits for it.
        `ahead`: while nobody waits, the next such call is sent before this one's tokens are read (where the slot
        model `sends_ahead`; engine/stepping.py): the host's turn between calls runs beside the device's work."""
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be at least 1, got {decode_steps}")
        self.model = model
        self.decode_steps, self.decode_call_s, self.ahead = decode_steps, decode_call_s, ahead
        self._step_s = 0.0  # a decode step's wall time, a moving average (0: none taken yet)
        self._chunked = admission.ChunkedPrefill(model, prefill_chunk, prefill_budget)
        self.prefill_chunk = self._chunked.chunk
        if model.joins_steps:  # (prompts joining steps a part at a time take as many tokens a step)
            model.set_prefill_chunk(self.prefill_chunk)
        self.max_queue = max_queue
        self.health_stall_s = health_stall_s
        self._clock = time.monotonic   # (tests move time on by hand)
        self._progress_at = self._clock()  # last finished prefill or step, or when work arrived at an idle engine
        self._died: Optional[BaseException] = None  # what ended the engine thread, if anything did
        self._queue: collections.deque[EngineRequest] = collections.deque()
        self._slots: list[Optional[EngineRequest]] = [None] * model.num_slots
        self._cv = threading.Condition()
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        self._counts = EngineCounters()  # (under self._cv) what stats() reports
        self._last_step_at: Optional[float] = None  # when the latest decode step began, rows still running
        if start:
            self.start()

    # ---- public, thread-safe ----
    @property
    def num_slots(self) -> int:
        return self.model.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_top_logprobs(self) -> int:
        """The most top alternatives a token can come with."""
        return self.model.max_top_logprobs

    def warmup(self, every_shape: bool = True) -> None:
        """Compile what serving runs now, not at the first request (without `every_shape`, where prompts join
        the steps: what generation runs; the prefills only scored prompts run compile at their first use)."""
        self.model.warmup(prefill_chunk=self.prefill_chunk or None,
                          decode_steps=self.decode_steps if self.model.many_steps else 1, every_shape=every_shape)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_guarded, name="opt-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt: Sequence[int], settings: SlotSettings, on_output: Callback) -> EngineRequest:
        """Queue a request. `on_output` runs on the engine thread for the prompt scores (if asked), every
        new token and the finish; it returns True to stop the request (its slot is freed at once).
        Raises QueueFull, EngineClosed, or InvalidRequest (a ValueError) for a request the slot model cannot
        hold. The request was checked before it got here (request.py, through Generator.prepare); only the
        slot model's invariants are asserted again, cheaply (len, min, max): a KV cache that holds the
        request, embedding rows that exist, bad words that fit their fixed-shape arrays."""
        prompt = [int(t) for t in prompt]
        check_prompt(prompt, settings.max_tokens, self.vocab_size, self.max_seq_len)
        check_bad_words(settings.bad_words_ids)
        req = EngineRequest(prompt, settings, on_output)
        with self._cv:
            if self._closing:
                raise EngineClosed("the engine is shut down")
            if self._died is not None:
                raise EngineClosed(f"the engine thread died: {self._died!r}")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"request queue is full ({self.max_queue} waiting)")
            if not self._busy():  # idle time is not a stall: the clock starts with the work
                self._progress_at = self._clock()
            req.submitted = time.perf_counter()
            self._queue.append(req)
            self._cv.notify()
        return req

    def cancel(self, req: EngineRequest) -> None:
        """Stop a request (client gone); its slot is freed before the next step. No callback follows."""
        with self._cv:
            req.cancelled = True
            if req.slot is None and req in self._queue:
                self._queue.remove(req)
                req.done = True
            self._cv.notify()

    def stats(self) -> EngineStats:
        with self._cv:
            return self._counts.stats(len(self._queue), self._running(), self.num_slots,
                                      None if self.model.costs is None else dataclasses.asdict(self.model.costs))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread; queued and running requests finish with EngineClosed."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_pending(EngineClosed("the engine shut down before the request finished"))
        self.model.close()  # e.g. a pipeline's stage actors and placement group

    def check_health(self) -> None:
        """Raise RuntimeError saying why this engine cannot serve: its thread is dead (or was never started),
        or work is queued or running and no prefill or decode step has finished for `health_stall_s`; then
        the slot model's own `check_health()`, where it has one (a pipeline's stages). Ray Serve's replica
        health check calls this (through Generator.check_health) and replaces a replica that fails it."""
        with self._cv:
            died, busy, waited = self._died, self._busy(), self._clock() - self._progress_at
            queued, running = len(self._queue), self._running()
        if died is not None:
            raise RuntimeError(f"engine thread died: {died!r}")
        if self._thread is None or not self._thread.is_alive():
            state = "was never started" if self._thread is None else "is not running"
            raise RuntimeError(f"engine thread {state}" + (" (engine closed)" if self._closing else ""))
        if busy and waited > self.health_stall_s:
            raise RuntimeError(f"engine stalled: no prefill or decode step finished in {waited:.0f} s "
                               f"(limit {self.health_stall_s:g} s) with {queued} queued and {running} running")
        self.model.check_health()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- engine thread ----
    def _running(self) -> int:  # (under self._cv) occupied slots, those kept for chunked prefills included
        return sum(r is not None for r in self._slots) + self._chunked.held

    def _busy(self) -> bool:  # (under self._cv)
        return bool(self._queue) or self._running() > 0

    def _progressed(self) -> None:
        with self._cv:
            self._progress_at = self._clock()

    def _run_guarded(self) -> None:
        """The engine loop; if it ever raises, the engine is dead: say so to health checks, new requests and
        the requests waiting (they would otherwise wait forever)."""
        try:
            self._run()
        except BaseException as e:
            log.exception("engine thread died")
            with self._cv:
                self._died = e
            self._fail_pending(EngineClosed(f"the engine thread died: {e!r}"))

    def _fail_pending(self, error: BaseException) -> None:
        """Every queued and running request ends with `error`."""
        with self._cv:
            pending = list(self._queue) + [r for r in self._slots if r is not None]
            pending += self._chunked.reqs
            self._queue.clear()
        for req in pending:
            self._fail(req, error)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closing or self._busy()):
                    self._cv.wait()
                if self._closing:
                    return
            with self._cv:  # an admission or a chunk changes the slots: the calls sent ahead are handed out first
                settle = bool(self._queue) or self._chunked.held > 0
            if settle:
                self._settle_or_fail()
            # cancelled requests leave their slots before anything else runs
            for req in self._slots:
                if req is not None and req.cancelled:
                    self._release(req)
            with self._cv:  # a slot is kept for each prompt being prefilled in chunks
                free = self._slots.count(None) - self._chunked.held
                admit = admission.take(self._queue, free, self._chunked)
            joined = self._counts.joined
            admit = [req for req in admit if not self._join(req)]
            joining = self._counts.joined != joined  # prompts ride in this iteration's step
            later = [req for req in admit if self._joins_later(req)]
            if later:  # back to the queue's front: they join the next step, after this one's
                admit = [req for req in admit if not self._joins_later(req)]
                with self._cv:
                    self._queue.extendleft(reversed(later))
            for req in admit:
                self._started(req)
            t = time.perf_counter()
            prefixes = admission.prefill_whole(self.model, admit)
            if admit:
                self._count_passes(time.perf_counter() - t, admission.passes(self.model, admit),
                                   sum(len(r.prompt) - p.cached for r, p in zip(admit, prefixes)
                                       if not isinstance(p, BaseException)))
            for req, prefix in zip(admit, prefixes):
                try:
                    if isinstance(prefix, BaseException):
                        raise prefix
                    self._admit(req, self._slots.index(None), prefix)
                except Exception as e:  # this request fails, the others carry on
                    log.exception("request %d: prefill failed", req.id)
                    self._fail(req, e)
            if admit:
                self._progressed()
            if self._chunked.held:  # a budget of chunks an iteration: a decode step comes between them
                self._prefill_chunks()
            if any(self._slots):
                try:
                    self._step(joining)
                except Exception as e:  # a failed step fails the requests in it, the engine keeps serving
                    self._step_failed(e)
                self._progressed()

    def _step_failed(self, e: Exception) -> None:
        log.exception("engine step failed")
        self.model.abandon_many()  # (the calls in flight, if any, are the failed requests')
        for req in [r for r in self._slots if r is not None]:
            self._fail(req, e)

    def _settle_or_fail(self) -> None:
        try:
            self._settle()
        except Exception as e:
            self._step_failed(e)

    def _prefill_chunks(self) -> None:
        """This iteration's chunks of the prompts prefilled in chunks; a prompt whose last chunk ran takes a
        slot kept for it. A cancelled request is let go, with the cache rows its chunks filled."""
        t, before = time.perf_counter(), (self._chunked.chunks, self._chunked.computed)
        done = self._chunked.advance(started=self._started)
        self._count_passes(time.perf_counter() - t, self._chunked.chunks - before[0],
                           self._chunked.computed - before[1])
        for req, prefix in done:
            if prefix is None:  # cancelled
                req.done = True
                continue
            try:
                if isinstance(prefix, BaseException):
                    raise prefix
                self._admit(req, self._slots.index(None), prefix)
            except Exception as e:  # this request fails, the others carry on
                self._fail(req, e)
        self._progressed()

    def _join(self, req: EngineRequest) -> bool:
        """Start a short prompt in a free slot with its prefill in the next decode step, where the slot model
        takes it (`join`); the step gives its first token. False: prefill it first."""
        if not self.model.joins_steps or req.settings.max_tokens <= 0:  # (scoring only: prefilled, never stepped)
            return False
        slot = self._slots.index(None)
        if not self.model.join(req.prompt, req.settings, slot):
            return False
        self._count_prefill(req, joined=True)
        self._started(req)
        req.joined = True  # what the prefix cache gave it is known by its first token (_deliver)
        req.slot = slot
        self._slots[slot] = req
        return True

    def _joins_later(self, req: EngineRequest) -> bool:
        """A short prompt that found this step's block full joins the next step rather than being prefilled
        now: a prefill pass of a few short prompts reads every weight with the running streams waiting, where
        the next step carries them in its products while it decodes (a batch of clients that finished
        together sends its next requests at once: more than a block's worth of prompts arrive)."""
        return (self.model.joins_steps and req.settings.max_tokens > 0
                and self.model.joinable(req.prompt, req.settings))

    def _started(self, req: EngineRequest) -> None:
        """The request's first computation begins: its wait in the queue ends."""
        if not req.started:
            req.started, req.started_at = True, time.perf_counter()
            with self._cv:
                self._counts.queue_wait.observe(req.started_at - req.submitted)

    def _count_passes(self, seconds: float, passes: int, computed: int) -> None:
        with self._cv:
            self._counts.passes(seconds, passes, computed)

    def _count_prefill(self, req: EngineRequest, joined: bool = False, cached: int = 0) -> None:
        with self._cv:
            self._counts.prefill(req, joined, cached)

    def _admit(self, req: EngineRequest, slot: int, prefix: Prefix) -> None:
        self._count_prefill(req, cached=prefix.cached)
        req.cached_tokens = prefix.cached  # told with the request's first output
        if prefix.prompt is not None and self._emit(req, EngineOutput(prefix.prompt, is_prompt=True)):
            self._discard(prefix)
            return
        if req.settings.max_tokens <= 0:  # scoring only (echo with max_tokens=0)
            self._discard(prefix)
            self._finish(req, EngineOutput([], finish_reason="length"))
            return
        req.slot = slot
        self._slots[slot] = req
        self.model.insert(prefix, slot)
        self._deliver(req, [prefix.first])

    def _discard(self, prefix: Prefix) -> None:
        self.model.discard(prefix)

    def _deliver(self, req: EngineRequest, toks: list[TokenInfo]) -> None:
        """Hand the request its new tokens (one a step, in one output) and free its slot if it finished: the
        tokens after one that finishes it are dropped."""
        if req.cancelled:  # cancelled during the step: the tokens are dropped
            self._release(req)
            return
        s, out, reason = req.settings, [], None
        if req.generated == 0 and req.started:  # its first token: the prompt took this long since it started
            with self._cv:
                self._counts.prompt_time.observe(time.perf_counter() - req.started_at)
        if req.joined and req.generated == 0:  # its prompt was computed in the steps, past its cached prefix
            req.cached_tokens = self.model.cached_of(req.slot)
            with self._cv:
                self._counts.cached_tokens += req.cached_tokens
                self._counts.joined_tokens += len(req.prompt) - req.cached_tokens
        for tok in toks:
            req.generated += 1
            if not s.logprob and tok.logprob is not None:  # not asked: the same answer whether or not the
                tok = dataclasses.replace(tok, logprob=None)  # step made the logits (top alternatives follow top_logprobs)
            out.append(tok)
            if tok.id in s.stop_token_ids and req.generated > s.min_tokens:
                reason = "stop"
            elif req.generated >= s.max_tokens or len(req.prompt) + req.generated >= self.max_seq_len:
                reason = "length"
            if reason is not None:
                break
        with self._cv:
            self._counts.generated += len(out)
        if reason is not None:
            self._finish(req, EngineOutput(out, finish_reason=reason))
        elif self._emit(req, EngineOutput(out)):
            self._release(req)

    def _emit(self, req: EngineRequest, out: EngineOutput) -> bool:
        """Call the request's callback; True means the request is over (asked to stop, cancelled or failed)."""
        if req.cancelled:
            self._release(req)
            return True
        if req.cached_tokens is not None:  # its first output says how much of its prompt was reused
            out.cached_tokens, req.cached_tokens = req.cached_tokens, None
        try:
            stop = bool(req.on_output(out))
        except Exception:
            log.exception("request %d: output callback failed; cancelling it", req.id)
            stop = True
        if stop:
            self._release(req)
        return stop

    def _finish(self, req: EngineRequest, out: EngineOutput) -> None:
        # the slot is free before the client hears it is done (a /metrics scrape right after shows it)
        cancelled = req.cancelled
        self._release(req)
        if not cancelled:
            self._emit(req, out)

    def _release(self, req: EngineRequest) -> None:
        req.done = True
        if req.slot is not None:
            self.model.free(req.slot)
            self._slots[req.slot] = None
            req.slot = None

    def _fail(self, req: EngineRequest, error: BaseException) -> None:
        if not req.done and not req.cancelled:
            try:
                req.on_output(EngineOutput([], finish_reason="error", error=error))
            except Exception:
                log.exception("request %d: output callback failed", req.id)
        try:
            self._release(req)
        except Exception:  # the slot model may be the thing that broke
            log.exception("request %d: could not free its slot", req.id)
            if req.slot is not None:
                self._slots[req.slot] = None
                req.slot = None


def OPTSlots(cfg, params, num_slots: int = 8, max_seq_len: Optional[int] = None, prefix_blocks: int = 0):
    """The slot model over a whole model's params in this process (`runner.load.local_slots`; `prefix_blocks`:
    its prefix cache's, none by default)."""
    from opt_serving.runner.load import local_slots
    return local_slots(cfg, params, num_slots, max_seq_len, prefix_blocks=prefix_blocks)

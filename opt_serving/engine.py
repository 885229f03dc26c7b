"""Continuous batching over a fixed number of decode slots (JetStream's shape).

  * a slot model (`runner.slots.Slots` for every plan: one device, a tensor-parallel mesh or pipeline stages;
    `FakeSlots` in `testing/fake_engine.py`) owns the KV cache and the jitted steps: `prefill(tokens,
    settings) -> Prefix`, `insert(prefix, slot)`, `step() -> StepResult` (one decode over every slot, or, for a
    pipeline, over one micro-batch group of them: `StepResult.rows`), `free(slot)`. Sampling settings are
    per-slot arrays, so requests with different settings share a step.
  * `Engine`, this module, the scheduler: a bounded queue and a background thread that admits queued requests into free
    slots (prefilled together when the slot model has `prefill_batch`), steps, and hands each request its
    tokens through a callback (called on the engine thread; the
    generator forwards them to asyncio with `loop.call_soon_threadsafe`). EOS, max_tokens, the context limit,
    a callback asking to stop (stop strings) and `cancel()` (client disconnects) free the slot before the next
    step.
No HTTP and no Ray here.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, Optional, Protocol, Sequence

from opt_serving.runner.types import (MAX_BAD_WORD_LEN, MAX_BAD_WORDS, MAX_TOP_LOGPROBS, EngineOutput, Prefix,
                                      SlotSettings, StepResult, TokenInfo)

# the engine's vocabulary, re-exported for the generator and the service
__all__ = ["Engine", "EngineClosed", "EngineOutput", "EngineRequest", "EngineStats", "MAX_BAD_WORDS",
           "MAX_BAD_WORD_LEN", "MAX_TOP_LOGPROBS", "OPTSlots", "Prefix", "QueueFull", "SlotModel", "SlotSettings",
           "StepResult", "TokenInfo", "load_engine"]

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The engine's request queue is at capacity (the service answers 429 with Retry-After)."""


class EngineClosed(RuntimeError):
    """The engine was closed (shutdown) before or while serving the request."""


class SlotModel(Protocol):
    num_slots: int
    max_seq_len: int
    vocab_size: int

    def warmup(self) -> None: ...
    def prefill(self, tokens: Sequence[int], settings: SlotSettings) -> Prefix: ...
    # optional: `prefill_batch(prompts, settings) -> list[Prefix]`, several requests at once (see Engine._prefill)
    def insert(self, prefix: Prefix, slot: int) -> None: ...
    def step(self) -> StepResult: ...
    def free(self, slot: int) -> None: ...
    # optional: `discard(prefix)`, a prefix that will never be inserted (its rows are let go);
    # `check_health()`, raising when the model cannot serve (e.g. a dead pipeline stage)


# ---------------------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------------------

Callback = Callable[[EngineOutput], Optional[bool]]


class EngineRequest:
    """A handle on a submitted request; `Engine.cancel(handle)` stops it."""
    _ids = itertools.count()

    def __init__(self, prompt: list[int], settings: SlotSettings, on_output: Callback):
        self.id = next(self._ids)
        self.prompt = prompt
        self.settings = settings
        self.on_output = on_output
        self.slot: Optional[int] = None
        self.generated = 0
        self.cancelled = False
        self.done = False
        self.submitted_at = time.monotonic()


@dataclasses.dataclass
class EngineStats:
    queue_length: int
    running: int              # occupied slots
    num_slots: int
    steps: int                # decode steps run
    step_tokens: int          # tokens produced by decode steps (sum of active slots per step)
    prefills: int
    generated_tokens: int     # all generated tokens, prefill's first tokens included
    prompt_tokens: int
    last_step_batch: int      # active slots in the latest step
    active_per_step: dict[int, int]  # {active slots: number of steps with that many}

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0


# longest a busy engine may go without finishing a prefill or a decode step before check_health() calls it stuck
# (a step of OPT-175B is well under a second; compiling an unseen shape takes tens of seconds on a CPU)
HEALTH_STALL_S = 120.0


class Engine:
    """Scheduler thread over a slot model: bounded queue, admission into free slots, one step for all."""

    def __init__(self, model: SlotModel, max_queue: int = 256, start: bool = True,
                 health_stall_s: float = HEALTH_STALL_S):
        self.model = model
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
        self._steps = self._step_tokens = self._prefills = self._generated = self._prompt_tokens = 0
        self._last_batch = 0
        self._active_hist: collections.Counter[int] = collections.Counter()
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
        return getattr(self.model, "max_top_logprobs", MAX_TOP_LOGPROBS)

    def warmup(self) -> None:
        """Compile every prefill bucket and the decode step now, not at the first request."""
        self.model.warmup()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_guarded, name="opt-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt: Sequence[int], settings: SlotSettings, on_output: Callback) -> EngineRequest:
        """Queue a request. `on_output` runs on the engine thread for the prompt scores (if asked), every
        new token and the finish; it returns True to stop the request (its slot is freed at once).
        Raises QueueFull, EngineClosed, or ValueError for a prompt that cannot fit."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        need = len(prompt) + max(settings.max_tokens, 0)
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({settings.max_tokens}) = {need} "
                             f"exceeds the maximum context length of {self.max_seq_len} tokens")
        words = settings.bad_words_ids
        if len(words) > MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_BAD_WORD_LEN for w in words):
            raise ValueError(f"bad_words_ids: at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_LEN} tokens each")
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
            return EngineStats(
                queue_length=len(self._queue), running=sum(r is not None for r in self._slots),
                num_slots=self.num_slots, steps=self._steps, step_tokens=self._step_tokens,
                prefills=self._prefills, generated_tokens=self._generated,
                prompt_tokens=self._prompt_tokens, last_step_batch=self._last_batch,
                active_per_step=dict(self._active_hist))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread; queued and running requests finish with EngineClosed."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_pending(EngineClosed("the engine shut down before the request finished"))
        close = getattr(self.model, "close", None)
        if close is not None:  # e.g. a pipeline's stage actors and placement group
            close()

    def check_health(self) -> None:
        """Raise RuntimeError saying why this engine cannot serve: its thread is dead (or was never started),
        or work is queued or running and no prefill or decode step has finished for `health_stall_s`; then
        the slot model's own `check_health()`, where it has one (a pipeline's stages). Ray Serve's replica
        health check calls this (through Generator.check_health) and replaces a replica that fails it."""
        with self._cv:
            died, busy, waited = self._died, self._busy(), self._clock() - self._progress_at
            queued, running = len(self._queue), sum(r is not None for r in self._slots)
        if died is not None:
            raise RuntimeError(f"engine thread died: {died!r}")
        if self._thread is None or not self._thread.is_alive():
            state = "was never started" if self._thread is None else "is not running"
            raise RuntimeError(f"engine thread {state}" + (" (engine closed)" if self._closing else ""))
        if busy and waited > self.health_stall_s:
            raise RuntimeError(f"engine stalled: no prefill or decode step finished in {waited:.0f} s "
                               f"(limit {self.health_stall_s:g} s) with {queued} queued and {running} running")
        model_check = getattr(self.model, "check_health", None)
        if model_check is not None:
            model_check()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- engine thread ----
    def _busy(self) -> bool:  # (under self._cv)
        return bool(self._queue) or any(r is not None for r in self._slots)

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
            self._queue.clear()
        for req in pending:
            self._fail(req, error)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closing or self._queue or any(self._slots)):
                    self._cv.wait()
                if self._closing:
                    return
            # cancelled requests leave their slots before anything else runs
            for req in self._slots:
                if req is not None and req.cancelled:
                    self._release(req)
            with self._cv:
                admit = []
                free = self._slots.count(None)
                while self._queue and len(admit) < free:
                    req = self._queue.popleft()
                    if not req.cancelled:
                        admit.append(req)
            for req, prefix in zip(admit, self._prefill(admit)):
                try:
                    if isinstance(prefix, BaseException):
                        raise prefix
                    self._admit(req, self._slots.index(None), prefix)
                except Exception as e:  # this request fails, the others carry on
                    log.exception("request %d: prefill failed", req.id)
                    self._fail(req, e)
            if admit:
                self._progressed()
            if any(self._slots):
                try:
                    self._step()
                except Exception as e:  # a failed step fails the requests in it, the engine keeps serving
                    log.exception("engine step failed")
                    for req in [r for r in self._slots if r is not None]:
                        self._fail(req, e)
                self._progressed()

    def _prefill(self, reqs: list[EngineRequest]) -> list:
        """A Prefix (or the exception that stopped it) per request: together where the slot model has
        `prefill_batch`, and one by one if that fails, so only the request that caused it fails."""
        batched = getattr(self.model, "prefill_batch", None)
        if batched is not None and len(reqs) > 1:
            try:
                return batched([r.prompt for r in reqs], [r.settings for r in reqs])
            except Exception:
                log.exception("prefilling %d requests together failed; prefilling them one by one", len(reqs))
        out = []
        for req in reqs:
            try:
                out.append(self.model.prefill(req.prompt, req.settings))
            except Exception as e:
                out.append(e)
        return out

    def _admit(self, req: EngineRequest, slot: int, prefix: Prefix) -> None:
        with self._cv:
            self._prefills += 1
            self._prompt_tokens += len(req.prompt)
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
        self._deliver(req, prefix.first)

    def _discard(self, prefix: Prefix) -> None:
        discard = getattr(self.model, "discard", None)
        if discard is not None:
            discard(prefix)

    def _step(self) -> None:
        result = self.model.step()
        # a pipelined model steps one micro-batch group at a time: only its slots have new tokens
        active = [r for r in self._slots if r is not None and (result.rows is None or result.rows[r.slot])]
        with self._cv:
            self._steps += 1
            self._step_tokens += len(active)
            self._last_batch = len(active)
            self._active_hist[len(active)] += 1
        for req in active:
            self._deliver(req, result.token(req.slot))

    def _deliver(self, req: EngineRequest, tok: TokenInfo) -> None:
        """Hand one new token to the request and free its slot if it finished."""
        if req.cancelled:  # cancelled during the step: the token is dropped
            self._release(req)
            return
        req.generated += 1
        with self._cv:
            self._generated += 1
        s = req.settings
        if not s.logprob:  # not asked: the same answer whether or not this step made the logits
            tok = dataclasses.replace(tok, logprob=None)  # (top alternatives follow top_logprobs)
        reason = None
        if tok.id in s.stop_token_ids and req.generated > s.min_tokens:
            reason = "stop"
        elif req.generated >= s.max_tokens or len(req.prompt) + req.generated >= self.max_seq_len:
            reason = "length"
        out = EngineOutput([tok], finish_reason=reason)
        if reason is not None:
            self._finish(req, out)
        elif self._emit(req, out):
            self._release(req)

    def _emit(self, req: EngineRequest, out: EngineOutput) -> bool:
        """Call the request's callback; True means the request is over (asked to stop, cancelled or failed)."""
        if req.cancelled:
            self._release(req)
            return True
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


def OPTSlots(cfg, params, num_slots: int = 8, max_seq_len: Optional[int] = None):
    """The slot model over a whole model's params in this process (`runner.load.local_slots`)."""
    from opt_serving.runner.load import local_slots
    return local_slots(cfg, params, num_slots, max_seq_len)


def load_engine(model_name: str, path=None, dtype: str = "float32", num_slots: int = 16,
                max_seq_len: Optional[int] = None, max_queue: int = 256, warmup: bool = True,
                **plan) -> Engine:
    """An engine over `runner.load.load_slots(model_name, path, ...)` (every plan: one device, a
    tensor-parallel mesh, pipeline stages on a Ray cluster; `plan` takes dummy, seed, tensor_parallel,
    pipeline_parallel, device_memory, micro_batches), compiled before it returns when `warmup`."""
    from opt_serving.runner.load import load_slots
    slots = load_slots(model_name, path, dtype=dtype, num_slots=num_slots, max_seq_len=max_seq_len, **plan)
    try:
        if warmup:
            slots.warmup()
    except BaseException:
        slots.close()
        raise
    return Engine(slots, max_queue=max_queue)

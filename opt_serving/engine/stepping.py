"""The engine thread's decode calls (Engine inherits `DecodeCalls`): each iteration one step of every occupied
slot, or several in one call while nobody waits for a slot; with `ahead`, in that steady state the next call is
sent before this one's tokens are read (the slot model's send_many / take_many), so the device runs the next call
while the host hands out this one's tokens; anything but freeing slots (an admission, a chunk of a long prompt)
first takes and hands out the calls in flight (`_settle`).
"""
from __future__ import annotations

import time

from opt_serving.runner.types import StepResult


class DecodeCalls:
    """Engine's decode calls (it holds the slot model, the queue, the slots and the counters they use)."""

    def _step(self, joining: bool = False) -> None:
        with self._cv:  # several steps in one call while no queued request could take a slot meanwhile
            hurry = bool(self._queue and None in self._slots) or self._chunked.held > 0
        t = time.perf_counter()
        if self._last_step_at is not None:  # a running stream's tokens come this far apart
            self._counts.decode_gap.observe(t - self._last_step_at)
        many = (self.decode_steps > 1 and self.model.many_steps and not hurry
                and 0 < self.decode_steps * self._step_s <= self.decode_call_s)  # (the first step alone)
        if many and self.ahead and self.model.sends_ahead and not joining:
            results = self._call_ahead()
        else:
            self._settle()
            results = self.model.step_many(self.decode_steps) if many else [self.model.step()]
        end = time.perf_counter()
        if not joining:  # (a step carrying prompts takes longer: a wave of them would hold the next calls to one step)
            took = (end - t) / len(results)
            self._step_s = took if not self._step_s else 0.8 * self._step_s + 0.2 * took
        self._hand_out(results, end - t)
        self._last_step_at = t if any(self._slots) else None

    def _call_ahead(self) -> list[StepResult]:
        """The oldest call in flight's results, with the next call sent behind it before they are read (the
        first of a run of calls is sent here too; where none can be sent, step_many's call read at once)."""
        if not self.model.calls_in_flight and self.model.send_many(self.decode_steps) is None:
            return self.model.step_many(self.decode_steps)
        self.model.send_many(self.decode_steps)  # (None: this one is taken alone, the next run starts afresh)
        return self.model.take_many()

    def _settle(self) -> None:
        """Hand out the tokens of every call in flight: before anything but freeing slots changes them."""
        while self.model.calls_in_flight:
            t = time.perf_counter()
            self._hand_out(self.model.take_many(), time.perf_counter() - t)

    def _hand_out(self, results: list[StepResult], seconds: float) -> None:
        """A call's tokens to the requests still in its slots (one output each)."""
        # a pipelined model steps one micro-batch group at a time: only its slots have new tokens
        rows = results[0].rows
        active = [r for r in self._slots if r is not None and (rows is None or rows[r.slot])]
        with self._cv:
            self._counts.step_call(len(results), active, seconds, results)
        for req in active:
            logprob = req.settings.logprob
            self._deliver(req, [tok for result in results for tok in result.tokens_of(req.slot, logprob)])

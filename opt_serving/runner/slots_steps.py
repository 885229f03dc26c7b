"""Several decode steps in one call of the stage (Slots inherits `ManySteps`), where one stage holds the whole model
and the slots are one group: `step_many` takes a call and reads its tokens; `send_many` / `take_many` take it in two
halves, so the engine can send the next call before it reads this one's tokens (the next call's rows counted as
this one left them, fed its newest tokens on the device): the device never waits for the host between calls.

Between a call sent and its tokens taken, only `free` may change the slots (a request that finished in an earlier
call, or was cancelled); its tokens from the calls in flight are dropped (the slot's generation moved on). Anything
else (a step of another kind, an insert, a join) first needs every call taken.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional

import numpy as np

from opt_serving.runner.packed import running_rows
from opt_serving.runner.types import DecodeStep, StepResult


@dataclasses.dataclass
class SentCall:
    """A call of several steps sent and not yet taken: its stage ticket, steps, and the slots it steps with their
    generations then."""
    ticket: int
    n: int
    sent: np.ndarray         # int [m] the slots stepped
    generations: np.ndarray  # int [m] their generations when sent
    at: float                # when it was sent (perf_counter)


class ManySteps:
    """Slots' several steps a call (it holds the table, the stages, the joins, speculation and the adapters)."""

    def _init_many(self) -> None:
        self._sent_calls: collections.deque[SentCall] = collections.deque()

    @property
    def calls_in_flight(self) -> int:
        return len(self._sent_calls)

    def _check_settled(self, what: str) -> None:
        if self._sent_calls:
            raise RuntimeError(f"{what} with {len(self._sent_calls)} call(s) of several steps in flight: take them "
                               "first (take_many)")

    def step_many(self, n: int) -> list[StepResult]:
        """Up to `n` decode steps of every slot in one call of the stage, each fed the tokens of the one
        before: the host's work of a step (dispatch, reading the tokens back) is paid once for them. Only
        where one stage holds the whole model and the slots are one group, with no prompt waiting to join,
        and room in the context for all n; otherwise one step. A group following a grammar still takes its
        n steps in the one call (the stage takes them one at a time, each with its masks). -> one StepResult
        a step."""
        self._check_settled("step_many")
        planned = self._plan_many(n, self.table.lengths)
        if planned is None:
            return [self.step()]
        step, on, t = planned
        outs = self.stages.get(self.stages.call(0, "decode_steps", self.table.next.copy(), step))
        return self._many_results(outs, on, n, t, int(on.sum()))

    def send_many(self, n: int) -> Optional[SentCall]:
        """Send `n` steps of every occupied slot in one call without waiting for their tokens, after the calls in
        flight (each slot they step counted as that many tokens longer, fed their newest tokens on the device)
        -> the call, for `take_many`; None where `step_many` would take one step, or where the group follows a
        grammar (nothing is sent: its masks need each token on the host before the next step)."""
        lengths = self.table.lengths.copy()
        for call in self._sent_calls:  # (a slot freed since is not stepped again)
            lengths[self.table.current(call.sent, call.generations)] += call.n
        planned = self._plan_many(n, lengths)
        if planned is None:
            return None
        step, on, t = planned
        x = None if self._sent_calls else self.table.next.copy()  # (None: where the last call left them)
        ticket = self.stages.get(self.stages.call(0, "send_steps", x, step))
        if ticket is None:
            return None
        sent = np.flatnonzero(on)
        call = SentCall(ticket, n, sent, self.table.generation[sent].copy(), t)
        self._sent_calls.append(call)
        return call

    def _plan_many(self, n: int, lengths: np.ndarray):
        """The DecodeStep of `n` steps from the slots' `lengths` (counting the calls in flight), the slots it
        steps and when -> (step, on, t); None where only one step can be taken."""
        # (n steps write entries up to the longest slot's length + n - 2; one count of steps, one compile)
        if (n <= 1 or self.stages.n > 1 or self.groups > 1 or self.joins.waiting(0)
                or lengths.max() + n - 1 > self.max_seq_len):
            return None
        if self.spec is not None and (
                self._sent_calls or self.spec.plan_ahead(lengths, self.joins.sizes[-1], self.max_seq_len)):
            return None  # (rows drafting take one step: the plan just made is that step's)
        t = time.perf_counter()
        slots, on = self.table.group_slots(0), lengths > 0
        positions = np.where(on, lengths - 1, -1).astype(np.int32)
        want_scores, want_top = self.table.wants(on)
        window = self._window_of(int(lengths.max()) + n - 1)
        step = DecodeStep(0, positions, window, int(lengths.max()), want_scores, want_top,
                          adapters=self.adapters.rows(slots), steps=n, rows=running_rows(on))
        return step, on, t

    def _many_results(self, outs, on: np.ndarray, n: int, t: float, computed: int) -> list[StepResult]:
        """A call's tokens and scores [n, rows, ...] for the slots marked in `on` (of the `computed` rows the call
        stepped, sent at `t`) -> one StepResult a step."""
        if self.spec is not None:
            self.spec.observe_call(next(b for b in self.joins.sizes if b >= computed), False, n, t,
                                   time.perf_counter())
        return [self._result(self.table.group_slots(0), on, *(a[i] for a in outs)) for i in range(n)]

    def take_many(self) -> list[StepResult]:
        """The oldest call in flight's tokens -> one StepResult a step (a slot freed since takes none)."""
        call = self._sent_calls.popleft()
        outs = self.stages.get(self.stages.call(0, "take_steps", call.ticket))
        rows = np.zeros(self.num_slots, np.bool_)
        rows[self.table.current(call.sent, call.generations)] = True
        return self._many_results(outs, rows, call.n, call.at, len(call.sent))

    def abandon_many(self) -> None:
        """Forget the calls in flight (a step failed; their requests fail with it): read and dropped where they can
        be, so the stage keeps none of their outputs."""
        calls, self._sent_calls = list(self._sent_calls), collections.deque()
        for call in calls:
            try:
                self.stages.get(self.stages.call(0, "take_steps", call.ticket))
            except Exception:  # noqa: BLE001 - the stage may be what failed; the requests fail either way
                pass

"""A stage's decode steps taken several in one call (StageSlots inherits `StepsInOneCall`), on a stage that is the
whole model: sent (`send_steps`) and read back (`take_steps`) apart, so the host can send a group's next call,
fed this one's newest tokens where they are, on the device, before it reads this one's tokens (Slots.send_many):
on a GPU the card then never waits for the host's turn between calls. `decode_steps` is the two in a row.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import jax
import numpy as np

from opt_serving.runner.packed import rows_in, rows_out
from opt_serving.runner.types import DecodeStep


class StepsInOneCall:
    """StageSlots' steps in one call (it holds the programs, caches, sampler and LoRA slots they use)."""

    def _init_steps(self) -> None:
        self._sent: dict[int, tuple] = {}  # ticket -> (the call's outputs on the device, its rows, its group's rows)
        self._tickets = itertools.count()
        self._newest: dict[int, jax.Array] = {}  # group -> its newest tokens [B] on the device, from its last call

    def decode_steps(self, x, step: DecodeStep):
        """`step.steps` decode steps of a group in one call: as `decode` that many times, each given the tokens of
        the one before, computing only `step.rows` where set. -> each step's tokens and scores, [n, rows, ...].
        While a request of the group follows a grammar, each step's masks need the token before: the steps are
        then taken one at a time here (the engine still gets them in one call)."""
        if self.sampler.constrained(step.group):
            outs, positions = [], step.positions
            for i in range(step.steps):
                outs.append(self.decode(x, dataclasses.replace(
                    step, positions=np.where(positions >= 0, positions + i, -1), read_len=step.read_len + i,
                    steps=1)))
                x = outs[-1][0]
            return tuple(np.stack(a) for a in zip(*outs))
        return self.take_steps(self.send_steps(x, step))

    def send_steps(self, x, step: DecodeStep) -> Optional[int]:
        """Send the call of `decode_steps` without waiting for it -> a ticket for `take_steps`; None where its
        steps must go one at a time (a request of the group follows a grammar). `x` the group's newest tokens [B],
        or None: the tokens the group's last call ended with, where that call left them (on the device)."""
        s, group, positions = self.sampler, step.group, step.positions
        if s.constrained(group):
            return None
        x = self._newest[group] if x is None else x
        self._fit_cache(group, step.window, shrink=not self.backend.attention)
        rows, adapters, b = step.rows, step.adapters, len(positions)
        if rows is not None:  # only these rows are computed (packed.py)
            positions, adapters = rows_in(rows, positions, adapters)
        self.caches[group], s.state[group], out, self._newest[group] = self._steps(
            self.params, self.caches[group], x, positions, np.int32(step.read_len), s.state[group],
            s.settings[group], s.active[group], np.bool_(step.want_scores), np.bool_(step.want_top), step.steps,
            self._prefix(group), rows, self.lora.batch(adapters, len(positions), self.ragged))
        ticket = next(self._tickets)
        self._sent[ticket] = (out, rows, b)
        return ticket

    def take_steps(self, ticket: int):
        """A sent call's tokens and scores, [n, rows, ...] (numpy), once its program ran."""
        out, rows, b = self._sent.pop(ticket)
        return tuple(a if rows is None else rows_out(a, rows, b) for a in jax.device_get(out))  # (one wait for all)

"""The engine's running totals, which `Engine.stats()` hands out as `EngineStats`: requests prefilled and joined,
tokens generated and cached, steps and the slots active in them, where the engine thread's time goes, and the
durations a request waits. Plain numbers with no lock of their own: the engine thread updates them, holding the
engine's lock where `stats()` could read them half-updated.
"""
from __future__ import annotations

import collections
from typing import Optional

from opt_serving.engine.types import Durations, EngineRequest, EngineStats


class EngineCounters:
    def __init__(self):
        self.steps = self.step_calls = self.step_tokens = 0
        self.prefills = self.joined = self.generated = self.prompt_tokens = self.cached_tokens = 0
        self.last_batch = 0
        self.active_hist: collections.Counter[int] = collections.Counter()
        # where the thread's time goes
        self.prefill_s = self.decode_s = 0.0
        self.prefill_passes = self.computed = self.joined_tokens = self.decode_kv = 0
        self.queue_wait, self.prompt_time, self.decode_gap = Durations(), Durations(), Durations()
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0

    def passes(self, seconds: float, passes: int, computed: int) -> None:
        """Prefill passes (batched whole prompts, or chunks) that took `seconds` and computed `computed` tokens."""
        self.prefill_s += seconds
        self.prefill_passes += passes
        self.computed += computed

    def prefill(self, req: EngineRequest, joined: bool = False, cached: int = 0) -> None:
        """A request's prompt prefilled (or `joined` to a decode step), `cached` of its tokens from the prefix cache."""
        self.prefills += 1
        self.joined += joined
        self.prompt_tokens += len(req.prompt)
        self.cached_tokens += cached

    def step_call(self, steps: int, active: list[EngineRequest], seconds: float, results=()) -> None:
        """A call of the slot model that took `steps` decode steps over the `active` requests in `seconds`, giving
        `results` (runner.types.StepResult: what its rows drafted and kept)."""
        self.steps += steps
        self.step_calls += 1
        self.step_tokens += len(active) * steps
        for r in results:
            self.spec_drafts += r.drafts
            self.spec_draft_tokens += r.drafted
            self.spec_accepted += r.accepted
        self.last_batch = len(active)
        self.active_hist[len(active)] += steps
        self.decode_s += seconds
        # entries a row attends over: its prompt and tokens so far, one more each further step of the call
        self.decode_kv += sum(steps * (len(r.prompt) + r.generated) + steps * (steps - 1) // 2 for r in active)

    def stats(self, queue_length: int, running: int, num_slots: int, costs: Optional[dict]) -> EngineStats:
        return EngineStats(
            queue_length=queue_length, running=running,
            num_slots=num_slots, steps=self.steps, step_calls=self.step_calls,
            step_tokens=self.step_tokens,
            prefills=self.prefills, joined=self.joined, generated_tokens=self.generated,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            last_step_batch=self.last_batch,
            active_per_step=dict(self.active_hist),
            prefill_s=self.prefill_s, prefill_passes=self.prefill_passes, computed_tokens=self.computed,
            joined_tokens=self.joined_tokens, decode_s=self.decode_s, decode_kv_entries=self.decode_kv,
            queue_wait=self.queue_wait.copy(), prompt_time=self.prompt_time.copy(),
            decode_gap=self.decode_gap.copy(), spec_drafts=self.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens, spec_accepted_tokens=self.spec_accepted, costs=costs)

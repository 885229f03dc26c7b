"""The engine's own vocabulary (engine.py re-exports it): its errors, the slot model it drives, a submitted
request's handle and the engine's counters."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional, Protocol, Sequence

from opt_serving.errors import Overloaded, Unavailable
from opt_serving.runner.types import EngineOutput, Prefix, SlotSettings, StepResult


class QueueFull(Overloaded):
    """The engine's request queue is at capacity (the service answers 429 with Retry-After)."""
    code = "queue_full"


class EngineClosed(Unavailable):
    """The engine was closed (shutdown), or its thread died, before or while serving the request."""
    code = "shutting_down"


class SlotModel(Protocol):
    num_slots: int
    max_seq_len: int
    vocab_size: int

    def warmup(self) -> None: ...
    def prefill(self, tokens: Sequence[int], settings: SlotSettings) -> Prefix: ...
    # optional: `prefill_batch(prompts, settings) -> list[Prefix]`, several requests at once; `open_prefill`,
    # `prefill_chunk`, `discard_partial`: a prompt a chunk at a time (admission.py, runner.slots.Slots);
    # `prompt_cost(tokens, settings) -> int`, the prompt tokens a prefill would compute now (a prefix cache's
    # slot model computes only those past its cached prefix; Prefix.cached says how many it reused)
    def insert(self, prefix: Prefix, slot: int) -> None: ...
    def step(self) -> StepResult: ...
    def free(self, slot: int) -> None: ...
    # optional: `step_many(n) -> list[StepResult]`, n steps in one call (each fed the last one's tokens;
    # fewer where the model cannot: runner.slots.Slots); `discard(prefix)`, a prefix that will never be
    # inserted (its rows are let go);
    # `check_health()`, raising when the model cannot serve (e.g. a dead pipeline stage)


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
        self.cached_tokens: Optional[int] = None  # prompt tokens its prefill reused, until its first output tells it
        self.cancelled = False
        self.done = False


@dataclasses.dataclass
class EngineStats:
    queue_length: int
    running: int              # occupied slots (and the one kept for a prompt being prefilled in chunks)
    num_slots: int
    steps: int                # decode steps run
    step_calls: int           # calls of the slot model that ran them (several steps a call: engine.Engine)
    step_tokens: int          # tokens produced by decode steps (sum of active slots per step)
    prefills: int
    joined: int               # of those, prompts prefilled inside a decode step (its first token is a step token)
    generated_tokens: int     # all generated tokens, prefill's first tokens included
    prompt_tokens: int
    cached_tokens: int        # of those, tokens whose KV the prefix cache gave (not computed)
    last_step_batch: int      # active slots in the latest step
    active_per_step: dict[int, int]  # {active slots: number of steps with that many}

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0

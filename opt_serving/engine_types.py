"""The engine's own vocabulary (engine.py re-exports it): its errors, the slot model it drives, a submitted
request's handle and the engine's counters."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional, Sequence

from opt_serving.errors import Overloaded, Unavailable
from opt_serving.runner.types import EngineOutput, SlotModel, SlotSettings

__all__ = ["Callback", "EngineClosed", "EngineRequest", "EngineStats", "QueueFull", "SlotModel"]


class QueueFull(Overloaded):
    """The engine's request queue is at capacity (the service answers 429 with Retry-After)."""
    code = "queue_full"


class EngineClosed(Unavailable):
    """The engine was closed (shutdown), or its thread died, before or while serving the request."""
    code = "shutting_down"


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

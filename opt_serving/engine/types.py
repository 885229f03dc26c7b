"""The engine's own vocabulary (scheduler.py re-exports it): its errors, the slot model it drives, a submitted
request's handle and the engine's counters, and the slot model's invariants a request must meet (check_prompt,
check_bad_words: the engine checks them on every submit; request.py, the text level's checks, re-exports them)."""
from __future__ import annotations

import dataclasses
import itertools
import numbers
from typing import Any, Callable, Optional, Sequence

from opt_serving.errors import ContextLengthExceeded, InvalidRequest, Overloaded, Unavailable
from opt_serving.runner.types import MAX_BAD_WORD_LEN, MAX_BAD_WORDS, EngineOutput, SlotModel, SlotSettings


def check_prompt(ids: Sequence[int], max_tokens: int, vocab_size: int, max_seq_len: int) -> None:
    """A tokenised prompt fits the vocabulary and, with max_tokens, the context. Cheap (len, min, max):
    the engine runs it on every request, as the slot model's invariants."""
    if len(ids) == 0:
        raise InvalidRequest("prompt is empty", param="prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")
    total = len(ids) + max(max_tokens, 0)
    if total > max_seq_len:
        raise ContextLengthExceeded(f"this model's maximum context length is {max_seq_len} tokens, but the "
                                    f"prompt has {len(ids)} tokens and max_tokens is {max_tokens} "
                                    f"({total} in total)")


def check_bad_words(words: Any) -> None:
    """bad_words_ids fit the slot model's fixed-shape arrays."""
    if not (isinstance(words, (list, tuple)) and len(words) <= MAX_BAD_WORDS
            and all(isinstance(w, (list, tuple)) and 0 < len(w) <= MAX_BAD_WORD_LEN
                    and all(_token_id(t) for t in w) for w in words)):
        raise InvalidRequest(f"bad_words_ids takes at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_LEN} "
                             f"token ids each, got {words!r:.80}", param="bad_words_ids")


def _token_id(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0


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

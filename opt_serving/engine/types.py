"""The engine's own vocabulary (scheduler.py re-exports it): its errors, the slot model it drives, a submitted
request's handle and the engine's counters, and the slot model's invariants a request must meet (check_prompt,
check_bad_words: the engine checks them on every submit; request.py, the text level's checks, re-exports them)."""
from __future__ import annotations

import dataclasses
import itertools
import numbers
from typing import Any, Callable, Optional, Sequence

from opt_serving.errors import ContextLengthExceeded, InvalidRequest, Overloaded, Unavailable
from opt_serving.runner.types import (MAX_BAD_WORD_LEN, MAX_BAD_WORDS, EngineOutput, SlotModel, SlotSettings,
                                      acceptance_length)


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
        self.submitted = 0.0   # the engine's clock when it was queued
        self.started = False   # it took a slot: joined the decode steps, or its prefill began
        self.started_at = 0.0  # (the perf_counter then)
        self.joined = False    # its prompt joined decode steps (runner: SlotModel.join)


# bounds (seconds) of the engine's duration histograms: a request's wait for a slot, its prompt's time to its first
# token, and the time between two decode calls while streams run (prefill passes between them lengthen it)
DURATION_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclasses.dataclass
class Durations:
    """A histogram of durations over DURATION_BOUNDS (counts[i]: at most bounds[i]; the last: above them all)."""
    bounds: tuple = DURATION_BOUNDS
    counts: list = dataclasses.field(default_factory=lambda: [0] * (len(DURATION_BOUNDS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if seconds <= b), len(self.bounds))] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float:
        """The bound at or below which a fraction q of the durations fall (inf past the last bound)."""
        need, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            seen += c
            if c and seen >= need:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return 0.0

    def copy(self) -> "Durations":
        return Durations(self.bounds, list(self.counts), self.total)


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
    # where the engine thread's time goes (benchmark/peers/serve_vs_vllm.py prints these against the machine's bounds)
    prefill_s: float = 0.0        # seconds in prefill passes and chunks (prompts joining a step: in decode_s)
    prefill_passes: int = 0       # prefill calls of the slot model (a batched pass, or one chunk)
    computed_tokens: int = 0      # prompt tokens those passes computed (past each prompt's cached prefix)
    joined_tokens: int = 0        # prompt tokens computed inside decode steps (prompts that joined them)
    decode_s: float = 0.0         # seconds in decode calls
    decode_kv_entries: int = 0    # KV entries the decode steps attended over, summed over rows and steps
    queue_wait: Durations = dataclasses.field(default_factory=Durations)  # submit -> a slot (or its prefill) starts
    prompt_time: Durations = dataclasses.field(default_factory=Durations)  # that start -> its first token
    decode_gap: Durations = dataclasses.field(default_factory=Durations)  # from one decode call's start to the
    #                                                                     next's, rows running (prefills between)
    # speculative decoding (runner/ngram.py): rows that drafted in a step (summed over steps), tokens drafted,
    # drafts accepted; a drafting row's step gives 1 + its accepted drafts
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    costs: Optional[dict] = None  # the slot model's `costs` (bytes and FLOPs a token: runner.types.ModelCosts)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafting row's step gave on average (vLLM's: 1 + accepted / drafts; 0 before any draft)."""
        return acceptance_length(self.spec_accepted_tokens, self.spec_drafts)

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0

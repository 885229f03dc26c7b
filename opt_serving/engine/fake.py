"""`opt-serving serve --engine fake`: a fake slot model whose every output can be worked out by hand (the HTTP
side served without weights, for demos, clients' tests and load tests; text/fake.py gives it a byte-level
tokenizer and a Generator).

Same interface as `engine.OPTSlots`, driven by the real `engine.Engine` scheduler, so the service and the
generator can be tested fast and exactly. The "model" after token `t` ranks `t+1, t+2, ..., t+5` (mod vocab)
with log-probabilities `-ln2, -2 ln2, ..., -5 ln2`; every other token shares the remaining 1/32.
  * greedy (temperature 0): the next token is always `last + 1`;
  * sampling: the k-th generated token (k = 0, 1, ...) is `last + j` with `j = 1 + (seed + k) % 3`;
  * before `min_tokens`, a stop token is skipped (the next candidate, one further on, is taken instead);
  * beam search (`FakeBeamModel`) returns the greedy continuation: every step's best token costs -ln2 whatever
    came before, so no other sequence can score higher (penalties and bad words are ignored); with
    `num_return_sequences` k, the r-th sequence (r = 0..k-1) is the greedy one with its last token the (r+1)-th
    likeliest, `previous + 1 + r`;
  * `step_s`: each decode step takes that long (a model's step time: a request stays in flight for a known while).
The tokenizer maps byte `b` to id `4 + b` (ids 0-3 are <s>, <pad>, </s>, <unk>, and </s> is also BOS/EOS), so
with the prompt "a" (ids [2, 101]) greedy decoding continues "bcdef..."; after byte 255 (id 259) comes id 0.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Optional, Sequence

import numpy as np

from opt_serving.engine.scheduler import Engine, Prefix, SlotModel, SlotSettings, StepResult, TokenInfo

LN2 = math.log(2.0)
BYTE_OFFSET = 4
FAKE_VOCAB_SIZE = BYTE_OFFSET + 256
MAX_TOP_LOGPROBS = 5  # the fake model's top alternatives (the real engine computes engine.MAX_TOP_LOGPROBS)


def fake_logprob(last: int, token: int, vocab_size: int = FAKE_VOCAB_SIZE) -> float:
    """The fake model's log-probability of `token` right after `last`."""
    j = (token - last) % vocab_size
    if 1 <= j <= MAX_TOP_LOGPROBS:
        return -j * LN2
    return math.log(2.0 ** -MAX_TOP_LOGPROBS / (vocab_size - MAX_TOP_LOGPROBS))


def fake_rank(last: int, token: int, vocab_size: int = FAKE_VOCAB_SIZE) -> int:
    """`token`'s rank after `last` as vLLM counts it (the tokens at least as likely): j for the j-th likeliest, the
    whole vocabulary for the tokens sharing the rest."""
    j = (token - last) % vocab_size
    return j if 1 <= j <= MAX_TOP_LOGPROBS else vocab_size


def fake_top(last: int, vocab_size: int = FAKE_VOCAB_SIZE) -> list[tuple[int, float]]:
    return [((last + j) % vocab_size, -j * LN2) for j in range(1, MAX_TOP_LOGPROBS + 1)]


class FakeSlots(SlotModel):
    """A slot model (engine.SlotModel) with hand-checkable outputs (see the module docstring); of the
    abilities, only many_steps."""
    many_steps = True
    max_top_logprobs = MAX_TOP_LOGPROBS

    def __init__(self, num_slots: int = 4, max_seq_len: int = 64, vocab_size: int = FAKE_VOCAB_SIZE,
                 step_s: float = 0.0):
        self.num_slots, self.max_seq_len, self.vocab_size = num_slots, max_seq_len, vocab_size
        self.step_s = step_s
        self.last = np.zeros(num_slots, np.int64)
        self.count = np.zeros(num_slots, np.int64)        # tokens generated so far per slot
        self.settings: list[Optional[SlotSettings]] = [None] * num_slots
        self.warmed_up = False
        self.steps = 0
        self.inserted: list[int] = []   # slots in insertion order (tests look at slot reuse)
        self.inserted_settings: list[SlotSettings] = []  # and the requests' settings (what the layers above asked)

    def warmup(self, prefill_chunk: Optional[int] = None, decode_steps: int = 1, every_shape: bool = True) -> None:
        self.warmed_up = True

    def _next(self, last: int, k: int, s: SlotSettings) -> TokenInfo:
        j = 1 if s.temperature == 0 else 1 + (s.seed + k) % 3
        tok = (last + j) % self.vocab_size
        if k < s.min_tokens and tok in s.stop_token_ids:
            j += 1
            tok = (last + j) % self.vocab_size
        return TokenInfo(tok, fake_logprob(last, tok, self.vocab_size), fake_top(last, self.vocab_size))

    def prefill(self, tokens: Sequence[int], settings: SlotSettings) -> Prefix:
        tokens = list(tokens)
        prompt = None
        if settings.prompt_logprobs:
            prompt = [TokenInfo(tokens[0], None)] + [
                TokenInfo(t, fake_logprob(p, t, self.vocab_size), fake_top(p, self.vocab_size), fake_rank(p, t))
                for p, t in zip(tokens, tokens[1:])]
        first = self._next(tokens[-1], 0, settings)
        return Prefix(length=len(tokens), first=first, prompt=prompt, state=None, settings=settings)

    def insert(self, prefix: Prefix, slot: int) -> None:
        if self.settings[slot] is not None:
            raise RuntimeError(f"slot {slot} is still in use")
        self.last[slot] = prefix.first.id
        self.count[slot] = 1
        self.settings[slot] = prefix.settings
        self.inserted.append(slot)
        self.inserted_settings.append(prefix.settings)

    def step(self) -> StepResult:
        if self.step_s:
            time.sleep(self.step_s)  # (the engine thread's, standing for the device's work)
        n = self.num_slots
        out = StepResult(np.zeros(n, np.int32), np.zeros(n, np.float32),
                         np.zeros((n, MAX_TOP_LOGPROBS), np.int32), np.zeros((n, MAX_TOP_LOGPROBS), np.float32))
        for slot, s in enumerate(self.settings):
            if s is None:
                continue
            tok = self._next(int(self.last[slot]), int(self.count[slot]), s)
            out.tokens[slot], out.logprobs[slot] = tok.id, tok.logprob
            out.top_ids[slot] = [i for i, _ in tok.top]
            out.top_logprobs[slot] = [lp for _, lp in tok.top]
            self.last[slot] = tok.id
            self.count[slot] += 1
        self.steps += 1
        return out

    def step_many(self, n: int) -> list[StepResult]:
        """n steps (the engine's `decode_steps`): their tokens reach each request in one output."""
        return [self.step() for _ in range(n)]

    def free(self, slot: int) -> None:
        self.settings[slot] = None

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.settings)


class GatedSlots(FakeSlots):
    """Each decode step waits for a permit (`gate.release(n)`), so a test decides exactly when steps happen."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Semaphore(0)

    def step(self):
        self.gate.acquire()
        return super().step()


class SearchStopped(Exception):
    """FakeBeamModel's search stopped by its caller's should_stop."""


class FakeBeamModel:
    """What `Generator.beam()` calls on the fake engine: `generate(num_beams=...)` in HF's shape.
    `should_stop` is asked before every step, as the real search does (then SearchStopped; `stopped_at`
    records the step it stopped before). `hold(k)`: the next search to reach step k sets `reached` and waits
    there until `go` is set (a test's hold on a running search)."""

    def __init__(self, vocab_size: int = FAKE_VOCAB_SIZE):
        self.vocab_size = vocab_size
        self.calls = 0
        self.stopped_at: Optional[int] = None
        self.hold_at: Optional[int] = None
        self.reached, self.go = threading.Event(), threading.Event()

    def hold(self, step: int) -> "FakeBeamModel":
        self.hold_at = step
        self.reached.clear()
        self.go.clear()
        return self

    def generate(self, input_ids, num_beams: int = 1, max_new_tokens: int = 16, min_new_tokens=None,
                 eos_token_id: int = -1, should_stop=None, num_return_sequences: int = 1,
                 **_ignored) -> np.ndarray:
        self.calls += 1
        out = []
        for row in np.asarray(input_ids).tolist():
            best = self._greedy(list(row), max_new_tokens, min_new_tokens, eos_token_id, should_stop)
            for r in range(num_return_sequences):  # the r-th best: the last token the (r+1)-th likeliest
                seq = list(best)
                if r and len(seq) > len(row):
                    seq[-1] = (seq[-2] + 1 + r) % self.vocab_size
                out.append(seq)
        width = max(map(len, out))
        return np.asarray([r + [1] * (width - len(r)) for r in out], np.int64)  # padded with <pad>

    def _greedy(self, row: list, max_new_tokens: int, min_new_tokens, eos_token_id: int, should_stop) -> list:
        last = row[-1]
        for k in range(max_new_tokens):
            if should_stop is not None and should_stop():
                self.stopped_at = k
                raise SearchStopped(f"stopped before step {k}")
            if k == self.hold_at and not self.reached.is_set():
                self.reached.set()
                assert self.go.wait(60), "a held beam search was never let go"
            tok = (last + 1) % self.vocab_size
            if k < (min_new_tokens or 0) and tok == eos_token_id:
                tok = (last + 2) % self.vocab_size
            row.append(tok)
            last = tok
            if tok == eos_token_id:
                break
        return row


def fake_engine(num_slots: int = 4, max_seq_len: int = 64, max_queue: int = 16, start: bool = True,
                vocab_size: int = FAKE_VOCAB_SIZE, decode_steps: int = 1, step_s: float = 0.0) -> Engine:
    return Engine(FakeSlots(num_slots, max_seq_len, vocab_size, step_s), max_queue=max_queue, start=start,
                  decode_steps=decode_steps)

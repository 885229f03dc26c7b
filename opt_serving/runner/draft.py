"""Served speculative decoding with a draft model (vLLM's `--speculative-config '{"model": ...}'`), for the slots.

A small OPT sharing the target's vocabulary (OPT-125m beside OPT-6.7b; `generate(assistant_model=...)` in
notebooks) proposes each drafting row's next tokens; they ride in the row's next step and are checked there exactly
as prompt lookup's are (runner/ngram.py, whose rule this reuses: which rows draft, how many, when drafts pay). So a
row's tokens are the ones plain decoding gives, greedy or sampled, and the draft model only decides how many of
them one step of the target makes.

The drafts are the draft model's greedy choices, a point mass on each: the check keeps a draft with the
probability the target gives it, which is the rejection rule of speculative sampling for such a proposal, and a
seeded row's tokens stay the ones it draws without speculation.

Each drafting row has its own cache in the draft model (batch 1, opened the first time the row drafts, closed when
its request ends), holding the row's tokens it has been fed (`fed`). Before drafting, the row's history is compared
with what was fed: the entries up to where they part stay valid (a draft the target refused, and everything
after it, is written over: `steps.extend_step` keeps only the entries before the chunk it writes), the tokens
after that (a prompt, the target's own tokens since, the last draft kept) go in a chunk at a time, and the last
chunk's output is the first draft; each further draft is one more call of one token. The time of a call of one or
two tokens is measured (`t_call`; a prompt's chunks, once a row, are left out) and priced into the rule: a step
with n drafts costs the target's step plus n draft calls, so where drafting does not pay (many rows, drafts that
miss) rows stop drafting and only probe; the drafting is taken out of the step times measured.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from opt_serving.config import DRAFT_WIDTHS, SpeculativeConfig
from opt_serving.runner.ngram import EMA, NgramSpeculation

WIDTHS = DRAFT_WIDTHS  # chunks the draft's cache is fed in (each a compile of the draft model)


class ModelSpeculation(NgramSpeculation):
    """The prompt-lookup rule over a draft model's proposals: `draft` is a runner.generate.Generation on one
    device, its vocabulary the target's."""

    def __init__(self, config: SpeculativeConfig, num_slots: int, max_seq_len: int, sizes: Sequence[int], draft):
        super().__init__(config, num_slots, max_seq_len, sizes)
        self.draft = draft
        # a row's cache holds its tokens and its drafts but the last, written a chunk at a time past them
        self.cache_len = max_seq_len + config.draft_cache_extra
        self.keys: dict[int, object] = {}  # slot -> its cache in the draft model
        self.fed = np.zeros((num_slots, self.cache_len), np.int32)  # the tokens each row's cache holds ...
        self.done = np.zeros(num_slots, np.int64)  # ... its first done entries
        self.t_call: Optional[float] = None  # seconds a draft call takes (running)
        self._spans: list[tuple[float, float]] = []  # when the host drafted (kept until the step's time is read)

    # ---- each slot's cache ----
    def start(self, slot: int, tokens: Sequence[int], settings) -> None:
        super().start(slot, tokens, settings)
        self.done[slot] = 0

    def end(self, slot: int) -> None:
        super().end(slot)
        key = self.keys.pop(slot, None)
        if key is not None:
            self.draft._close([key])

    def close(self) -> None:
        for slot in list(self.keys):
            self.end(slot)

    def warm(self) -> None:
        """Compile the draft model's calls: each chunk width over a row's cache, as a new row's first call (a cache
        just made, not yet placed on the device: a program of its own) and as any later one; the widest also
        without the head."""
        tokens = np.full(WIDTHS[-1], self.draft.config.bos_token_id, np.int32)
        for w, head in [(w, True) for w in WIDTHS] + [(WIDTHS[-1], False)]:  # (a long prompt's chunks: no head)
            key = self.draft._open(1, self.cache_len)
            try:
                self._extend(key, tokens[:w], 0, head)
                self._extend(key, tokens[:w], w, head)
            finally:
                self.draft._close([key])

    def forget_times(self) -> None:
        super().forget_times()
        self.t_call, self._spans = None, []  # (warm-up's calls compiled)

    # ---- drafts ----
    def _candidates(self, slot: int, k: int) -> list:
        return [None] * k  # (any row may take k drafts: they are made once the step's rows are chosen)

    def _proposals(self, chosen: dict[int, int], offered: dict[int, list]) -> dict[int, list[int]]:
        t0 = time.perf_counter()
        out = {slot: self._draft(slot, n) for slot, n in chosen.items()}
        self._spans.append((t0, time.perf_counter()))
        return out

    def _draft_seconds(self, drafts: int) -> float:
        return drafts * (self.t_call or 0.0)

    def _drafting_within(self, t0: float, t1: float) -> float:
        spent = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self._spans)
        self._spans = [(a, b) for a, b in self._spans if b > t1]
        return spent

    def _draft(self, slot: int, n: int) -> list[int]:
        """n drafts after the slot's history: its cache brought up to the history's last token, then n - 1 more."""
        h = self.tokens[slot, :self.length[slot]]
        key = self.keys.get(slot)
        if key is None:
            key = self.keys[slot] = self.draft._open(1, self.cache_len)
            self.done[slot] = 0
        fed = self.fed[slot, :min(self.done[slot], len(h) - 1)]
        parted = np.flatnonzero(fed != h[:len(fed)])
        done = int(parted[0]) if len(parted) else len(fed)  # (the last token is always fed: its output drafts)
        while len(h) - done > WIDTHS[-1]:  # (no draft chosen from these chunks: no head run)
            self._feed(slot, key, h[done:done + WIDTHS[-1]], done, head=False)
            done += WIDTHS[-1]
        token = self._feed(slot, key, h[done:], done)
        drafts = [token]
        for i in range(1, n):
            drafts.append(self._feed(slot, key, np.asarray(drafts[-1:], np.int32), len(h) + i - 1))
        return drafts

    def _feed(self, slot: int, key, tokens: np.ndarray, at: int, head: bool = True) -> Optional[int]:
        """The row's cache takes `tokens` at entries at.. -> the draft's choice after the last of them (`head`
        False: none)."""
        out = self._extend(key, tokens, at, head)
        self.fed[slot, at:at + len(tokens)] = tokens
        self.done[slot] = at + len(tokens)
        return out

    def _extend(self, key, tokens: np.ndarray, at: int, head: bool = True) -> Optional[int]:
        t0 = time.perf_counter()
        width = next(w for w in WIDTHS if w >= len(tokens))
        x = np.zeros((1, width), np.int32)
        x[0, :len(tokens)] = tokens
        mask = (np.arange(width) < len(tokens)).astype(np.int32)[None]
        exclude = np.full((1, width), -1, np.int32)  # (greedy: the screened head's argmax, no logits made)
        out = self.draft.stages.get(self.draft._chain("extend", key, x, np.array([at], np.int32), mask, exclude,
                                                      head))
        if width <= 2:  # a round's calls (a prompt's chunks, once a row, are not what each draft costs)
            per = time.perf_counter() - t0
            self.t_call = per if self.t_call is None else (1 - EMA) * self.t_call + EMA * min(per, 4 * self.t_call)
        return None if out is None else int(out[0, len(tokens) - 1])

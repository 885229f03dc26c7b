"""Prompts joining decode steps (runner/slots.py's `join`): which prompt tokens ride in a group's next step.

A prompt that joins takes a free slot at once; its tokens go into the block of prompt tokens a decode step carries
beside its rows' newest tokens (a `JoinBlock`), and the step that carries its last token chooses its first.

- On stages with ragged steps (steps.ragged_step: the CPU attention kernel) any prompt joins, and a step carries up
  to `budget` prompt tokens, oldest prompt first: a long prompt goes a part at a time over several steps, each part
  reading what the earlier parts (and a cached prefix, from the pool) put in its row. The rows' newest tokens never
  wait behind more than a budget's worth of prompt tokens, and a burst of prompts is computed in as few passes as
  the budget allows, each reading the weights once for the prompts and the rows together (vLLM's chunked prefill).
- Elsewhere (a tensor-parallel mesh, a GPU) a short prompt (at most `longest` tokens) joins whole, its tokens
  attending to each other within the block (steps.decode_joining_step), while the block has room; longer ones are
  prefilled in passes of their own.
A step chooses the first tokens of at most JOIN_PROMPTS prompts (the sampler's fixed shapes).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import numpy as np

from opt_serving.runner.types import JOIN_PROMPTS, JoinBlock, SlotSettings


@dataclasses.dataclass
class Joining:
    """A prompt joining its slot's row, a part at a time."""
    slot: int
    row: int                  # its row in its group
    tokens: list[int]
    settings: SlotSettings
    done: int = 0             # its first tokens whose KV its row holds (a cached prefix's included)
    cached: int = 0           # of those, the cached prefix's (read from the prefix cache's pool)
    blocks: list = dataclasses.field(default_factory=list)  # the pool blocks of that prefix (held while it runs)
    keys: list = dataclasses.field(default_factory=list)    # the prompt's full blocks' prefix-cache keys
    deferred: bool = False    # waits for another joining prompt to store the prefix blocks it will reuse


@dataclasses.dataclass
class Part:
    """A joining prompt's tokens in one step: tokens[start:end] at entries start..end-1."""
    joining: Joining
    start: int
    end: int

    @property
    def final(self) -> bool:
        return self.end == len(self.joining.tokens)


def block_sizes(budget: int, smallest: int = 8) -> tuple[int, ...]:
    """The block sizes a ragged step's prompt tokens are padded to: powers of two from `smallest` and 1.5 times
    them (a block's padding is computed too), up to `budget`, and `budget`."""
    sizes, b = set(), smallest
    while b < budget:
        sizes.update((b, b + b // 2) if b >= 32 else (b,))
        b *= 2
    return tuple(sorted(s for s in sizes if s < budget)) + (budget,)


class Joins:
    """The prompts joining each group's rows (oldest first), and the block each group's next step carries."""

    def __init__(self, groups: int, rows: int, sizes: Sequence[int], ragged: bool, longest: int, width: int,
                 pad: int, budget: Optional[int] = None):
        """`rows`: a group's rows; `sizes`: the block sizes (the last: the most tokens a block holds); `ragged`:
        prompts go a part at a time (else short ones whole, at most `longest` tokens); `width`: the longest prompt
        whose first token a step chooses (the sampler's view of the prompts); `pad`: the pad id; `budget`: the most
        prompt tokens a step carries (default: the largest block)."""
        self.rows, self.sizes, self.ragged, self.longest, self.width, self.pad = rows, tuple(sizes), ragged, longest, \
            width, pad
        self.budget = min(budget or self.sizes[-1], self.sizes[-1])
        self._pending: list[collections.OrderedDict] = [collections.OrderedDict() for _ in range(groups)]

    def fits(self, tokens: Sequence[int], settings: SlotSettings) -> bool:
        """Could the prompt join (with no other prompt waiting)? No prompt scores asked (those are prefilled in
        passes of their own), and on stages without ragged steps a short one."""
        if settings.prompt_logprobs or not tokens:
            return False
        return len(tokens) <= self.width if self.ragged else len(tokens) <= min(self.longest, self.budget)

    def add(self, g: int, joining: Joining) -> bool:
        """The prompt joins its group's next steps; False where it does not fit (a short prompt whose block is
        full joins a later step)."""
        pending = self._pending[g]
        if not self.fits(joining.tokens, joining.settings):
            return False
        if not self.ragged and (len(pending) >= JOIN_PROMPTS or
                                sum(len(j.tokens) for j in pending.values()) + len(joining.tokens) > self.budget):
            return False
        pending[joining.slot] = joining
        return True

    def remove(self, g: int, slot: int) -> Optional[Joining]:
        return self._pending[g].pop(slot, None)

    def waiting(self, g: int) -> bool:
        return bool(self._pending[g])

    def joining(self, g: int) -> list[Joining]:
        return list(self._pending[g].values())

    def take(self, g: int, rows_running: bool = True, decoding: int = 0) -> list[Part]:
        """The parts the group's next step carries, within the budget and at most JOIN_PROMPTS prompts' last
        parts; those prompts leave the pending list (their rows decode from then on). First the prompts that
        finish within a quarter of the budget, in the order they came, up to half of it (a short prompt does not
        wait behind a long one's parts); then the oldest prompts, as far as the rest goes (so at least half of
        every step goes to them: no prompt waits for ever). Where those tokens fall between two block sizes the
        step carries the smaller block whenever that leaves fewer tokens for the next step than the larger would
        pad, and no short prompt's last part among them, while rows are running (`rows_running`: the next step
        comes anyway): a block's padding is computed like its tokens, and the tokens left ride the next step. With
        no row running, the tokens left would cost a step of their own, and the prompt its first token a step
        later. `decoding`: the running rows' tokens riding in the same block (a packed step, runner.types.PackedTokens):
        the budget and the block sizes hold them and the prompts' tokens."""
        pending = self._pending[g]
        ready = [j for j in pending.values() if not j.deferred]
        room = min(self.budget, self.sizes[-1] - decoding)
        plan = self._plan(ready, room) if room > 0 else []
        total = decoding + sum(n for _, n in plan)
        if self.ragged and plan and rows_running:
            above = next(b for b in self.sizes if b >= total)
            below = max((b for b in self.sizes if b <= total), default=0)
            if below > decoding and total - below < above - total:
                smaller = self._plan(ready, below - decoding)
                if self._short_finals(plan) <= self._short_finals(smaller):
                    plan = smaller
        parts = []
        for j, n in plan:
            parts.append(Part(j, j.done, j.done + n))
            j.done += n
            if j.done == len(j.tokens):
                del pending[j.slot]
        return parts

    def _short_finals(self, plan: list[tuple[Joining, int]]) -> set[int]:
        """The short prompts (a quarter of the budget at most) a plan finishes: a step's worth of waiting is most
        of their time to a first token, so the smaller block never leaves one of them for the next step."""
        return {id(j) for j, n in plan if j.done + n == len(j.tokens) and len(j.tokens) <= self.budget // 4}

    def _plan(self, ready: list[Joining], most: int) -> list[tuple[Joining, int]]:
        """take's choice at most `most` tokens: (prompt, its tokens this step), in the block's order."""
        short = set() if not self.ragged else {
            id(j) for j in ready if len(j.tokens) - j.done <= self.budget // 4}
        plan, taken, left, finals = [], set(), most, 0
        quick = min(self.budget // 2, most)
        for j in ready:  # prompts that finish now, within half the budget
            rest = len(j.tokens) - j.done
            if id(j) in short and finals < JOIN_PROMPTS and rest <= quick:
                quick, left, finals = quick - rest, left - rest, finals + 1
                plan.append((j, rest))
                taken.add(id(j))
        for j in ready:  # then the oldest
            if left <= 0 or finals >= JOIN_PROMPTS:
                break
            if id(j) not in taken:
                n = min(len(j.tokens) - j.done, left)
                left, finals = left - n, finals + (n == len(j.tokens) - j.done)
                plan.append((j, n))
        return plan

    def block(self, parts: list[Part]) -> JoinBlock:
        """The stages' view of a step's parts."""
        total = sum(p.end - p.start for p in parts)
        t = next(b for b in self.sizes if b >= total)
        ids = np.full(t, self.pad, np.int32)
        at_rows, entries = np.full(t, self.rows, np.int32), np.zeros(t, np.int32)
        seg = np.full(t, JOIN_PROMPTS, np.int32)
        last, last_rows = np.zeros(JOIN_PROMPTS, np.int32), np.full(JOIN_PROMPTS, self.rows, np.int32)
        # the sampler's view is as wide as the longest prompt that joins, whatever the block: one program for all
        prompts, mask = np.zeros((JOIN_PROMPTS, self.width), np.int32), np.zeros((JOIN_PROMPTS, self.width), np.int32)
        lengths = np.zeros(JOIN_PROMPTS, np.int32)
        settings, at, j = [], 0, 0
        for p in parts:
            n, row = p.end - p.start, p.joining.row
            ids[at:at + n] = p.joining.tokens[p.start:p.end]
            at_rows[at:at + n], entries[at:at + n] = row, np.arange(p.start, p.end)
            if p.final:
                tokens = p.joining.tokens
                seg[at:at + n] = j
                last[j], last_rows[j] = at + n - 1, row
                prompts[j, :len(tokens)], mask[j, :len(tokens)], lengths[j] = tokens, 1, len(tokens)
                settings.append(p.joining.settings)
                j += 1
            at += n
        return JoinBlock(ids, at_rows, entries, seg, last, last_rows, prompts, mask, lengths, tuple(settings))

"""The host's record of the decode slots (runner/slots.py's `Slots` keeps one): each slot's token count, newest
token and what its request wants scored, and where the slot lives in the stages: slot s is row s // groups of
group s % groups (consecutive slots alternate groups, so a few requests still fill every group).

Each slot has a generation, bumped when a request is inserted into it or freed from it. A step sent with a group
records its slots' generations; when its tokens come back, only slots still in that generation take theirs, so a
slot freed or refilled while its group was in the stages gets no token meant for its old request.
"""
from __future__ import annotations

import numpy as np

from opt_serving.runner.types import SlotSettings


class SlotTable:
    """`num_slots` decode slots in `groups` groups."""

    def __init__(self, num_slots: int, groups: int):
        if num_slots % groups:
            raise ValueError(f"{num_slots} decode slots do not split into {groups} micro-batch groups")
        self.num_slots, self.groups = num_slots, groups
        self.lengths = np.zeros(num_slots, np.int64)     # [slots] tokens so far (0 = free): window and read length
        self.next = np.zeros(num_slots, np.int32)        # [slots] the newest token, fed to the next decode
        self.want_top = np.zeros(num_slots, np.bool_)    # [slots] does the slot's request want top alternatives
        self.want_lp = np.zeros(num_slots, np.bool_)     # [slots] ... or its tokens' log-probabilities
        self.generation = np.zeros(num_slots, np.int64)  # [slots] bumped by insert and free

    def group_of(self, slot: int) -> tuple[int, int]:
        """(group, row) of a slot."""
        return slot % self.groups, slot // self.groups

    def group_slots(self, g: int) -> np.ndarray:
        """The group's slots, in row order: int [rows]."""
        return np.arange(g, self.num_slots, self.groups)

    def insert(self, slot: int, length: int, first: int, settings: SlotSettings) -> None:
        """A prefilled request of `length` tokens (its prompt and its first token, `first`) takes the slot."""
        self.lengths[slot] = length
        self.next[slot] = first
        self.join(slot, settings)
        self.generation[slot] += 1

    def join(self, slot: int, settings: SlotSettings) -> None:
        """A joining prompt takes the slot: its tokens count once its last part is in a step."""
        self.want_top[slot] = settings.top_logprobs
        self.want_lp[slot] = settings.logprob

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.generation[slot] += 1

    def current(self, slots: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """Those of `slots` (int [n]) still in the generations they were sent in (int [n])."""
        return slots[self.generation[slots] == generations]

    def advance(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """The slots marked in `rows` (bool [slots]) take a step's `tokens` (int32 [slots])."""
        self.next[rows] = tokens[rows]
        self.lengths[rows] += 1

    def wants(self, slots) -> tuple[bool, bool]:
        """(want_scores, want_top) of a step over `slots` (indices or a mask): the top alternatives where a
        request asks for them, the scores where one asks for those or for its tokens' log-probabilities."""
        want_top = bool(self.want_top[slots].any())
        return want_top or bool(self.want_lp[slots].any()), want_top

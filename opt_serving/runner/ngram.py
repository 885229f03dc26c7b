"""Served speculative decoding by prompt lookup (vLLM's "ngram" method, config.SpeculativeConfig), for the slots.

A running row whose sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred
before drafts the tokens that followed them. Its drafts ride in the row's next step as prompt tokens continuing
the row (a ragged step's block, at the entries after its newest token), so the step computes them in the same
products as every other row's token. The stage that samples checks them there (Sampler.choose: each draft's
successor is the greedy choice at the draft, the drafts kept up to the first that differs from the choice before
it), and the row gets its own token plus one more for each draft kept. Entries of drafts that were not kept lie
past the row's length: the next steps write over them before any token reads them.

Rows that ask for nothing a token's history changes draft (no penalties, logprobs, grammar, bad words or biases; a
stop token min_tokens holds back is held back in the check too), greedy or sampled: a sampled row's successors are
drawn in the check from its warped distribution with the key plain decoding draws with at that position (its seed
and the tokens before: sampling.choose_at), so a draft is kept with the probability the target gives it (for a
draft of one certain token, the rejection rule of speculative sampling) and the row's tokens are the ones plain
decoding gives, sampled or not. The others decode as usual beside them.

When drafts pay (`plan`): a step's products read every weight once whatever its width, up to a point, so drafts
that keep the step in the block size it has anyway cost only the sampler's check. Each step the rows' candidate
drafts are added, likeliest first (a row's i-th draft is kept with probability rate^i, its running acceptance rate),
while the expected tokens per second of the step (rows + expected drafts kept) / (the step's measured time at that
block size) grows. Step times are measured per block size, with and without drafts, from one call's start to the
next's (the host's work between calls included: a plain call of several steps pays it once for them all). A step
carries drafts only once a plain step of its block has been measured, and one in every `REMEASURE` goes plain to
measure it again; a drafted step of a size not measured yet is assumed to cost `GUESS_DRAFTED` times its plain
step, or in proportion to its tokens past the smallest plain step measured, so drafts move a step to a larger
block only once that block has been seen to pay. A row whose drafts stopped landing (its rate below
`MIN_RATE`) drafts again one token every `PROBE_EVERY` steps to see whether that changed. No step of more than
`SPEC_MAX_BLOCK` tokens carries drafts (a step that wide is bound by its products, not by reading the weights).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from opt_serving.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from opt_serving.runner.types import SlotSettings

SPEC_MAX_BLOCK = 32   # the widest step that carries drafts (warm-up compiles each block size up to it with them)
MIN_RATE = 0.2        # a row drafting with a lower acceptance rate only probes
PROBE_EVERY = 8       # steps between a probe's single draft while a row's rate is below MIN_RATE
PRIOR_RATE = 0.5      # a row's acceptance rate before its first drafts
EMA = 0.3             # weight of the newest observation in the running rates and step times
REMEASURE = 32        # one step in this many at a block size goes without drafts, its plain cost measured again
GUESS_DRAFTED = 1.1   # a step with drafts, not measured yet: this many times the same block's step without


def may_draft(settings: SlotSettings) -> bool:
    """May a request's row draft: greedy or sampled tokens (temperature, top-k, top-p, min-p), none of them scored,
    penalised or constrained?"""
    s = settings
    return (s.repetition_penalty == 1.0 and s.presence_penalty == 0
            and s.frequency_penalty == 0 and s.no_repeat_ngram_size <= 0
            and not s.bad_words_ids and not s.logit_bias and s.grammar is None and not s.logprob
            and not s.top_logprobs)


def lookup(history: np.ndarray, k: int, most: int, least: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the history's (int [L]) last n tokens, n from `most`
    down to `least` (the first n that has one): the latest occurrence with k tokens after it, else the one with the
    most (a match just before the end has only a token or two after it)."""
    h, end = history, len(history)
    ends = np.flatnonzero(h[:-1] == h[-1])  # where an earlier occurrence could end: the last token's earlier places
    for n in range(min(most, end - 1), least - 1, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):  # (the other n - 1 tokens, on the few places left)
            hits = hits[h[hits - j] == h[-1 - j]]
        if len(hits):
            full = hits[hits + 1 + k <= end]
            start = int(full[-1] if len(full) else hits[0]) + 1
            return h[start:start + k].tolist()
    return []


@dataclasses.dataclass(frozen=True)
class Draft:
    """One row's drafts in a step: its group row, and the tokens after its newest one."""
    slot: int
    row: int
    tokens: tuple[int, ...]


class NgramSpeculation:
    """The slots' histories, acceptance rates and measured step times, and each step's drafts (`plan`)."""

    def __init__(self, config: SpeculativeConfig, num_slots: int, max_seq_len: int, sizes: Sequence[int]):
        """`sizes`: the block sizes a step's tokens are padded to (those up to SPEC_MAX_BLOCK carry drafts)."""
        self.config, self.k = config, config.num_speculative_tokens
        self.sizes = tuple(b for b in sizes if b <= SPEC_MAX_BLOCK)
        # rows the sampler checks a step (drafts beyond them wait for the next step)
        self.verify_rows = min(SPEC_MAX_BLOCK // 2, 2 * self.k)
        self.tokens = np.zeros((num_slots, max_seq_len + MAX_SPECULATIVE_TOKENS + 1), np.int32)  # each slot's
        self.length = np.zeros(num_slots, np.int64)  # prompt and tokens so far; 0: a slot that does not draft
        # each slot's drafts kept and tested, running sums (the prior: one step of PRIOR_RATE of one): `rate`
        self._kept, self._tested = np.full(num_slots, PRIOR_RATE), np.ones(num_slots)
        self.idle = np.zeros(num_slots, np.int64)  # steps since a low-rate row last probed
        self.step_s: dict[tuple[int, bool], float] = {}  # (block size, with drafts) -> seconds, running
        self.forced: Optional[tuple[int, int]] = None  # warm-up: (slot, block) of the next step's drafts
        self.planned: Optional[list] = None  # plan_ahead's drafts, for the step that follows
        self._plans: dict[int, int] = {}  # block size -> the steps planned at it (every REMEASURE-th plain)
        self._declined: dict[int, int] = {}  # block size -> the steps whose drafts would not pay (a probe a while)
        self._call: Optional[tuple] = None  # the latest call (observe_call): block, drafted, steps, began, ended
        self.adaptive = True  # False: every offered draft the step holds rides, paying or not (tests, probes)

    # ---- each slot's history ----
    def start(self, slot: int, tokens: Sequence[int], settings: SlotSettings) -> None:
        """A request takes the slot with these tokens (its prompt, and its first token where it was prefilled)."""
        self.length[slot] = 0
        if may_draft(settings):
            self.tokens[slot, :len(tokens)] = tokens
            self.length[slot], self.idle[slot] = len(tokens), 0
            self._kept[slot], self._tested[slot] = PRIOR_RATE, 1.0

    def extend(self, slot: int, tokens: Sequence[int]) -> None:
        n = self.length[slot]
        if n:
            self.tokens[slot, n:n + len(tokens)] = tokens
            self.length[slot] = n + len(tokens)

    def end(self, slot: int) -> None:
        self.length[slot] = 0

    def close(self) -> None:
        """Let go of what drafting holds (a draft model's caches)."""

    def warm(self) -> None:
        """Compile what drafting runs besides the steps (a draft model's calls)."""

    # ---- each step ----
    def drafts(self, slots: np.ndarray, positions: np.ndarray, tokens: int, room: int, max_seq_len: int) -> list:
        """The drafts of a group's step: its `slots` in row order, each row's newest token's position (-1: not
        running); the plan `plan_ahead` made, where it made one."""
        planned, self.planned = self.planned, None
        if planned is not None:
            return planned
        running = [(int(slots[r]), int(r), int(positions[r]) + 1) for r in np.flatnonzero(positions >= 0)]
        return self.plan(running, tokens, room, max_seq_len)

    def plan_ahead(self, lengths: np.ndarray, largest: int, max_seq_len: int) -> bool:
        """Before several steps in one call (one group, every slot a row, no prompt joining: Slots.step_many): do
        rows draft in the next step? The plan is kept for it."""
        positions = np.where(lengths > 0, lengths - 1, -1)
        tokens = int((positions >= 0).sum())
        self.planned = self.drafts(np.arange(len(lengths)), positions, tokens, largest - tokens, max_seq_len) or None
        return self.planned is not None

    def plan(self, running: Sequence[tuple[int, int, int]], tokens: int, room: int, max_seq_len: int) -> list[Draft]:
        """The drafts of a step over `running` rows (slot, group row, its tokens so far) that carries `tokens`
        tokens without them and at most `room` more."""
        if self.forced is not None:
            return self._forced(running, tokens)
        drafting = sum(1 for slot, _, _ in running if self.length[slot])  # (rows of requests that may draft)
        most = min(drafting * self.k, self.verify_rows, room, self.sizes[-1] - tokens if self.sizes else 0)
        if tokens > SPEC_MAX_BLOCK or most <= 0:
            return []
        if self.adaptive and self._measure_plain(tokens):
            return []
        plain = self._rate(tokens, False, len(running))
        probe = False
        if self.adaptive and all(self._rate(tokens + n, True, len(running) + n, n) <= plain
                                 for n in range(1, most + 1)):
            if not self._probe_drafted(tokens):
                return []  # (not even drafts that all land would pay: no lookups)
            probe, most = True, 1  # (one draft rides now and then, so the estimate is measured again)
        offers, rates = [], self.rate  # (expected kept, slot, row, its i-th draft, the drafts)
        for slot, row, length in running:
            if not self.length[slot]:
                continue
            k = min(self.k, max_seq_len - length)  # (draft i takes entry length - 1 + i)
            if self.adaptive and rates[slot] < MIN_RATE:
                self.idle[slot] += 1
                if self.idle[slot] < PROBE_EVERY:
                    continue
                k = min(k, 1)
            drafted = self._candidates(slot, k) if k > 0 else []
            offers += [(rates[slot] ** (i + 1), slot, row, i, drafted) for i in range(len(drafted))]
        if not offers:
            return []
        offers.sort(key=lambda o: -o[0])  # (a row's i-th draft is never likelier than its (i-1)-th)
        best, best_n, kept = plain, 0, 0.0
        for n in range(1, min(len(offers), most) + 1):
            kept += offers[n - 1][0]
            rate = self._rate(tokens + n, True, len(running) + kept, n)
            if rate > best or not self.adaptive or probe:
                best, best_n = rate, n
        chosen: dict[int, tuple[int, int]] = {}  # slot -> (row, drafts taken)
        for _, slot, row, i, _ in offers[:best_n]:
            chosen[slot] = (row, max(chosen.get(slot, (row, 0))[1], i + 1))
        for slot in chosen:
            self.idle[slot] = 0
        drafts = self._proposals({slot: n for slot, (_, n) in chosen.items()}, {o[1]: o[4] for o in offers})
        return [Draft(slot, row, tuple(drafts[slot])) for slot, (row, _) in sorted(chosen.items()) if drafts[slot]]

    # ---- where drafts come from (a draft model's proposer, runner/draft.py, drafts only what a step takes) ----
    def _candidates(self, slot: int, k: int) -> list:
        """Up to k drafts the slot's row could take this step (their count makes its offers)."""
        h = self.tokens[slot, :self.length[slot]]
        return lookup(h, k, self.config.prompt_lookup_max, self.config.prompt_lookup_min)

    def _proposals(self, chosen: dict[int, int], offered: dict[int, list]) -> dict[int, list[int]]:
        """The drafts of the rows chosen (slot -> how many it takes) from the candidates offered."""
        return {slot: offered[slot][:n] for slot, n in chosen.items()}

    def _draft_seconds(self, drafts: int) -> float:
        """What making `drafts` drafts costs the host besides the step (a lookup: next to nothing)."""
        return 0.0

    def _measure_plain(self, tokens: int) -> bool:
        """Should this step go without drafts, to measure (again) what a plain step of its block costs? Its first,
        and one in every REMEASURE: the choice reads drafted steps against plain ones of the same block."""
        block = self._block(tokens)
        n = self._plans[block] = self._plans.get(block, 0) + 1
        return (block, False) not in self.step_s or n % REMEASURE == 0

    def _probe_drafted(self, tokens: int) -> bool:
        """Drafts do not pay at this step's block, by the times measured: does one ride anyway, to measure a step
        with drafts again? One step in every REMEASURE so declined (a drafted step once measured slow, during a
        compile or a burst of other work, would otherwise keep drafts out of that block for good)."""
        block = self._block(tokens)
        n = self._declined[block] = self._declined.get(block, 0) + 1
        return n % REMEASURE == 0

    def _forced(self, running, tokens: int) -> list[Draft]:
        """Warm-up's step: the slot drafts as many tokens as fit the block it asked for (their values: its own)."""
        slot, block = self.forced
        self.forced = None
        row = next(r for s, r, _ in running if s == slot)
        n = min(self.k, self.verify_rows, block - tokens)
        return [Draft(slot, row, (int(self.tokens[slot, max(self.length[slot] - 1, 0)]),) * n)]

    def _block(self, tokens: int) -> int:
        return next((b for b in self.sizes if b >= tokens), tokens)

    def _seconds(self, tokens: int, drafted: bool) -> float:
        """A step's expected time at the block holding `tokens` tokens (the module docstring's guesses)."""
        block = self._block(tokens)
        t = self.step_s.get((block, drafted))
        if t is not None:
            return t
        if drafted:
            return GUESS_DRAFTED * self._seconds(tokens, False)
        known = sorted((b, s) for (b, d), s in self.step_s.items() if not d)
        if not known:
            return float(block)  # (nothing measured: every block alike per token)
        b0, s0 = known[0]
        return s0 * max(1.0, block / b0)

    def _rate(self, tokens: int, drafted: bool, expected: float, drafts: int = 0) -> float:
        return expected / (self._seconds(tokens, drafted) + self._draft_seconds(drafts))

    def forget_times(self) -> None:
        """Warm-up's calls compiled: their times are not a step's."""
        self.step_s.clear()
        self._plans.clear()
        self._declined.clear()
        self._call = None

    def observe_call(self, block: int, drafted: bool, steps: int, began: float, ended: float) -> None:
        """A call of the model ran `steps` steps of `block` tokens (with drafts or not) from `began` to `ended`.
        Its steps' time is read when the next call begins: the host's work between two calls (handing the tokens
        out, streaming them) is paid once a call, however many steps it took, so a plain call of several steps
        costs less a step than a step alone. A gap of more than twice the call (an idle engine, a prefill pass
        between) leaves the call's own time."""
        if self._call is not None:
            b, d, n, t0, t1 = self._call
            cycle = began - t0 - self._drafting_within(t0, began)  # (a draft model's time is counted apart)
            self.observe_step(b, d, (cycle if cycle <= 2 * (t1 - t0) else t1 - t0) / n)
        self._call = (block, drafted, steps, began, ended)

    def _drafting_within(self, t0: float, t1: float) -> float:
        """Seconds the host spent drafting between t0 and t1 (a lookup's: none worth counting)."""
        return 0.0

    def observe_step(self, block: int, drafted: bool, seconds: float) -> None:
        """A step of `block` tokens (with drafts or not) took `seconds` (its call, waited for)."""
        key = (block, drafted)
        old = self.step_s.get(key)
        # (a time under half the estimate replaces it: the estimate came from a step that did more, a compile)
        fresh = old is None or seconds < old / 2
        self.step_s[key] = seconds if fresh else (1 - EMA) * old + EMA * min(seconds, 4 * old)

    @property
    def rate(self) -> np.ndarray:
        """Each slot's acceptance rate: its drafts kept over those tested, newer steps weighing more."""
        return self._kept / self._tested

    def observe_row(self, slot: int, drafted: int, kept: int) -> None:
        """A row's step checked `drafted` drafts and kept the first `kept`."""
        tested = kept + (kept < drafted)  # (the drafts after the first rejected one were never tested)
        if tested:  # sums, not a mean of kept / tested, which is biased low (speculative.KChooser.observe)
            self._kept[slot] = (1 - EMA) * self._kept[slot] + EMA * kept
            self._tested[slot] = (1 - EMA) * self._tested[slot] + EMA * tested

    def settle(self, result, slots: np.ndarray, more, kept, packed, table) -> None:
        """A step's `result` (runner.types.StepResult over the group's `slots`, in row order) as the sampler gave
        it: each slot still current takes its token into its history, and a row that drafted its kept drafts'
        successors too (into `result.more` and the slot `table`: its length and newest token), its rate updated.
        `more` [rows, K], `kept` [rows]: the sampler's check (None without drafts); `packed` the step's tokens."""
        drafted = packed is not None and packed.draft_ids is not None
        for r in np.flatnonzero(result.rows[slots]):
            slot = int(slots[r])
            if not self.length[slot]:
                continue
            self.extend(slot, (int(result.tokens[slot]),))
            m = int((packed.draft_ids[r] >= 0).sum()) if drafted else 0
            if not m:
                continue
            a = int(kept[r])
            self.observe_row(slot, m, a)
            result.drafts, result.drafted, result.accepted = result.drafts + 1, result.drafted + m, result.accepted + a
            if a:
                extra = [int(t) for t in more[r, :a]]
                result.more[slot] = extra
                table.lengths[slot] += a
                table.next[slot] = extra[-1]
                self.extend(slot, extra)

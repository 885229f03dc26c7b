"""Speculative decoding for generate(), on every plan: a cheap proposer drafts k tokens, the target checks them
all in one pass over its stages (`seq_extend`), and the accepted drafts plus one token of the target's own are
kept; each model's next call writes from its first token not kept on, dropping the refused drafts' cache entries
past it (steps.extend_step). At batch 1 a step reads every weight of the target once whether it checks one token or
five, so each accepted draft is a token for (almost) nothing.

Proposers:
- `ModelDrafter`: a small OPT sharing the tokenizer (transformers' `assistant_model`), e.g. OPT-125m for
  OPT-6.7b, on its own stages; its cache follows the accepted tokens.
- `PromptLookup`: no model: the tokens that followed the latest earlier occurrence of the sequence's last n-gram
  (transformers' `prompt_lookup_num_tokens`, vLLM's "ngram"): copies from the prompt cost nothing to draft.

Acceptance (Leviathan et al. 2023, Chen et al. 2023): greedy rows keep the drafts equal to the target's argmax,
so the output is token for token the non-speculative one; sampled rows accept draft d with probability
min(1, p(d) / q(d)) and on a rejection draw from max(0, p - q) renormalised, p and q both after the same
temperature, top-k and top-p, which makes every token distributed exactly as the target's (a lookup's q is a
point mass on its draft).

How many tokens to draft (`KChooser`): each round picks the k that maximises the expected tokens per second,
(1 - a^(k+1)) / (1 - a) tokens for k draft steps and one check, from the acceptance rate a and the measured
times of a draft step and of a check; where no k > 0 beats plain decoding (drafts that never land, or a check
that grows with k) it drafts nothing, and drafts one token every `PROBE_EVERY` rounds to see whether that
changed, twice as many rounds apart after each probe that fails (up to `PROBE_MAX`), so drafts that never land
cost less and less. The acceptance rate is the drafts accepted over the drafts tested (those up to the first
rejection), both summed over the rounds seen from a prior worth one round, equally until there are enough rounds
for running (EMA) sums: a few rejected first drafts turn speculation off.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import sampling
from opt_serving.model import kv_cache
from opt_serving.runner.types import acceptance_length

PROBE_EVERY = 8  # rounds from one probe to the next while speculation does not pay
PROBE_MAX = 64  # ... doubled after each failed probe, up to this many
PLAIN_CAP = PROBE_MAX  # greedy rounds that draft nothing run together, up to this many in one call
EMA = 0.3  # weight of the newest round in the running acceptance rate and timings
CATCH_UP = 8  # a draft behind by more than 2 tokens (after plain rounds) is fed them this many at a time


@dataclasses.dataclass
class SpeculationStats:
    """What a speculative generate() did (Generation.last_speculation): rounds, drafted and accepted tokens."""
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_rounds: int = 0  # rounds that drafted nothing (speculation off)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each round emitted: the accepted drafts plus the target's own."""
        return acceptance_length(self.accepted, self.rounds)


class KChooser:
    """Draft length per round from the acceptance rate and the measured costs (module docstring). `adaptive`
    False: always `k_max`."""

    def __init__(self, k_max: int, adaptive: bool = True):
        self.k_max, self.adaptive = k_max, adaptive
        # acceptance rate: running sums of drafts accepted and drafts tested (the prior: one round of 0.6 of one)
        self._accepted, self._tested = 0.6, 1.0
        self.t_draft: Optional[float] = None  # seconds per draft step
        self.t_check: Optional[float] = None  # seconds per check of the target (any k at batch 1)
        self._seen = 0  # rounds with drafts observed
        self._plain, self._every, self._probing = 0, PROBE_EVERY, False

    def next_k(self) -> int:
        self._probing = False
        if not self.adaptive or self.t_draft is None or self.t_check is None:
            return self.k_max
        best = max(range(self.k_max + 1), key=self.expected_rate)
        if best == 0:
            self._plain += 1
            if self._plain >= self._every:
                self._plain, self._probing = 0, True
                return 1
        return best

    def plain_stretch(self) -> int:
        """After next_k() gave 0: how many rounds in a row draft nothing before the next probe, this one included
        (none of them learns more than their time: they may run as one; `skip` the others)."""
        return max(1, self._every - self._plain) if self.adaptive else 1

    def skip(self, rounds: int) -> None:
        """`rounds` more rounds that drafted nothing, run with the one next_k() gave 0 for."""
        self._plain += rounds

    @property
    def rate(self) -> float:
        """The acceptance rate: accepted over tested drafts of the rounds seen, newer rounds weighing more."""
        return self._accepted / self._tested  # (a round tests at least one draft: never 0)

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second when drafting k."""
        a = min(self.rate, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens / (k * self.t_draft + self.t_check)

    def observe(self, k: int, accepted: int, t_draft: float, t_check: float) -> None:
        """A round's outcome: `accepted` of `k` drafts, the time its draft steps and its check took."""
        if k > 0:
            # the drafts after the first rejection were never tested. Sums of accepted and tested drafts, not a
            # mean of each round's accepted / tested: that mean is biased low (at a true rate of 0.85 and k = 4 it
            # is 0.73, a round ending in a rejection weighing as much as one of four accepted), which made
            # the rule draft too few
            tested = accepted + (accepted < k)
            self._seen += 1
            weight = max(EMA, 1 / (self._seen + 1))  # the prior counts as one round
            self._accepted = (1 - weight) * self._accepted + weight * accepted
            self._tested = (1 - weight) * self._tested + weight * tested
            self.t_draft = _blend(self.t_draft, t_draft / k)
            if self._probing:  # a failed probe waits twice as long for the next; one that lands starts over
                self._every = PROBE_EVERY if accepted else min(2 * self._every, PROBE_MAX)
        self.t_check = _blend(self.t_check, t_check)


def _blend(old: Optional[float], new: float) -> float:
    """A running time: a round far slower than the estimate (a compile of a new shape) leaves it as it was."""
    if old is None:
        return new
    return old if new > 4 * old else (1 - EMA) * old + EMA * new


class PromptLookup:
    """Drafts from the sequence itself: the tokens after the latest earlier match of its last n tokens, n from
    `max_ngram` down to 1."""

    def __init__(self, max_ngram: int = 2):
        if max_ngram < 1:
            raise ValueError(f"max_matching_ngram_size must be at least 1, got {max_ngram}")
        self.max_ngram = max_ngram

    def start(self, prompt: np.ndarray, max_len: int) -> None:
        pass

    def propose(self, history: list[int], k: int, accept) -> tuple[list[int], Optional[np.ndarray]]:
        """-> (up to k drafted tokens, None: each a point mass)."""
        h = np.asarray(history)
        for n in range(min(self.max_ngram, len(h) - 1), 0, -1):
            tail = h[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)  # every earlier n-gram
            hits = np.nonzero((windows == tail).all(1))[0]
            for start in hits[::-1]:  # the latest match that has tokens after it
                follow = h[start + n:start + n + k]
                if len(follow):
                    return follow.tolist(), None
        return [], None

    def accepted(self, history: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


class ModelDrafter:
    """A draft model's proposals, over its own stages (a Generation's); its cache holds `done` tokens of the
    sequence, cut back to the accepted ones after each round."""

    def __init__(self, generation):
        self.gen, self.key, self.done = generation, None, 0

    def start(self, prompt: np.ndarray, max_len: int) -> None:
        """The prompt but its last token prefilled (that one is fed with the first drafts)."""
        self.key = self.gen._open(1, max_len)
        _prefill_all_but_last(self.gen, self.key, prompt)
        self.done = len(prompt) - 1

    def propose(self, history: list[int], k: int, accept: "Acceptance") -> tuple[list[int], Optional[np.ndarray]]:
        """k tokens, each the draft's choice as `accept` makes it -> (tokens, q [k, V]: their distributions; None
        for greedy drafts)."""
        pending = history[self.done:]
        while len(pending) > CATCH_UP:  # behind by plain rounds: fed a chunk at a time, no head run on them
            self.gen.stages.get(self.gen._chain("extend", self.key, np.asarray([pending[:CATCH_UP]], np.int32),
                                                np.array([self.done], np.int32), np.ones((1, CATCH_UP), np.int32),
                                                None, False))
            pending, self.done = pending[CATCH_UP:], self.done + CATCH_UP
        width = 1 if len(pending) == 1 else 2 if len(pending) == 2 else CATCH_UP  # few compiled widths
        x = np.zeros((1, width), np.int32)
        x[0, :len(pending)] = pending
        mask = (np.arange(width) < len(pending)).astype(np.int32)[None]
        tokens, qs, pos = [], [], len(history)  # draft i takes position pos + i
        for i in range(k):
            start = self.done if i == 0 else pos + i - 1
            # the position each row's token would take: the EOS a row holds back there (greedy)
            exclude = accept.held(start + 1 + np.arange(x.shape[1]))[None] if accept.greedy else None
            out = self.gen.stages.get(self.gen._chain("extend", self.key, x, np.array([start], np.int32), mask,
                                                      exclude))
            last = out[0, int(mask.sum()) - 1]
            if accept.greedy:
                tok, q = int(last), None
            else:
                tok, q = accept.draft_choice(last, pos + i)
            tokens.append(tok)
            qs.append(q)
            x, mask = np.array([[tok]], np.int32), np.ones((1, 1), np.int32)
        self.done = len(history) + k - 1  # the last draft was never fed
        return tokens, (None if accept.greedy else np.stack(qs))

    def accepted(self, history: list[int]) -> None:
        """The sequence after a round: the cache entries that match it (all but its newest token) are the ones kept;
        the next call writes from there on."""
        self.done = min(self.done, len(history) - 1)

    def close(self) -> None:
        if self.key is not None:
            self.gen._close([self.key])
            self.key = None


@jax.jit
def _warped_probs(logits, held, settings):
    """logits [C, V] -> the sampling distribution of each row [C, V]: `held` [C] left out (EOS held back by
    min_new_tokens; -1 none), then temperature, top-k, top-p (sampling.warp)."""
    return jax.nn.softmax(sampling.warp(sampling.leave_out(logits.astype(jnp.float32), held), settings), axis=-1)


class Acceptance:
    """The target's choice at each checked position: greedy (argmax) or sampled (the rejection rule)."""

    def __init__(self, settings: dict, eos: int, prompt_len: int, seed: int):
        self.greedy = settings["temperature"] <= 0
        self.settings, self.eos, self.prompt_len = settings, eos, prompt_len
        self.min_new = max(settings.get("min_new_tokens") or 0, (settings.get("min_length") or 0) - prompt_len)
        self.rng = np.random.default_rng(seed)
        self._warp = {}

    def held(self, positions) -> np.ndarray:
        """EOS where the token at each position would come too early (min_new_tokens, min_length), else -1."""
        new = np.asarray(positions) - self.prompt_len
        return np.where((new < self.min_new) & (self.eos >= 0), self.eos, -1).astype(np.int32)

    def probs(self, logits: np.ndarray, positions) -> np.ndarray:
        c = logits.shape[0]
        if c not in self._warp:
            self._warp[c] = sampling.make_settings(c, temperature=self.settings["temperature"],
                                                   top_k=self.settings["top_k"], top_p=self.settings["top_p"])
        return np.asarray(_warped_probs(jnp.asarray(logits), jnp.asarray(self.held(positions)), self._warp[c]),
                          np.float64)

    def draft_choice(self, logits: np.ndarray, position: int):
        """A sampled draft's token at `position` from its logits [V] -> (token, q [V])."""
        q = self.probs(logits[None], [position])[0]
        return int(self.rng.choice(len(q), p=q / q.sum())), q

    def decide(self, out: np.ndarray, start: int, drafts: list[int], q) -> list[int]:
        """The target's check of positions start..start+k (the last kept token, then the drafts): its argmax
        tokens [k+1] (greedy) or its logits [k+1, V] -> the tokens to emit: the accepted drafts, then one of the
        target's own."""
        if self.greedy:
            kept = []
            for d, best in zip(drafts, out):
                if d != best:
                    break
                kept.append(d)
            return kept + [int(out[len(kept)])]
        p = self.probs(out, np.arange(len(drafts) + 1) + start + 1)  # at the position each row's token takes
        kept = []
        for i, d in enumerate(drafts):
            qd = 1.0 if q is None else q[i, d]
            if self.rng.random() < min(1.0, p[i, d] / qd):
                kept.append(d)
                continue
            residual = np.maximum(p[i] - (_point(d, p.shape[1]) if q is None else q[i]), 0.0)
            total = residual.sum()
            pick = residual / total if total > 0 else p[i] / p[i].sum()
            return kept + [int(self.rng.choice(len(pick), p=pick))]
        last = p[len(drafts)]
        return kept + [int(self.rng.choice(len(last), p=last / last.sum()))]


def _point(token: int, v: int) -> np.ndarray:
    e = np.zeros(v)
    e[token] = 1.0
    return e


def _prefill_all_but_last(gen, key, ids: np.ndarray) -> None:
    if len(ids) > 1:
        gen.stages.get(gen._chain("prefill", key, np.asarray(ids[None, :-1], np.int32),
                                  np.ones((1, len(ids) - 1), np.int32), False))


def generate(target, drafter, ids: np.ndarray, max_new: int, settings: dict, eos: int, seed: int, k_max: int,
             adaptive: bool = True) -> tuple[np.ndarray, SpeculationStats]:
    """One sequence (ids [S], unpadded) continued by up to `max_new` tokens on `target` (a Generation: its
    stages) with `drafter`'s proposals -> (the sequence [S + new], stats). Stops after EOS (kept, as generate()
    keeps it)."""
    s = len(ids)
    # a check or a catch-up may write past the last kept token; a power of two: lengths near each other share
    # their compiled calls
    max_len = kv_cache.bucket_length(s + max_new + k_max + CATCH_UP, 1 << 30)
    accept = Acceptance(settings, eos, s, seed)
    chooser, stats = KChooser(k_max, adaptive), SpeculationStats()
    key = target._open(1, max_len)
    try:
        if accept.greedy:  # the first token as plain generate() chooses it: the whole prompt, the screened head
            first = target.stages.get(target._chain("prefill", key, ids[None], np.ones((1, s), np.int32), False,
                                                    accept.held([s])))
            history = list(map(int, ids)) + [int(first[0])]
        else:  # the prompt's last token goes in with the first drafts, its next token chosen by the rule
            _prefill_all_but_last(target, key, ids)
            history = list(map(int, ids))
        drafter.start(np.asarray(ids, np.int32), max_len)
        while len(history) - s < max_new and (len(history) == s or history[-1] != eos):
            k = min(chooser.next_k(), max_new - (len(history) - s))
            if k == 0 and accept.greedy and target.stages.n == 1:  # rounds with no drafts: one compiled loop
                history += _plain_stretch(target, key, history, min(chooser.plain_stretch(), PLAIN_CAP,
                                                                    max_new - (len(history) - s)),
                                          accept, chooser, stats)
                drafter.accepted(history)
                continue
            t0 = time.perf_counter()
            drafts, q = drafter.propose(history, k, accept) if k > 0 else ([], None)
            t1 = time.perf_counter()
            # checked at two widths only, 1 and k_max + 1 (right-padded): at batch 1 a check reads the weights
            # once whatever its width, and every width is a compile of the whole target
            n = len(drafts) + 1
            width = 1 if n == 1 else k_max + 1
            x = np.zeros((1, width), np.int32)
            x[0, :n] = [history[-1]] + drafts
            start = len(history) - 1
            exclude = accept.held(start + 1 + np.arange(width))[None] if accept.greedy else None
            out = target.stages.get(target._chain("extend", key, x, np.array([start], np.int32),
                                                  (np.arange(width) < n).astype(np.int32)[None], exclude))
            new = accept.decide(out[0][:n], start, drafts, q)
            t2 = time.perf_counter()
            chooser.observe(len(drafts), len(new) - 1, t1 - t0, t2 - t1)
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += len(new) - 1
            stats.plain_rounds += not drafts
            if eos in new:
                new = new[:new.index(eos) + 1]
            history += new[:max_new - (len(history) - s)]
            drafter.accepted(history)  # (the next check writes from history's last token on: refused drafts go)
    finally:
        target._close([key])
        drafter.close()
    return np.asarray(history, np.int32), stats


def _plain_stretch(target, key, history: list[int], n: int, accept: Acceptance, chooser: KChooser,
                   stats: SpeculationStats) -> list[int]:
    """Up to n greedy tokens after `history` in one compiled loop on the target's one stage (stopping after EOS),
    counted as that many rounds that drafted nothing -> the tokens."""
    t0 = time.perf_counter()
    start = len(history) - 1  # the newest token's entry; the token chosen at step i takes position start + 1 + i
    new = target.stages.get(target.stages.call(0, "seq_continue", key, history[-1], start, n, accept.eos,
                                               accept.held(start + 1 + np.arange(PLAIN_CAP)), PLAIN_CAP)).tolist()
    chooser.skip(len(new) - 1)
    chooser.observe(0, 0, 0.0, (time.perf_counter() - t0) / len(new))
    stats.rounds += len(new)
    stats.plain_rounds += len(new)
    return new

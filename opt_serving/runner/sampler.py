"""The last stage's token choice: the tied LM head and per-slot sampling state, for the decode slots.

Lives with the stage that holds the LM head (the whole model on one device; the last pipeline stage
otherwise), so hidden states never leave it: a step hands on only the chosen tokens and their scores.
Slots are split into groups (the pipeline's micro-batches); each group has its own state arrays, so a
group is chosen for while the others are still in the stages. Structured output's matchers live here too
(runner/grammar.py): a step's masks are made from them just before it, and they take its tokens just after.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import Backend, sampling
from opt_serving.runner.grammar import Matchers
from opt_serving.runner.types import (MAX_BAD_WORD_LEN, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS,
                                      DecodeStep, SlotSettings)
from opt_serving.model import opt


# positions a prompt-score call computes (Sampler.prompt_scores): its logits [P, V] float32 are 26 MB at OPT's
# vocabulary; the head's weights are read once a block, a few percent of its products at P = 128
SCORE_BLOCK = 128


def settings_rows(rows: Sequence[SlotSettings], batch: int) -> sampling.Settings:
    """`sampling.Settings` of `batch` rows: these requests' settings, then defaults."""
    rows = list(rows) + [SlotSettings()] * (batch - len(rows))
    bad = np.full((batch, MAX_BAD_WORDS, MAX_BAD_WORD_LEN), -1, np.int32)
    for r, s in enumerate(rows):
        if len(s.bad_words_ids) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_LEN for w in s.bad_words_ids):
            raise ValueError(f"at most {MAX_BAD_WORDS} bad words of up to {MAX_BAD_WORD_LEN} tokens each")
        for i, w in enumerate(s.bad_words_ids):
            bad[r, i, :len(w)] = w
        if len(s.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
    col = lambda f: [f(s) for s in rows]  # noqa: E731
    settings = sampling.make_settings(
        batch, temperature=col(lambda s: s.temperature), top_k=col(lambda s: s.top_k),
        top_p=col(lambda s: s.top_p), min_p=col(lambda s: s.min_p),
        repetition_penalty=col(lambda s: s.repetition_penalty),
        presence_penalty=col(lambda s: s.presence_penalty),
        frequency_penalty=col(lambda s: s.frequency_penalty),
        no_repeat_ngram_size=col(lambda s: s.no_repeat_ngram_size), min_new_tokens=col(lambda s: s.min_tokens),
        eos_token_id=col(lambda s: s.stop_token_ids[0] if s.stop_token_ids else -1),
        seed=col(lambda s: s.seed % 2 ** 63), logit_bias=col(lambda s: s.logit_bias), bias_width=MAX_LOGIT_BIAS)
    return settings.replace(bad_words=bad)


def no_masks(rows: int, vocab: int):
    """The structured-output masks of a step with no constrained row: (bitmask [rows, W], constrained [rows])."""
    return np.zeros((rows, (vocab + 31) // 32), np.int32), np.zeros(rows, np.bool_)


def prompt_state(ids, mask, lengths, rows: int, history_len: int, vocab: int) -> sampling.State:
    """Sampling state for k right-padded prompts (ids, mask [k, n]; lengths [k]) in the first k of `rows`
    rows: history = the prompt (pads as 0), seen = its real tokens."""
    k, n = ids.shape
    history = jnp.zeros((rows, history_len), jnp.int32).at[:k, :n].set(ids * mask)
    at = jnp.broadcast_to(jnp.arange(k)[:, None], (k, n))
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[at, jnp.where(mask > 0, ids, vocab)].set(True, mode="drop")
    length = jnp.zeros((rows,), jnp.int32).at[:k].set(lengths)
    return sampling.State(history=history, length=length, prompt_length=length, seen=seen,
                          counts=jnp.zeros((rows, vocab), jnp.int32))


def chunked_first(h, at, ids, mask, lengths, history_len: int, vocab: int):
    """A chunked prefill's last chunk h [1, C, D] -> the whole prompt's (ids, mask [1, n]; lengths [1])
    sampling state and the hidden state [1, D] at its last position (`at` in the chunk), as a whole
    prefill's pass of one row makes them (Sampler.prefill)."""
    return prompt_state(ids, mask, lengths, 1, history_len, vocab), h[:, at]


def split_rows(tree, k: Optional[int] = None) -> list:
    """The first k (default: all) batch rows of every array in `tree`, as k batch-1 trees."""
    if k is None:
        k = jax.tree_util.tree_leaves(tree)[0].shape[0]
    return [jax.tree_util.tree_map(lambda a: a[j:j + 1], tree) for j in range(k)]


def raw_scores(logits):
    """The model's own log-probabilities (before any processor) and the top alternatives, per row."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, MAX_TOP_LOGPROBS)
    return lp, top_ids.astype("int32"), top_lp


def token_scores(logits, tok, want_top):
    """The chosen tokens' log-probabilities [B] and, when `want_top`, the top alternatives ([B, K] ids
    and log-probabilities; ids -1 otherwise). Each pass over [B, V] costs milliseconds on a CPU at
    batch 32, so neither the full log-softmax nor an unwanted top-k is materialised."""
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B]
    lp = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - lse

    def top():
        vals, ids = jax.lax.top_k(logits, MAX_TOP_LOGPROBS)
        return ids.astype(jnp.int32), vals - lse[:, None]

    return lp, *jax.lax.cond(want_top, top, lambda: no_top(logits.shape[0]))


def no_top(b: int):
    """No top alternatives for b rows: ids -1 [b, K], log-probabilities 0 [b, K]."""
    return jnp.full((b, MAX_TOP_LOGPROBS), -1, jnp.int32), jnp.zeros((b, MAX_TOP_LOGPROBS), jnp.float32)


def _choice(backend: Backend, history_len: int, vocab: int):
    """The sampler's token choice, not jitted: (choose, choose_joining, scores_block)."""
    L, V = history_len, vocab

    def choose(params, h, state, settings, active, want_scores, want_top, allowed=None):
        """One token per row from the final hidden states h [B, D], scored when `want_scores`, appended
        to the rows that are `active`; `allowed`: structured output's masks (sampling.allow_only), or None.
        When no row wants scores and every active row takes the plain argmax, the step skips the sampling
        processors and the scores (opt.lm_argmax: the logits and one argmax, or with the screened greedy
        head not even the logits, a constrained row's argmax over its allowed tokens); the scores are then NaN.
        The scores are the model's own, unmasked."""
        def full():
            logits = opt.lm_logits(params, h, backend)  # [B, V]
            tok, _ = sampling.sample(logits, state, settings, backend.argmax, allowed)
            return (tok, *token_scores(logits, tok, want_top))

        def plain():
            tok = opt.lm_argmax(params, h, sampling.held_back(state, settings), backend, allowed)
            return (tok, jnp.full(tok.shape, jnp.nan, jnp.float32), *no_top(h.shape[0]))
        out = jax.lax.cond(~want_scores & sampling.plain_argmax(state, settings, active), plain, full)
        # free slots keep their state, so their positions never run past the cache
        state = sampling.update_state(state, out[0], active)
        return state, out

    def join(state, settings, active, prompts, mask, lengths, row_settings, rows):
        """Prompts joining rows of the group (rows [J]; out of range: none) start their sampling state."""
        rows_state = prompt_state(prompts, mask, lengths, prompts.shape[0], L, V)
        put = lambda a, r: a.at[rows].set(r.astype(a.dtype), mode="drop")  # noqa: E731
        return (jax.tree_util.tree_map(put, state, rows_state), jax.tree_util.tree_map(put, settings, row_settings),
                active.at[rows].set(True, mode="drop"))

    def choose_joining(params, h, state, settings, active, want_scores, want_top, allowed, joining):
        # the joining rows' state first, in the same computation: dispatched apart, it would run beside the
        # step's products (it does not wait for them) and slow them down
        state, settings, active = join(state, settings, active, *joining)
        state, out = choose(params, h, state, settings, active, want_scores, want_top, allowed)
        return state, settings, active, out

    def scores_block(params, h, next_ids):
        """SCORE_BLOCK positions' prompt scores: h [P, D] their final hidden states, next_ids [P] the token
        after each -> that token's logprob and rank (vLLM's: 1 + the tokens above it) [P], the top
        alternatives (ids, logprobs [P, K])."""
        plp, ptop, ptop_lp = raw_scores(opt.lm_logits(params, h, backend))  # [P, V], [P, K] x 2
        lp = jnp.take_along_axis(plp, next_ids[:, None], axis=-1)[:, 0]
        return lp, jnp.sum(plp >= lp[:, None], axis=-1, dtype=jnp.int32), ptop, ptop_lp

    return choose, choose_joining, scores_block


def _drafts_check(backend: Backend):
    """Speculative decoding's check of a step's drafts, not jitted (Sampler._check)."""
    def check(params, hv, state, settings, active, chosen, draft_ids, draft_at):
        """Speculative decoding's check (runner/ngram.py): hv [E, D] the drafts' final hidden states, draft_ids and
        draft_at [B, K] each row's drafts and where in hv each is (-1: none), `chosen` [B] the step's own tokens (in
        `state` already) -> the state with the kept drafts' successors appended, each draft's successor [B, K] (the
        token plain decoding would choose there: `successors`), and the drafts kept [B]: those up to the first that
        differs from the choice before it. A sampled row's draft is kept with the probability the target gives it,
        which for a draft of one certain token (a lookup's) is the rejection rule of speculative sampling."""
        e, k = hv.shape[0], draft_at.shape[1]
        # draft i's successor is chosen after state.length + i tokens (as held_back reads a state that long)
        length = state.length[:, None] + jnp.arange(k)[None]  # [B, K]
        banned = ((length < settings.min_length[:, None])
                  | (length - state.prompt_length[:, None] < settings.min_new_tokens[:, None]))
        held = jnp.where(banned & (settings.eos_token_id[:, None] >= 0), settings.eos_token_id[:, None], -1)
        at = jnp.where(draft_at >= 0, draft_at, e)  # [B, K] each draft's entry of hv (e: none, dropped)
        per_entry = lambda a: jnp.zeros(e, jnp.int32).at[at].set(a, mode="drop")  # noqa: E731 [B, K] -> [E]
        rows = per_entry(jnp.broadcast_to(jnp.arange(at.shape[0], dtype=jnp.int32)[:, None], at.shape))
        exclude = jnp.full(e, -1, jnp.int32).at[at].set(held, mode="drop")
        chosen_e = successors(params, hv, settings, rows, per_entry(length), exclude, backend)  # [E]
        after = jnp.where(draft_at >= 0, chosen_e[jnp.maximum(draft_at, 0)], -1)  # [B, K]
        before = jnp.concatenate([chosen[:, None], after[:, :-1]], axis=1)  # what each draft must equal
        kept = jnp.cumprod((draft_ids >= 0) & (draft_ids == before), axis=1).astype(jnp.bool_)
        for i in range(kept.shape[1]):
            state = sampling.update_state(state, after[:, i], active & kept[:, i])
        return state, after, kept.sum(axis=1, dtype=jnp.int32)

    return check


def successors(params, hv, settings, rows, length, exclude, backend: Backend):
    """The drafts' successors: hv [E, D] their hidden states, of `rows` [E] with `length` [E] tokens before each
    successor, `exclude` [E] a token left out (-1: none) -> int32 [E]: the greedy choice, or a sampled row's draw
    from its warped distribution keyed as plain decoding keys it there (sampling.choose_at), so a row gets plain
    decoding's tokens either way. The logits are made only where some row samples."""
    s = jax.tree_util.tree_map(lambda a: a[rows], settings)

    def drawn():
        scores = sampling.warp(sampling.leave_out(opt.lm_logits(params, hv, backend).astype(jnp.float32), exclude), s)
        return sampling.choose_at(scores, s, length, backend.argmax)
    return jax.lax.cond(jnp.any(s.temperature > 0), drawn, lambda: opt.lm_argmax(params, hv, exclude, backend))


class Sampler:
    """Token choice over `groups` groups of `rows` slots: state/settings/active arrays per group, and the
    rows of prefilled requests waiting to be inserted (by handle). `backend`: the one the params passed to
    its calls were prepared for."""

    def __init__(self, cfg, backend: Backend, rows: int, groups: int, max_seq_len: int, jit=jax.jit):
        self.cfg, self.rows, self.max_seq_len = cfg, rows, max_seq_len
        L, V = max_seq_len, cfg.vocab_size
        empty = jnp.zeros((rows, 1), jnp.int32)

        def fresh():  # own buffers per leaf (init_state shares one for length and prompt_length): donated
            return jax.tree_util.tree_map(jnp.copy, sampling.init_state(empty, empty, V, L))
        self.state = [fresh() for _ in range(groups)]
        self.settings = [settings_rows([], rows) for _ in range(groups)]
        self.active = [jnp.zeros(rows, jnp.bool_) for _ in range(groups)]
        self.pending: dict[int, tuple] = {}  # handle -> (row state, row settings)
        self.grammar = Matchers(groups, V)  # structured output's matchers
        self._no_masks: dict[int, tuple] = {}  # rows -> no_masks(rows), on the device once

        def first(h, ids, mask, lengths, state_rows):
            """k right-padded prompts' final hidden states h [k, n, D] -> their sampling state padded to
            `state_rows` rows and the last positions' hidden states [state_rows, D] (their prompt scores, when
            asked, are `prompt_scores`')."""
            k, n = ids.shape
            last = jnp.zeros((state_rows, h.shape[-1]), h.dtype).at[:k].set(h[jnp.arange(k), lengths - 1])
            return prompt_state(ids, mask, lengths, state_rows, L, V), last

        def insert(state, settings, active, row_state, row_settings, slot):
            put = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=0)  # noqa: E731
            return (jax.tree_util.tree_map(put, state, row_state),
                    jax.tree_util.tree_map(put, settings, row_settings), active.at[slot].set(True))

        choose, choose_joining, scores_block = _choice(backend, L, V)
        self._check = jit(_drafts_check(backend), donate_argnums=(2,))
        self.choose_rows = choose  # traced inside the stage's decode steps taken in one call (StageSlots)
        self._scores_block = jit(scores_block)
        self._first = jit(first, static_argnums=(4,))
        self._choose_joining = jit(choose_joining, donate_argnums=(2, 3, 4))
        self._chunked_first = jit(functools.partial(chunked_first, history_len=L, vocab=V))
        self._choose = jit(choose, donate_argnums=(2,))
        self._insert = jit(insert, donate_argnums=(0, 1, 2))
        self._split_rows = jit(split_rows)  # a pass's sampling state and settings -> batch-1 rows
        self._free = jit(lambda active, slot: active.at[slot].set(False), donate_argnums=(0,))

    def settle_groups(self) -> None:
        """After warm-up, which runs group 0 alone: every other group's arrays as group 0's left them (its rows
        all free), committed to the device as arrays a step made are. Fresh ones are not, and jit compiles each
        apart: the first prompt joining another group compiled the joining step's sampler again, seconds of it."""
        for g in range(1, len(self.state)):
            self.state[g], self.settings[g], self.active[g] = jax.tree_util.tree_map(
                jnp.copy, (self.state[0], self.settings[0], self.active[0]))

    def prefill(self, params, handles: Sequence[int], h, ids, mask, lengths,
                settings: Sequence[SlotSettings], state_rows: int):
        """Choose the first token of each prompt in a prefill pass and keep its sampling row under its
        handle -> (tokens, logprobs, top ids, top logprobs) [k], and prompt scores (or None)."""
        state, last = self._first(h, ids, mask, lengths, state_rows)
        wanted = np.flatnonzero([s.prompt_logprobs for s in settings])
        prompt = None
        if len(wanted):  # position i scores token i + 1 (the last position's is not used)
            next_ids = np.roll(np.asarray(ids), -1, axis=1)
            prompt = self.prompt_scores(params, np.asarray(h)[wanted], next_ids[wanted], rows=wanted,
                                        batch=ids.shape[0])
        return self._first_tokens(params, handles, state, last, settings, state_rows), prompt

    def prefill_chunked(self, params, handle: int, h, at: int, ids, mask, lengths, settings: SlotSettings):
        """`prefill` for the last chunk of a prompt prefilled in chunks: h [1, C, D] its final hidden
        states, `at` the prompt's last position in it, ids and mask [1, L] the whole prompt -> the first
        token as `prefill` gives it (`chunk_scores` gives the prompt's scores a chunk at a time)."""
        state, last = self._chunked_first(h, np.int32(at), ids, mask, lengths)
        return self._first_tokens(params, [handle], state, last, [settings], 1)

    def chunk_scores(self, params, h, next_ids):
        """The prompt scores of a chunk's positions (h [1, C, D]; next_ids [1, C]: each position's next token)
        -> logprobs [C], ranks [C], top ids [C, K], top logprobs [C, K], as numpy."""
        return tuple(a[0] for a in self.prompt_scores(params, np.asarray(h), np.asarray(next_ids)))

    def prompt_scores(self, params, h, next_ids, rows=None, batch: Optional[int] = None):
        """Prompt scores of k rows of positions (h [k, n, D] numpy, next_ids [k, n]: the token after each) ->
        each next token's logprob and rank [k, n], the top alternatives (ids, logprobs [k, n, K]), as numpy;
        with `rows`, the k rows are those rows of `batch` (the others' scores zeros). SCORE_BLOCK positions a
        call, through one compiled program whatever the prompt's width: a whole pass's logits ([k, n, V]
        float32: 100 MB at 512 positions of OPT's vocabulary, and as much again for their log-softmax) are
        never made, and no width compiles a head of its own."""
        k, n, d = h.shape
        flat, ids = h.reshape(k * n, d), np.asarray(next_ids, np.int32).reshape(k * n)
        blocks = []
        for i in range(0, k * n, SCORE_BLOCK):
            hb = np.zeros((SCORE_BLOCK, d), flat.dtype)
            ib = np.zeros(SCORE_BLOCK, np.int32)
            m = min(SCORE_BLOCK, k * n - i)
            hb[:m], ib[:m] = flat[i:i + m], ids[i:i + m]
            blocks.append(self._scores_block(params, hb, ib))  # dispatched; read together below
        parts = [np.concatenate([np.asarray(b[j]) for b in blocks])[:k * n] for j in range(4)]
        out = tuple(a.reshape((k, n) + a.shape[1:]) for a in parts)
        if rows is None:
            return out
        full = tuple(np.zeros((batch,) + a.shape[1:], a.dtype) for a in out)
        for f, a in zip(full, out):
            f[rows] = a
        return full

    def _first_tokens(self, params, handles, state, last, settings: Sequence[SlotSettings], state_rows: int):
        """Choose the first tokens from the prompts' last hidden states and keep each sampling row (and each
        constrained prompt's matcher, which took its first token)."""
        k = len(settings)
        want_top = np.array([s.top_logprobs for s in settings] + [False] * (state_rows - k))
        want_scores = any(s.top_logprobs or s.logprob for s in settings)
        pass_settings = settings_rows(settings, state_rows)
        constrained = [(j, self.grammar.new(s.grammar)) for j, s in enumerate(settings) if s.grammar is not None]
        state, first = self._choose(params, last, state, pass_settings, np.arange(state_rows) < k,
                                    np.bool_(want_scores), np.bool_(want_top.any()),
                                    self._masks(constrained, state_rows))
        tok, lp, top_ids, top_lp = (np.asarray(a) for a in first)
        self.grammar.consume(constrained, tok)
        for j, m in constrained:
            self.grammar.pending[handles[j]] = m
        rows = self._split_rows((state, pass_settings)) if state_rows > 1 else [(state, pass_settings)]
        for j, handle in enumerate(handles):
            self.pending[handle] = rows[j]
        return tok[:k], lp[:k], np.where(want_top[:k, None], top_ids[:k], -1), top_lp[:k]

    def _masks(self, constrained, rows: int):
        """A step's structured-output masks over `rows` rows, its constrained ones (row, matcher) given."""
        masks = self.grammar.masks(constrained, rows)
        if masks is None:  # (the same arrays every step: nothing to copy to the device)
            masks = self._no_masks.get(rows)
            if masks is None:
                masks = self._no_masks[rows] = tuple(jax.device_put(a) for a in no_masks(rows, self.cfg.vocab_size))
        return masks

    def use_tokenizer(self, tokenizer_json: str, eos: int) -> None:
        """The tokenizer structured output's grammars are matched against (runner/grammar.py)."""
        self.grammar.use_tokenizer(tokenizer_json, eos)

    def insert(self, handle: int, group: int, row: int, keep: bool = False) -> None:
        row_state, row_settings = self.pending[handle] if keep else self.pending.pop(handle)
        self.state[group], self.settings[group], self.active[group] = self._insert(
            self.state[group], self.settings[group], self.active[group], row_state, row_settings, np.int32(row))
        self.grammar.insert(handle, group, row, keep)

    def drop(self, handle: int) -> None:
        self.pending.pop(handle, None)
        self.grammar.drop(handle)

    def constrained(self, group: int) -> bool:
        """Does a request in the group follow a grammar (its steps need their masks one at a time)?"""
        return self.grammar.constrained(group)

    def choose(self, params, h, step: DecodeStep):
        """-> (tokens, logprobs, top ids, top logprobs) of the step's group's rows (final hidden states h [rows, D]),
        as numpy; where rows drafted (h [rows + E, D]), also `check`'s successors [rows, K] and kept [rows]. With
        the step's `join`, its prompts take their rows first: their tokens are their first.
        Constrained rows choose within their masks, and their matchers take the tokens."""
        g, join, packed = step.group, step.join, step.packed
        want_scores, want_top = np.bool_(step.want_scores), np.bool_(step.want_top)
        drafted = packed is not None and packed.verify is not None
        if drafted:  # [B + E, D]: the rows' tokens, then the drafts'
            h, hv = h[:self.rows], h[self.rows:]
        if join is not None:  # a constrained prompt's matcher starts with its row
            for j, s in enumerate(join.settings):
                if s.grammar is not None:
                    self.grammar.slots[g][int(join.last_rows[j])] = self.grammar.new(s.grammar)
        constrained = self.grammar.slot_rows(g)
        masks = self._masks(constrained, self.rows)
        if join is None:
            self.state[g], out = self._choose(params, h, self.state[g], self.settings[g], self.active[g],
                                              want_scores, want_top, masks)
        else:
            joining = (join.prompts, join.mask, join.lengths, settings_rows(join.settings, join.prompts.shape[0]),
                       join.last_rows)
            self.state[g], self.settings[g], self.active[g], out = self._choose_joining(
                params, h, self.state[g], self.settings[g], self.active[g], want_scores, want_top, masks, joining)
        if drafted:
            self.state[g], after, kept = self._check(params, hv, self.state[g], self.settings[g], self.active[g],
                                                     out[0], packed.draft_ids, packed.draft_at)
            out = (*out, after, kept)
        out = tuple(jax.device_get(out))  # every output's copy started at once: one wait, not one per output
        self.grammar.consume(constrained, out[0])
        return out

    def free(self, group: int, row: int) -> None:
        self.active[group] = self._free(self.active[group], np.int32(row))
        self.grammar.free(group, row)

"""Prefills of the slot model (runner/slots.py's `Slots`, which takes them from `Prefills`): a prompt's pass through
the stages before it takes a slot, whole or a chunk at a time, and the prefix cache it reads and fills.

Whole prompts (`prefill_batch`): prompts of a short bucket share passes of a fixed number of rows, longer ones go
one at a time; each pass's first tokens are chosen on the last stage and its caches kept there under a handle
until inserted (`Slots.insert`) or discarded.

Chunked prefill (`open_prefill`, `prefill_chunk`): a long prompt goes through the stages a fixed number of
tokens at a time (steps.extend_step) into its own batch-1 cache (job_size), so the engine can run decode steps between
its chunks; the last chunk, padded only to the next of `chunk_widths`, chooses the first token.

Prefix caching (`prefix_blocks`; runner/prefix.py holds the index): the KV of every prefilled prompt's full
blocks of 16 tokens is written into each stage's pool (`store_prefix`) and kept after the request ends, until
least recently used blocks make room for others. A prompt that starts with cached blocks (its longest run of
them, always leaving its last token to compute) is prefilled as a chunked prompt whose cache starts as those
blocks' entries (`StageSlots.prefill_chunk` gathers them): only the rest is computed. `prompt_cost` tells the
scheduler how many tokens that is. Joining prompts (a handful of tokens) neither use nor fill the cache. A
prompt whose scores are asked (echo with logprobs) reuses only blocks whose scores are kept too, and computes
from its last cached token on, whose hidden state scores the first token it computes.
"""
from __future__ import annotations

import collections
from typing import Optional, Sequence

import numpy as np

from opt_serving.runner.buckets import cache_bucket, chunk_width, job_size, prefill_bucket
from opt_serving.runner.prefix import BLOCK_SIZE
from opt_serving.runner.types import MAX_TOP_LOGPROBS, PartialPrefill, Prefix, SlotSettings, TokenInfo


class Prefills:
    """The prefill calls of `Slots` (the slot model: runner.types.SlotModel). They use its `cfg`, `stages`,
    `max_seq_len`, `batch_rows` and `pass_rows` (rows of a short bucket's pass and of its sampling state),
    `prefix` (the prefix cache's index, or None), `adapters` (LoRA), `hit_chunk`, `_handles` (a counter) and
    `_to_all`."""

    def prefill(self, tokens: Sequence[int], settings: SlotSettings) -> Prefix:
        return self.prefill_batch([tokens], [settings])[0]

    def prefill_batch(self, prompts: Sequence[Sequence[int]], settings: Sequence[SlotSettings]) -> list[Prefix]:
        """`prefill` for several requests: prompts of a short bucket (`batch_rows`) share passes of a fixed
        number of rows, longer ones go one at a time, and a prompt with a cached prefix computes only the rest
        (in chunks: `open_prefill`). The passes are sent before any is awaited, so a pipeline's stages work
        on consecutive passes at once; a prompt that reuses another's prefix comes after it."""
        groups: dict[int, list[int]] = collections.defaultdict(list)
        out: list[Optional[Prefix]] = [None] * len(prompts)
        passes = []
        try:
            for i, tokens in enumerate(prompts):
                bucket = prefill_bucket(len(tokens), self.max_seq_len)
                if bucket in self.batch_rows:
                    groups[bucket].append(i)
                elif self._cached_blocks(tokens, settings[i], touch=False):
                    out[i] = self._run(self.open_prefill(tokens, settings[i], self.hit_chunk))
                else:
                    passes.append(([i], self._send_prefill(bucket, [tokens], [settings[i]])))
            for bucket, todo in groups.items():
                rows = self.batch_rows[bucket]
                for at in range(0, len(todo), rows):
                    chunk = todo[at:at + rows]
                    passes.append((chunk, self._send_prefill(bucket, [prompts[i] for i in chunk],
                                                             [settings[i] for i in chunk])))
            for chunk, (handles, future, _) in passes:
                first, scores = self.stages.get(future)
                for j, i in enumerate(chunk):
                    out[i] = self._prefix(prompts[i], settings[i], handles[j], first, scores, j)
        except BaseException:  # what the passes would have written never came: their blocks hold nothing
            if self.prefix is not None:
                self.prefix.forget([b for _, (_, _, kept) in passes for b in kept])
            for _, (handles, _, _) in passes:
                for handle in handles:
                    self.adapters.drop(handle)
            raise
        return out

    def _send_prefill(self, bucket: int, prompts, settings):
        rows = self.batch_rows.get(bucket, 1)
        state_rows = self.pass_rows if rows > 1 else 1
        ids = np.full((rows, bucket), self.cfg.pad_token_id, np.int32)  # right-padded, then rows of one pad
        mask = np.zeros((rows, bucket), np.int32)
        lengths = np.ones(rows, np.int32)
        mask[:, 0] = 1
        for j, tokens in enumerate(prompts):
            ids[j, :len(tokens)] = tokens
            mask[j, :len(tokens)] = 1
            lengths[j] = len(tokens)
        handles = [next(self._handles) for _ in prompts]
        try:
            adapters = self.adapters.pass_rows([self.adapters.hold(h, s) for h, s in zip(handles, settings)], rows)
        except BaseException:
            for handle in handles:
                self.adapters.drop(handle)
            raise
        x = ids
        for i in range(self.stages.n):
            x = self.stages.call(i, "prefill", handles, x, ids, mask, lengths, list(settings), state_rows, adapters)
        size = cache_bucket(bucket, self.max_seq_len)
        kept = [b for handle, tokens, s in zip(handles, prompts, settings)
                for b in self._keep_prefix(handle, tokens, size, self._keys(tokens, s))]
        return handles, x, kept

    # ---- the prefix cache ----
    def prompt_cost(self, tokens: Sequence[int], settings: SlotSettings) -> int:
        """The prompt tokens a prefill of it would compute now: those after its cached prefix."""
        return len(tokens) - self._cached_tokens(len(self._cached_blocks(tokens, settings, touch=False)), settings)

    def _keys(self, tokens: Sequence[int], settings: SlotSettings) -> list:
        """The prompt's prefix-cache keys, which start with its LoRA adapter's (none: the base model's)."""
        return self.prefix.keys(tokens, self.adapters.salt(settings)) if self.prefix is not None else []

    def _cached_blocks(self, tokens: Sequence[int], settings: SlotSettings, touch: bool = True,
                       keys: Optional[list] = None) -> list[int]:
        """The pool blocks of the prompt's cached prefix."""
        if self.prefix is None or len(tokens) <= BLOCK_SIZE:
            return []
        keys = keys if keys is not None else self._keys(tokens, settings)
        usable = keys[:(len(tokens) - 1) // BLOCK_SIZE]  # the last token is always computed: it gives the first
        return self.prefix.match(usable, scored=settings.prompt_logprobs, touch=touch)

    @staticmethod
    def _cached_tokens(blocks: int, settings: SlotSettings) -> int:
        """Tokens a prompt reuses from `blocks` cached blocks: with its scores asked, the last of them is
        computed again (its hidden state scores the next token)."""
        return max(blocks * BLOCK_SIZE - settings.prompt_logprobs, 0)

    def _keep_prefix(self, handle: int, tokens: Sequence[int], size: int, keys: list) -> list[int]:
        """Claim pool blocks for the prompt's full blocks not cached yet and have every stage write them from
        the request's cache (`size` entries) -> the blocks claimed."""
        if self.prefix is None or size < BLOCK_SIZE or len(tokens) < BLOCK_SIZE:
            return []
        claims = self.prefix.claim(keys)
        if claims:
            ids = np.full(size // BLOCK_SIZE, self.prefix.blocks, np.int32)  # past the pool: not written
            for j, b in claims:
                ids[j] = b
            self._to_all("store_prefix", handle, ids)
        return [b for _, b in claims]

    def _keep_scores(self, tokens: Sequence[int], scores: tuple, settings: SlotSettings) -> None:
        """Keep a prompt's echo scores (per token: logprob [n], rank [n], top ids and logprobs [n, K]) with its cached
        blocks that have none."""
        if self.prefix is None:
            return
        keys = self._keys(tokens, settings)
        bs = BLOCK_SIZE
        for j, b in enumerate(self.prefix.match(keys, touch=False)):
            if self.prefix.scores(b) is None:
                self.prefix.set_scores(b, tuple(np.array(a[j * bs:(j + 1) * bs]) for a in scores))

    # ---- chunked prefill: a long prompt a chunk at a time, between decode steps ----
    def open_prefill(self, tokens: Sequence[int], settings: SlotSettings, chunk: int,
                     size: Optional[int] = None) -> PartialPrefill:
        """A prompt to prefill `chunk` tokens at a time (`prefill_chunk`) into a cache of its size (`job_size`;
        `size`: another, as warm-up asks), from the end of its cached prefix on; nothing runs yet.
        `discard_partial` lets it go."""
        keys = self._keys(tokens, settings)
        blocks = self._cached_blocks(tokens, settings, keys=keys)
        done = self._cached_tokens(len(blocks), settings)
        size = size or job_size(len(tokens), self.max_seq_len)
        handle = next(self._handles)
        self.adapters.hold(handle, settings)
        return PartialPrefill(list(tokens), settings, min(chunk, self.max_seq_len), size, handle,
                              done=done, cached=done, blocks=blocks, keys=keys)

    def prefill_chunk(self, job: PartialPrefill) -> Optional[Prefix]:
        """Prefill the prompt's next chunk (through every stage; it has finished when this returns) ->
        None, or after the last chunk the Prefix `prefill` gives."""
        n, start = len(job.tokens), job.done
        c = chunk_width(n - start, job.chunk)
        part = job.tokens[start:start + c]
        ids = np.full((1, c), self.cfg.pad_token_id, np.int32)
        ids[0, :len(part)] = part
        mask = (np.arange(c) < len(part)).astype(np.int32)[None]
        gather = next_ids = final = None
        if start == job.cached and job.blocks:  # the first chunk: its cache starts as the cached blocks
            src = np.zeros(job.size // BLOCK_SIZE, np.int32)
            src[:len(job.blocks)] = job.blocks
            gather = (src, np.int32(len(job.blocks) * BLOCK_SIZE))
        if job.settings.prompt_logprobs:  # each position scores the token after it
            after = job.tokens[start + 1:start + c + 1]
            next_ids = np.zeros((1, c), np.int32)
            next_ids[0, :len(after)] = after
        if start + c >= n:  # the last chunk: the whole prompt, for its sampling state
            whole = np.full((1, self.max_seq_len), self.cfg.pad_token_id, np.int32)
            whole[0, :n] = job.tokens
            final = (n - 1 - start, whole, (np.arange(self.max_seq_len) < n).astype(np.int32)[None],
                     np.array([n], np.int32), job.settings)
        x = ids
        for i in range(self.stages.n):
            x = self.stages.call(i, "prefill_chunk", job.state, x, start, mask, job.size, final, gather, next_ids,
                                 self.adapters.pass_rows([self.adapters.held(job.state)], 1))
        first, scores = self.stages.get(x)  # waited for: a decode step sent next runs after it anyway
        job.done = min(start + c, n)
        if scores is not None:
            job.scores.append(tuple(a[:len(part)] for a in scores))
        if final is None:
            return None
        self._keep_prefix(job.state, job.tokens, job.size, job.keys)
        prompt = None
        if job.settings.prompt_logprobs:
            per_token = self._job_scores(job)
            self._keep_scores(job.tokens, per_token, job.settings)
            prompt = _prompt_infos(job.tokens, per_token)
        tok, lp, top_ids, top_lp = first
        return Prefix(length=n, first=_first_info(tok, lp, top_ids, top_lp, 0), prompt=prompt, state=job.state,
                      settings=job.settings, cached=job.cached, tokens=tuple(job.tokens))

    def _run(self, job: PartialPrefill) -> Prefix:
        """A job's every chunk -> its Prefix (a job that fails lets its rows go)."""
        try:
            while True:
                prefix = self.prefill_chunk(job)
                if prefix is not None:
                    return prefix
        except BaseException:
            self.discard_partial(job)
            raise

    def _job_scores(self, job: PartialPrefill) -> tuple:
        """A job's prompt's echo scores per token (logprob [n], rank [n], top ids, top logprobs [n, K]): its
        cached blocks' kept ones, then its chunks' (position i scores token i + 1)."""
        n, k = len(job.tokens), MAX_TOP_LOGPROBS
        out = (np.full(n, np.nan, np.float32), np.zeros(n, np.int32), np.full((n, k), -1, np.int32),
               np.zeros((n, k), np.float32))
        for j, b in enumerate(job.blocks):
            at = slice(j * BLOCK_SIZE, (j + 1) * BLOCK_SIZE)
            for a, kept in zip(out, self.prefix.scores(b)):
                a[at] = kept
        computed = [np.concatenate(a) for a in zip(*job.scores)]  # positions cached.., tokens cached + 1..
        for a, c in zip(out, computed):
            a[job.cached + 1:] = c[:n - 1 - job.cached]
        return out

    def discard_partial(self, job: PartialPrefill) -> None:
        self.adapters.drop(job.state)
        self._to_all("drop", job.state)

    def _prefix(self, tokens, s: SlotSettings, handle: int, first, scores, j: int) -> Prefix:
        """Row j of a whole prefill pass as a Prefix (its echo scores kept with its cached blocks)."""
        prompt = None
        if s.prompt_logprobs:
            n = len(tokens)
            plp, prank, ptop, ptop_lp = scores  # position i scores token i + 1
            per_token = (np.concatenate([[np.nan], plp[j, :n - 1]]).astype(np.float32),
                         np.concatenate([[0], prank[j, :n - 1]]).astype(np.int32),
                         np.concatenate([np.full((1, ptop.shape[-1]), -1), ptop[j, :n - 1]]).astype(np.int32),
                         np.concatenate([np.zeros((1, ptop.shape[-1])), ptop_lp[j, :n - 1]]).astype(np.float32))
            self._keep_scores(tokens, per_token, s)
            prompt = _prompt_infos(tokens, per_token)
        return Prefix(length=len(tokens), first=_first_info(*first, j), prompt=prompt, state=handle, settings=s,
                      tokens=tuple(tokens))

    def discard(self, prefix: Prefix) -> None:
        self.adapters.drop(prefix.state)
        self._to_all("drop", prefix.state)


def _first_info(tok, lp, top_ids, top_lp, j: int) -> TokenInfo:
    """Row j of a prefill's first tokens (tokens, logprobs, top ids and logprobs) as a TokenInfo."""
    top = [(int(t), float(v)) for t, v in zip(top_ids[j], top_lp[j]) if t >= 0]
    return TokenInfo(int(tok[j]), float(lp[j]), top)


def _prompt_infos(tokens, per_token: tuple) -> list[TokenInfo]:
    """A prompt's echo scores (per token: logprob [n], rank [n], top ids and logprobs [n, K]) as TokenInfos;
    the first token has none."""
    lp, rank, ids, lps = per_token
    return [TokenInfo(int(tokens[0]), None)] + [
        TokenInfo(int(tokens[i]), float(lp[i]), list(zip(ids[i].tolist(), lps[i].tolist())), int(rank[i]))
        for i in range(1, len(tokens))]

"""Admission, for the engine's scheduler (scheduler.py): which queued requests start in an iteration, and how
their prompts are prefilled.

A prompt with at most `prefill_chunk` tokens to compute (past what the slot model has cached of it,
`prompt_cost`) is prefilled whole, several together where the slot model has `prefill_batch`. A longer one is
prefilled a chunk at a time (vLLM's chunked prefill), so decode steps of the running requests come between its
chunks, where a whole prefill of it would hold every stream up for the length of the pass. Each iteration
prefills up to a budget of prompt tokens (`prefill_budget`, vLLM's max_num_batched_tokens), whole prompts and
chunks together, in the order the prompts came, at least one prompt or chunk: a burst of prompts is prefilled
in few passes between decode steps (each stream waits at most about a budget's pass for its next token),
not one chunk between every two steps (the first tokens of the last prompts of a burst then waited behind
every decode step the chunks of the others were interleaved with). Every prompt being prefilled in chunks
holds the free slot it will take, so the short prompts queued behind a long one start beside it instead of
waiting for it.
"""
from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from opt_serving.runner.types import Prefix

log = logging.getLogger(__name__)

# the default chunk (tokens): on ragged stages the most prompt tokens a decode step carries (a longer prompt rides
# several steps; a burst of prompts fills each step: benchmark/README.md), elsewhere a longer prompt is prefilled a
# chunk at a time between decode steps
PREFILL_CHUNK = 512
# the default prompt tokens prefilled in an engine iteration, whole prompts and chunks (vLLM's CPU default of
# max_num_batched_tokens for its API server): the running streams wait about one such pass between two tokens
PREFILL_BUDGET = 2048
# the default decode steps in one call while no queued request could take a slot (engine.Engine; `serve`,
# load_generator): the host's work of a call is paid once for them, and a newcomer waits at most that many
# steps for its prefill
DECODE_STEPS = 4
# ... while they take at most this long (seconds, as the steps so far went): long steps (a large model, long
# contexts, prompts prefilled beside them) go one a call, so a newcomer never waits long behind a call
DECODE_CALL_S = 0.15


class ChunkedPrefill:
    """The requests whose prompts are being prefilled a chunk at a time (`reqs`, oldest first), over a slot
    model with `open_prefill`, `prefill_chunk` and `discard_partial` (runner.slots.Slots); `chunk` is None
    where chunked prefill is off or the slot model has none. `budget`: the prompt tokens an iteration
    prefills, whole prompts (`take`) then chunks (`advance`: at least one chunk)."""

    def __init__(self, model, chunk: Optional[int], budget: Optional[int] = PREFILL_BUDGET):
        self.model = model
        self.chunk = chunk if chunk and chunk > 0 and model.chunked_prefill else None
        self.budget = max(budget or PREFILL_BUDGET, self.chunk or 0)
        self.spent = 0  # prompt tokens of this iteration's whole prefills (take)
        self.chunks = self.computed = 0  # chunks run and the prompt tokens they computed, since the start
        self._jobs: dict = {}  # request -> its job (open_prefill's), None until its first chunk; oldest first

    @property
    def held(self) -> int:
        """The slots held (one per prompt being prefilled); safe to read from any thread."""
        return len(self._jobs)

    @property
    def reqs(self) -> list:
        """(The engine thread only.) The requests being prefilled, oldest first."""
        return list(self._jobs)

    def wants(self, req) -> bool:
        """Is the request's prompt prefilled in chunks? More than a chunk to compute (past what the slot
        model has cached of it: `prompt_cost`), and not scored (a scored prompt that misses the cache is
        prefilled whole)."""
        if self.chunk is None or len(req.prompt) <= self.chunk or req.settings.prompt_logprobs:
            return False
        if self.model.joins_in_parts and self._joins(req):  # (it joins decode steps a part at a time)
            return False
        return self._to_compute(req) > self.chunk

    def _joins(self, req) -> bool:
        return self.model.joins_steps and req.settings.max_tokens > 0 and self.model.joinable(req.prompt, req.settings)

    def cost(self, req) -> int:
        """The prompt tokens the request's prefill computes: past its cached prefix (`prompt_cost`), none for
        a prompt that joins a decode step (its tokens ride in the step's products)."""
        if self._joins(req):
            return 0
        return self._to_compute(req)

    def _to_compute(self, req) -> int:
        """The prompt's tokens past what the slot model has cached of it (`prompt_cost`)."""
        return self.model.prompt_cost(req.prompt, req.settings)

    def add(self, req) -> None:
        self._jobs[req] = None

    def advance(self, started=lambda req: None) -> list[tuple]:
        """Prefill this iteration's chunks, oldest prompt first -> (request, its Prefix, or the exception that
        stopped it) for each prompt whose last chunk ran (it is no longer held). A cancelled request is let
        go with the cache rows its chunks filled, and reported with a None Prefix. `started(req)` is called
        before a prompt's first chunk runs."""
        done, spent = [], min(self.spent, self.budget - (self.chunk or 0))  # (at least one chunk)
        for req in list(self._jobs):
            if spent >= self.budget:
                break
            if req.cancelled:
                self.drop(req)
                done.append((req, None))
                continue
            try:
                if self._jobs[req] is None:
                    started(req)
                    self._jobs[req] = self.model.open_prefill(req.prompt, req.settings, self.chunk)
                prefix, job = None, self._jobs[req]
                while prefix is None and spent < self.budget:
                    before = job.done
                    prefix = self.model.prefill_chunk(job)
                    spent += job.done - before  # (a last chunk, or one after a cached prefix, may be short)
                    self.chunks += 1
                    self.computed += job.done - before
            except Exception as e:  # this request fails, the others carry on
                log.exception("request %d: chunked prefill failed", req.id)
                self.drop(req)
                done.append((req, e))
                continue
            if prefix is not None:
                del self._jobs[req]
                done.append((req, prefix))
        return done

    def drop(self, req) -> None:
        """Let the request go (cancelled or failed), and the cache rows its chunks filled."""
        job = self._jobs.pop(req, None)
        if job is not None:
            try:
                self.model.discard_partial(job)
            except Exception:  # the slot model may be the thing that broke
                log.exception("could not let a chunked prefill's rows go")


def take(queue: collections.deque, free: int, chunked: ChunkedPrefill) -> list:
    """(Under the engine's lock.) The queued requests to prefill whole now, first come first served, at
    most `free` (the free slots, less those the prompts being prefilled in chunks hold) and within the
    iteration's budget of prompt tokens (at least one); a long prompt (`chunked.wants`) joins `chunked`,
    taking a free slot too, its chunks prefilled with what the budget leaves (`advance`)."""
    admit, spent = [], 0
    while queue and free > 0:
        req = queue[0]
        if req.cancelled:
            queue.popleft()
            continue
        if chunked.wants(req):
            chunked.add(req)
        else:
            cost = chunked.cost(req)
            if admit and spent + cost > chunked.budget:
                break
            admit.append(req)
            spent += cost
        queue.popleft()
        free -= 1
    chunked.spent = spent
    return admit


def passes(model, reqs: list) -> int:
    """The prefill calls `prefill_whole` makes of the slot model for these requests (at most)."""
    return 1 if model.batched_prefill and len(reqs) > 1 else len(reqs)


def prefill_whole(model, reqs: list) -> list:
    """A Prefix (or the exception that stopped it) per request: together where the slot model has
    `prefill_batch`, and one by one if that fails, so only the request that caused it fails."""
    if model.batched_prefill and len(reqs) > 1:
        try:
            return model.prefill_batch([r.prompt for r in reqs], [r.settings for r in reqs])
        except Exception:
            log.exception("prefilling %d requests together failed; prefilling them one by one", len(reqs))
    out = []
    for req in reqs:
        try:
            out.append(model.prefill(req.prompt, req.settings))
        except Exception as e:
            out.append(e)
    return out

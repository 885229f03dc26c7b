"""Admission, for the engine's scheduler (engine.py): which queued requests start in an iteration, and how
their prompts are prefilled.

A prompt of at most `prefill_chunk` tokens is prefilled whole, several together where the slot model has
`prefill_batch`. A longer one is prefilled a chunk per iteration (vLLM's chunked prefill), so a decode step
of the running requests comes between its chunks, where a whole prefill of it would hold every stream up
for the length of the pass. One such prompt is prefilled at a time; it holds the free slot it will take,
and the requests queued behind it wait for it (first come, first served: none overtakes it for good).
"""
from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from opt_serving.runner.types import Prefix

log = logging.getLogger(__name__)

# the default chunk (tokens): the running streams wait at most one chunk's pass between two of their tokens
PREFILL_CHUNK = 256


class ChunkedPrefill:
    """The request (`req`, None when there is none) whose prompt is being prefilled a chunk per engine
    iteration, over a slot model with `open_prefill`, `prefill_chunk` and `discard_partial`
    (runner.slots.Slots); `chunk` is None where chunked prefill is off or the slot model has none."""

    def __init__(self, model, chunk: Optional[int]):
        self.model = model
        self.chunk = chunk if chunk and chunk > 0 and hasattr(model, "prefill_chunk") else None
        self.req = None
        self._job = None

    def wants(self, req) -> bool:
        """Is the request's prompt prefilled in chunks? Longer than a chunk, and not scored (prompt scores
        come from a whole prefill)."""
        return self.chunk is not None and len(req.prompt) > self.chunk and not req.settings.prompt_logprobs

    def advance(self) -> Optional[Prefix]:
        """Prefill the request's next chunk -> None, or after the last its Prefix (and it is no longer held)."""
        if self._job is None:
            self._job = self.model.open_prefill(self.req.prompt, self.req.settings, self.chunk)
        prefix = self.model.prefill_chunk(self._job)
        if prefix is not None:
            self.req = self._job = None
        return prefix

    def drop(self) -> None:
        """Let the request go (cancelled or failed), and the cache rows its chunks filled."""
        job, self.req, self._job = self._job, None, None
        if job is not None:
            try:
                self.model.discard_partial(job)
            except Exception:  # the slot model may be the thing that broke
                log.exception("could not let a chunked prefill's rows go")


def take(queue: collections.deque, free: int, chunked: ChunkedPrefill) -> list:
    """(Under the engine's lock.) The queued requests to prefill whole now, first come first served, at
    most `free` (the free slots, less the one a chunked prefill holds). A long prompt (`chunked.wants`)
    becomes `chunked.req` when there is none (taking a free slot too); otherwise it stays at the head of
    the queue, and the requests behind it with it."""
    admit = []
    while queue and len(admit) < free:
        req = queue[0]
        if not req.cancelled and chunked.wants(req):
            if chunked.req is not None:
                break
            chunked.req = req
            free -= 1
        elif not req.cancelled:
            admit.append(req)
        queue.popleft()
    return admit


def prefill_whole(model, reqs: list) -> list:
    """A Prefix (or the exception that stopped it) per request: together where the slot model has
    `prefill_batch`, and one by one if that fails, so only the request that caused it fails."""
    batched = getattr(model, "prefill_batch", None)
    if batched is not None and len(reqs) > 1:
        try:
            return batched([r.prompt for r in reqs], [r.settings for r in reqs])
        except Exception:
            log.exception("prefilling %d requests together failed; prefilling them one by one", len(reqs))
    out = []
    for req in reqs:
        try:
            out.append(model.prefill(req.prompt, req.settings))
        except Exception as e:
            out.append(e)
    return out

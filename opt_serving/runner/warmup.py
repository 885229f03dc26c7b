"""Warm-up: compile now, not at a request, every program serving runs (`Slots.warmup`).

`compiled_shapes` lists every shape the steps compile at, built from the bucket helpers the steps pad with
(runner/buckets.py) and the stages' own cache windows and join blocks; `warm_up` drives each entry in that order
through the slot model's own calls, so what it compiles is what serving then runs. The stages' programs only
compile meanwhile (runner/programs.py): nothing of a prompt is computed, each call's compile goes to a thread and
the next shape is traced while it runs, so a warm start (every program in the compile cache) loads them and no
more. Every group's cache has the same shapes: warming group 0 compiles all. Each run of shapes of one group
(`group_of`) is a line of the start log (startlog.py: its time, its XLA compiles and compile-cache hits). The order
matters:

- the scored prefill and the chunked prompts come first, while a stage holds the fewest compiled programs: their
  compiles take the most memory while they run, before the windows' steps add theirs;
- a prefill of every width, each a prefix-cache miss (its blocks are stored); one stage keeps the first of each
  cache size for the inserts, where a pipeline's stages, whose memory is short, let each go and prefill again;
- then the windows, growing: into each, every cache size's insert (the largest first, twice: once into the cache
  the last window's steps left, once into the one its insert made, as every later insert finds it), the step
  reading the whole window, the steps taken in one call, a step with prompts joining at every block size, the
  joined prompts' blocks into the pool, and the free.

A server warms only what generation runs (`every_shape=False`): where prompts join the steps, whole and chunked
prefills serve only scored prompts, which then compile at their first use.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Optional

import numpy as np

from opt_serving import startlog
from opt_serving.runner.buckets import cache_bucket, chunk_widths, job_sizes, step_row_sizes
from opt_serving.runner.prefix import BLOCK_SIZE
from opt_serving.runner.types import JOIN_PROMPTS, Prefix, SlotSettings

if TYPE_CHECKING:
    from opt_serving.runner.slots import Slots


@dataclasses.dataclass(frozen=True)
class Shape:
    """One shape the steps compile at, as what warm-up runs to compile it (`kind`):

    - "prefill": a prompt of `tokens` prefilled whole (its width: prefill_bucket(tokens)), a prefix-cache miss,
      its prompt scores too where `scored`; kept for the inserts where `for_inserts` (one stage), else let go;
    - "job": a prompt of `tokens` prefilled in chunks into a cache of `size` entries; with `head`, it starts with
      that many new tokens, and with `after_head`, it starts with the last job's head, cached by that job;
    - "insert": a prefilled prompt of cache size `size` (from `tokens` prompt tokens) into a group's cache of
      `window` entries, twice where `twice`;
    - "decode": one step reading the whole `window`; "decode_steps": `steps` of them in one call, computing `rows`
      rows (0: every row of the group, slot 0 alone running);
    - "join": a step in `window` with prompts joining in a block of `block` tokens;
    - "spec": the same with a row's drafts in it (speculative decoding, runner/ngram.py; prompts fill the rest);
    - "store_row": a row's blocks of `window` entries into the prefix cache's pool; "free": a row freed.
    """
    kind: str
    tokens: int = 0
    size: int = 0
    window: int = 0
    block: int = 0
    steps: int = 0
    rows: int = 0
    head: int = 0
    after_head: bool = False
    scored: bool = False
    for_inserts: bool = False
    twice: bool = False


def compiled_shapes(slots: "Slots", prefill_chunk: Optional[int] = None, decode_steps: int = 1,
                    every_shape: bool = True) -> list[Shape]:
    """Every shape `slots` compiles at, in the order warm-up runs them (the module docstring). Its joins are set
    for `prefill_chunk` first (`Slots.set_prefill_chunk`). Without `every_shape`, on ragged stages (prompts join
    the steps), only what generation runs: no scored or chunked prefill, and of the whole prefills and inserts only
    the one that puts slot 0 in each window."""
    only_steps = not every_shape and slots.joins_in_parts
    shapes = [] if only_steps else [Shape("prefill", tokens=slots.buckets[0] - 1, scored=True)]
    if (prefill_chunk or slots.prefix is not None) and not only_steps:
        shapes += _job_shapes(slots, slots.hit_chunk)
    widths: dict[int, int] = {}  # every cache size a prefill makes -> the smallest prefill width making it
    for b in slots.buckets:  # b - 1 prompt tokens fill prefill bucket b
        widths.setdefault(cache_bucket(b, slots.max_seq_len), b)
    windows = _windows(slots)
    # the cache size each window's steps start from: the largest a prefill makes that the window holds
    firsts = {w: max(c for c in widths if c <= w) for w in windows}
    for b in slots.buckets:
        c = cache_bucket(b, slots.max_seq_len)
        if not only_steps or (widths[c] == b and c in firsts.values()):
            shapes.append(Shape("prefill", tokens=b - 1, for_inserts=widths[c] == b))
    stored = [b for b in slots.buckets if b > BLOCK_SIZE]
    if slots.prefix is not None and stored and not only_steps:  # the first store again, into the pool as left
        shapes.append(Shape("prefill", tokens=stored[0] - 1))
    joins = slots.join_blocks if slots.num_slots > slots.groups else ()  # (group 0 has rows besides slot 0)
    for w in windows:
        fits = [c for c in sorted(widths) if c <= w]
        fits = fits[-1:] + ([] if only_steps else fits[:-1])  # (the largest first)
        shapes += [Shape("insert", tokens=widths[c] - 1, size=c, window=w, twice=c == firsts[w]) for c in fits]
        shapes.append(Shape("decode", window=w))
        if decode_steps > 1:
            shapes += [Shape("decode_steps", window=w, steps=decode_steps, rows=r) for r in _step_rows(slots)]
        shapes += [Shape("join", window=w, block=b) for b in joins]
        if slots.spec is not None:
            shapes += [Shape("spec", window=w, block=b) for b in slots.spec.sizes]
        if slots.ragged and slots.prefix is not None:
            shapes.append(Shape("store_row", window=w))
        shapes.append(Shape("free", window=w))
    return shapes


def _job_shapes(slots: "Slots", chunk: int) -> list[Shape]:
    """What prompts prefilled in chunks of `chunk` run, and those after a cached prefix: into the cache of every
    job size, a long prompt's first chunk (a new cache) and its last at every width (the cache the first made),
    and with the prefix cache what a cached prefix leaves at every width (the cache its blocks were gathered
    into), the blocks' store and gathering; each width's first token and prompt scores."""
    chunk = min(chunk, slots.max_seq_len)
    widths, sizes, cached = chunk_widths(chunk), job_sizes(slots.max_seq_len), slots.prefix is not None
    shapes = []
    for size in sizes:
        for w in (w for w in widths if w < size):
            if size > chunk:  # a new cache's chunk, then a last one of w into the cache it made
                shapes.append(Shape("job", tokens=min(chunk + w, size), size=size))
            if cached and BLOCK_SIZE + w <= size:  # a cached block, then w to compute
                shapes += [Shape("job", tokens=BLOCK_SIZE, size=size, head=BLOCK_SIZE),
                           Shape("job", tokens=BLOCK_SIZE + w, size=size, after_head=True)]
    for w in widths if cached else ():  # each width's prompt scores (scored hits)
        shapes.append(Shape("job", tokens=w, size=sizes[-1], scored=True))
    return shapes


def _step_rows(slots: "Slots") -> list[int]:
    """The rows the steps taken in one call compute at (DecodeStep.rows): every step_rows size where they are taken
    (one stage, one group: Slots.step_many), else 0 (every row)."""
    if slots.stages.n == 1 and slots.groups == 1:
        return step_row_sizes(slots.num_slots)
    return [0]


def _windows(slots: "Slots") -> list[int]:
    """The stages' own cache windows (from 256 where the attention kernel reads only the written entries): a
    smaller one would only run its steps again in the stages' smallest."""
    stages = slots.stages
    return sorted(set().union(*stages.get([stages.call(i, "cache_windows") for i in range(stages.n)])))


def group_of(shape: Shape) -> str:
    """The warm-up group a shape is timed in (the start log): the scored prefill, the whole prefills, the chunked
    ones, each window's."""
    if shape.kind == "prefill":
        return "scored prefill" if shape.scored else "prefills"
    return "chunked prefills" if shape.kind == "job" else f"window {shape.window}"


def warm_up(slots: "Slots", prefill_chunk: Optional[int] = None, decode_steps: int = 1,
            every_shape: bool = True) -> None:
    """Compile every shape of `compiled_shapes`, then leave the slots as they were: every slot free, the prefix
    cache empty (what warm-up wrote is nobody's prefix)."""
    slots.set_prefill_chunk(prefill_chunk)
    slots._to_all("begin_warmup")
    run = _Runner(slots)
    try:
        listed = compiled_shapes(slots, prefill_chunk, decode_steps, every_shape)
        for group, shapes in itertools.groupby(listed, key=group_of):
            shapes = list(shapes)
            with startlog.PHASES.phase(f"warm-up {group}", shapes=len(shapes), compiles=True):
                for shape in shapes:
                    getattr(run, shape.kind)(shape)
        if slots.spec is not None:
            with startlog.PHASES.phase("warm-up drafting", compiles=True):
                slots.spec.warm()
    except BaseException:
        slots._to_all("abandon_warmup")  # (no stage is left compiling its programs instead of running them)
        raise
    with startlog.PHASES.phase("warm-up end (the last compiles, the caches cut back)", compiles=True):
        for prefix in run.held.values():
            slots.discard(prefix)
        if slots.prefix is not None:
            slots.prefix.clear()
        if slots.spec is not None:
            slots.spec.forget_times()
        slots._to_all("end_warmup")
        slots.stages.get(slots.stages.call(0, "ready"))


class _Runner:
    """Runs each kind of `Shape` through the slot model's own calls, on slot 0 and group 0's other rows."""

    def __init__(self, slots: "Slots"):
        self.slots, self.cfg = slots, slots.cfg
        self.hold = slots.stages.n == 1  # (one stage keeps a prefilled prompt of every cache size)
        self.held: dict[int, Prefix] = {}  # cache size -> its prefilled prompt
        self.fresh = itertools.count(self.cfg.bos_token_id + 1)  # each job's tokens are its own
        self.head: list[int] = []  # the last job's cached head

    def _prefill(self, n: int, scored: bool = False) -> Prefix:
        """A prompt of n tokens prefilled whole, as a prefix-cache miss."""
        if self.slots.prefix is not None:
            self.slots.prefix.clear()
        return self.slots.prefill([self.cfg.bos_token_id] * n, SlotSettings(prompt_logprobs=scored))

    def prefill(self, shape: Shape) -> None:
        prefix = self._prefill(shape.tokens, shape.scored)
        if self.hold and shape.for_inserts:
            self.held[cache_bucket(shape.tokens + 1, self.slots.max_seq_len)] = prefix
        else:
            self.slots.discard(prefix)

    def job(self, shape: Shape) -> None:
        slots, vocab = self.slots, self.cfg.vocab_size
        if slots.prefix is not None and not shape.after_head:
            slots.prefix.clear()
        if shape.head:
            self.head = [next(self.fresh) % vocab] * shape.head
        head = self.head if shape.head or shape.after_head else []
        tokens = head + [next(self.fresh) % vocab] * (shape.tokens - len(head))
        job = slots.open_prefill(tokens, SlotSettings(prompt_logprobs=shape.scored), slots.hit_chunk, size=shape.size)
        slots.discard(slots._run(job))

    def insert(self, shape: Shape) -> None:
        prefix = self.held[shape.size] if self.hold else self._prefill(shape.tokens)
        if shape.twice:  # (the first grows the cache to the window)
            self.slots.insert(prefix, 0, keep=True)
        self.slots.insert(prefix, 0, keep=self.hold)

    def decode(self, shape: Shape) -> None:
        self.slots.table.lengths[0] = shape.window  # the step reads the whole window
        self.slots.step()

    def decode_steps(self, shape: Shape) -> None:
        """Slot 0 and the rows after it up to `rows` running (none inserted: the sampler leaves them alone), the
        steps filling the window."""
        running = range(0, max(shape.rows, 1) * self.slots.groups, self.slots.groups)
        self.slots.table.lengths[running] = max(shape.window - shape.steps + 1, 1)
        self.slots.step_many(shape.steps)
        self.slots.table.lengths[running[1:]] = 0

    def spec(self, shape: Shape) -> None:
        """Slot 0 drafts what the block holds besides its token (prompts fill the rest), in the window's last
        entries."""
        spec = self.slots.spec
        drafts = min(spec.k, spec.verify_rows, shape.block - 1)
        spec.forced = (0, shape.block)
        try:
            self.join(shape, drafts)
        finally:
            spec.forced = None

    def join(self, shape: Shape, drafts: int = 0) -> None:
        """Prompts fill the block: `block` tokens in all (with slot 0's, where a step's tokens are one list, and its
        `drafts`), no two alike (none waits for another's prefix blocks), none reusing another's blocks (each fills
        its share). The largest block is the budget and every running row's token: with slot 0 alone running, the
        budget is raised to the block for this step, or its prompts would stop at the budget and run in a smaller
        block."""
        slots, b = self.slots, shape.block - (1 if self.slots.packed else 0) - drafts
        slots.table.lengths[0] = shape.window - drafts
        if slots.prefix is not None:
            slots.prefix.clear()
        some = range(slots.groups, slots.num_slots, slots.groups)[:JOIN_PROMPTS][:b]  # group 0's rows after slot 0
        budget, slots.joins.budget = slots.joins.budget, max(slots.joins.budget, b)
        try:
            for i, slot in enumerate(some):
                n = b // len(some) + (i < b % len(some))
                filler = (self.cfg.bos_token_id + 2 + i) % self.cfg.vocab_size
                if not slots.join([self.cfg.bos_token_id] + [filler] * (n - 1), SlotSettings(), slot):
                    raise RuntimeError(f"warm-up: a prompt did not join a block of {b}")
            slots.step()
        finally:
            slots.joins.budget = budget
        for slot in some:
            slots.free(slot)

    def store_row(self, shape: Shape) -> None:
        """A joined prompt's blocks into the pool (none written)."""
        self.slots._to_all("store_row", 0, 0, np.full(shape.window // BLOCK_SIZE, self.slots.prefix.blocks, np.int32))

    def free(self, shape: Shape) -> None:
        self.slots.free(0)

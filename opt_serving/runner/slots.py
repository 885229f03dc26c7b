"""The engine's slot model for every plan: host bookkeeping over a chain of stages.

`Slots` keeps, per decode slot, its token count, its newest token and what its request wants scored (its
`SlotTable`, runner/slot_table.py), builds each decode step's inputs once (a `DecodeStep`), and drives the
stages (`StageSlots`, runner/stage.py) through a `Stages` object: in this process (`LocalStages`: one device or
a tensor-parallel mesh, a stage that is both first and last) or in Ray actors (`parallel/pipeline.py`). Every
call goes to every stage in the same order, and each stage runs its calls in that order, so an insert or a free
sent after a decode acts after it.

Pipelined decode: the slots form `groups` micro-batch groups. `step()` sends every idle group with work
through the stages, then waits for the oldest one and returns its tokens (`StepResult.rows`): while the
engine hands those out, the other groups are in the stages. With one group it is a plain synchronous
step. A slot freed or refilled while its group is in flight gets no token from that flight (its generation
changed).

Joining (`join`): a short prompt takes a free slot in its group's next decode step. Its tokens ride in that
step's products beside the decode rows (a `JoinBlock` of 8 to 128 tokens, 512 on a GPU, up to 16 prompts; its
k/v go straight into the slot's cache row, steps.decode_joining_step), and the step chooses its first token as it
chooses the others'. A prefill pass of its own would read every weight again for a handful of tokens, about the cost
of a decode step. Longer prompts, prompts whose scores are asked for, and those a full block leaves over are
prefilled (`prefill_batch`) and inserted.

Prefills, whole, batched or a chunk at a time, and the prefix cache: runner/prefill.py (`Prefills`).

LoRA adapters (runner/lora.py; where the stages were made with slots for them): a request's adapter
(`SlotSettings.lora`) is given a slot when it is prefilled or joins a step, pinned until its request is freed;
each decode slot's adapter slot rides beside its other per-slot arrays into every step, and a prompt's
prefix-cache keys start from its adapter's fingerprint.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Optional, Sequence

import numpy as np

from opt_serving.model import kv_cache
from opt_serving.runner.buckets import prefill_buckets
from opt_serving.runner.generate import Generation
from opt_serving.runner.joins import Joining, Joins, block_sizes
from opt_serving.runner.lora import Adapters, SlotAdapters
from opt_serving.runner.draft import ModelSpeculation
from opt_serving.runner.ngram import NgramSpeculation
from opt_serving.runner.packed import pack_step
from opt_serving.runner.prefill import Prefills
from opt_serving.runner.prefix import BLOCK_SIZE, PrefixCache
from opt_serving.runner.slot_table import SlotTable
from opt_serving.runner.slots_steps import ManySteps
from opt_serving.runner.stage import LocalStages, Stages
from opt_serving.runner.types import (ACCELERATOR_JOIN_BLOCKS, JOIN_BLOCKS, JOIN_PROMPT_TOKENS, JOIN_PROMPTS,
                                      MAX_TOP_LOGPROBS, PREFILL_BATCH_TOKENS, DecodeStep, JoinBlock, ModelCosts,
                                      Prefix, SlotModel, SlotSettings, StepResult)
from opt_serving.runner.warmup import warm_up

# the chunk a prompt's part past its cached prefix is computed in where the engine prefills it whole (the
# engine's own prefill_chunk otherwise)
HIT_CHUNK = 256


def join_blocks(platform: str, max_seq_len: int, room: int) -> tuple[int, ...]:
    """The block sizes a step's joining prompts go in, on stages on `platform` ("cpu", "gpu", ...), at most
    `room` tokens (the prompts a step takes, each of the longest that joins): on a CPU JOIN_BLOCKS, each shorter
    than the context; elsewhere ACCELERATOR_JOIN_BLOCKS."""
    if platform == "cpu":
        blocks = tuple(b for b in JOIN_BLOCKS if b < max_seq_len and b <= room)
    else:
        blocks = tuple(b for b in ACCELERATOR_JOIN_BLOCKS if b <= room)
    return blocks or (min(max_seq_len - 1, room),)


ROWS_BLOCK = 4  # the smallest block of a packed step's tokens


class Slots(Prefills, ManySteps, SlotModel):
    """The slot model (runner.types.SlotModel) over `stages`, each holding `num_slots // groups` rows of every
    group, with every ability."""
    batched_prefill = chunked_prefill = joins_steps = many_steps = sends_ahead = masks_tokens = runs_generate = True

    def __init__(self, cfg, stages: Stages, num_slots: int, groups: int = 1, max_seq_len: Optional[int] = None,
                 plan=None, prefix_blocks: int = 0, costs: Optional[ModelCosts] = None):
        """`prefix_blocks`: the blocks of the prefix cache, as the stages' pools were made (0: none); `costs`: what
        a token costs the model (for the engine's statistics)."""
        self.costs = costs
        self.table = SlotTable(num_slots, groups)  # each slot's tokens, wants, (group, row) and generation
        self._init_many()
        self.cfg, self.stages, self.plan = cfg, stages, plan
        self.num_slots, self.groups = num_slots, groups
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.vocab_size = cfg.vocab_size
        self.buckets = prefill_buckets(self.max_seq_len)
        # short prompt buckets -> rows a pass (at most the slots: never more requests are admitted at once).
        # Every prompt of such a bucket runs in a pass of that many rows, even alone: a prompt's numbers
        # then never depend on the requests it was batched with (XLA's elementwise ops can round an ulp
        # differently at another shape, enough to flip a near-tied greedy token).
        self.batch_rows = {b: PREFILL_BATCH_TOKENS // b for b in self.buckets
                           if 2 * b <= PREFILL_BATCH_TOKENS and PREFILL_BATCH_TOKENS // b <= num_slots}
        # a batched pass chooses its first tokens over this many rows (padded): sampling costs a pass over
        # [rows, V] per processor, so not the slots' 32 rows for 4 prompts, and one compile for all passes
        self.pass_rows = max(self.batch_rows.values(), default=1)
        # (group, future, slots sent, their generations), oldest first
        self._flights: collections.deque = collections.deque()
        self._handles = itertools.count()
        # ragged steps (every stage's backend: steps.ragged_step) take any prompt a part at a time, cached prefixes in
        # place; otherwise short prompts join whole (runner/joins.py)
        self.ragged = self.joins_in_parts = all(stages.get([stages.call(i, "is_ragged") for i in range(stages.n)]))
        self._platform = stages.get(stages.call(stages.n - 1, "platform"))
        self._held: dict[int, list] = {}  # slot -> the prefix-cache blocks its row reads (held while it runs)
        self._cached: dict[int, int] = {}  # slot -> the prompt tokens its joined prompt took from the prefix cache
        self._promised: dict[bytes, int] = {}  # a prefix-cache key -> the slot whose joining prompt computes it
        self.prefix = PrefixCache(prefix_blocks) if prefix_blocks else None
        # LoRA adapters, where the stages hold slots for them: each decode slot's and prefilled request's adapter
        layouts = stages.get([stages.call(i, "lora_layout") for i in range(stages.n)])
        self.loras = Adapters(cfg, layouts) if layouts[0] is not None else None  # the adapters served
        self.adapters = SlotAdapters(stages, num_slots, self.loras)
        self.spec: Optional[NgramSpeculation] = None  # served speculative decoding (use_speculation)
        self._set_joins(HIT_CHUNK)  # (warmup sets the engine's chunk)

    def _set_joins(self, chunk: int) -> None:
        """The joining prompts' scheduler (runner/joins.py): on ragged stages up to `chunk` prompt tokens a step
        (the engine's prefill chunk; 0 or None: whole prompts), otherwise short prompts whole, in the block sizes
        prompts in a group's rows besides one can fill (warm-up fills each with them)."""
        self.hit_chunk = chunk or HIT_CHUNK
        rows = self.num_slots // self.groups
        longest = min(JOIN_PROMPT_TOKENS, self.max_seq_len - 1)  # the longest prompt that joins whole
        if self.ragged:  # (at most what the group's rows besides one hold: warm-up fills each size)
            width = self.max_seq_len - 1  # (each prompt leaves room in the cache for a token)
            budget = min(chunk or self.max_seq_len, self.max_seq_len, max(1, rows - 1) * width)
            # the rows running ride in the same block (packed): it holds them all and a few prompt tokens besides;
            # the smallest holds four rows' tokens, which the CPU kernels take in one pass over each weight block
            # (a step of one to four rows padded to 8 passed twice: OPT-1.3b's step at batch 1 took 1.6x its time)
            sizes = block_sizes(max(budget, rows + JOIN_BLOCKS[0]), ROWS_BLOCK) if self.packed else block_sizes(budget)
        else:
            width, sizes = longest, join_blocks(self._platform, self.max_seq_len, self.join_room)
            budget = sizes[-1]
        old = getattr(self, "joins", None)
        if self.spec is not None:
            self.spec.sizes = sizes
        if old is not None and (old.sizes, old.budget) == (sizes, budget):
            return
        if old is not None and any(old.waiting(g) for g in range(self.groups)):
            raise RuntimeError("the prefill chunk changed while prompts were joining")
        self.joins = Joins(self.groups, rows, sizes, self.ragged, longest, width, self.cfg.pad_token_id, budget)

    def use_speculation(self, config, draft=None) -> None:
        """Serve speculative decoding (config.SpeculativeConfig): by prompt lookup (runner/ngram.py), or with
        `draft`, a draft model's Generation on one device (runner/draft.py). Drafts ride in ragged steps, so only
        where the stages run them."""
        if not self.ragged:
            raise ValueError("speculative decoding is served on ragged steps (the CPU backend's attention kernel); "
                             "this model's stages do not run them")
        if draft is None:
            self.spec = NgramSpeculation(config, self.num_slots, self.max_seq_len, self.joins.sizes)
            return
        if draft.config.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.config.vocab_size} tokens) "
                             f"is not the target's ({self.cfg.vocab_size}); a draft must share the tokenizer")
        self.spec = ModelSpeculation(config, self.num_slots, self.max_seq_len, self.joins.sizes, draft)

    @property
    def packed(self) -> bool:
        """Do steps take their tokens as one list (PackedTokens: the rows running, then the prompts' parts, padded as
        a whole, so a step's products run at the rows in use, not at every row of the group)? On ragged stages."""
        return self.ragged

    def set_prefill_chunk(self, chunk: Optional[int]) -> None:
        """The engine's prefill chunk: on ragged stages the most prompt tokens a step carries (0 or None: a whole
        context's); warm-up compiles the block sizes it makes."""
        self._set_joins(chunk)

    @property
    def join_room(self) -> int:
        """The prompt tokens short prompts whole can fill in a group's rows besides one."""
        longest = min(JOIN_PROMPT_TOKENS, self.max_seq_len - 1)
        return max(1, min(JOIN_PROMPTS, self.num_slots // self.groups - 1)) * longest

    def use_join_blocks(self, sizes: Sequence[int]) -> None:
        """Short prompts join whole, in blocks of these sizes, whatever the stages could take (to compare ways
        of admission: benchmark/gpu/gpu_engine_probe.py)."""
        longest = min(JOIN_PROMPT_TOKENS, self.max_seq_len - 1)
        self.joins = Joins(self.groups, self.num_slots // self.groups, tuple(sizes), False, longest, longest,
                           self.cfg.pad_token_id)
        self.joins_in_parts = False

    @property
    def join_blocks(self) -> tuple[int, ...]:
        """The block sizes a step's joining prompt tokens go in."""
        return self.joins.sizes

    @property
    def join_tokens(self) -> int:
        """The most prompt tokens a step carries."""
        return self.joins.budget

    @property
    def join_prompt_tokens(self) -> int:
        """The longest prompt that joins."""
        return self.joins.width

    def group_of(self, slot: int) -> tuple[int, int]:
        """(group, row) of a slot: consecutive slots alternate groups."""
        return self.table.group_of(slot)

    def _to_all(self, method: str, *args) -> None:
        """The same call to every stage, in stage order (replies not awaited)."""
        for i in range(self.stages.n):
            self.stages.call(i, method, *args)

    def use_tokenizer(self, tokenizer_json: str, eos: int) -> None:
        """Structured output: the tokenizer (runner/grammar.tokenizer_json) the stage that samples matches
        grammars against, sent to it once (a pipeline's last stage is an actor)."""
        self.stages.get(self.stages.call(self.stages.n - 1, "use_tokenizer", tokenizer_json, eos))

    # ---- joining: a prompt's prefill rides in decode steps (runner/joins.py) ----
    def joinable(self, tokens: Sequence[int], settings: SlotSettings) -> bool:
        """Could the prompt join a step whose block is empty? (No prompt scores asked; without ragged steps a
        short prompt; its LoRA adapter, if any, can have a slot.)"""
        return self.joins.fits(tokens, settings) and self.adapters.can_take(settings)

    def join(self, tokens: Sequence[int], settings: SlotSettings, slot: int) -> bool:
        """Let a prompt take a free slot, its tokens in the next decode steps' passes (`JoinBlock`); the step
        with its last token gives its first. On ragged stages its cached prefix's KV is read from the prefix cache
        in place (`cached_of` tells how many tokens that gave). False where it does not join (not `joinable`, or a
        full block: it joins a later step or is prefilled instead)."""
        self._check_settled("a join")
        g, row = self.group_of(slot)
        joining = Joining(slot, row, [int(t) for t in tokens], settings)
        if not self.joins.add(g, joining):
            return False
        try:
            self.adapters.of_slot[slot] = self.adapters.take(settings)
        except Exception:  # (its adapter has no slot now: prefilled instead, which says why it cannot start)
            self.joins.remove(g, slot)
            return False
        self._cached[slot] = 0
        if self.ragged and self.prefix is not None:
            joining.keys = self._keys(joining.tokens, settings)
            self._match(g, joining)
        self.table.join(slot, settings)
        if self.spec is not None:
            self.spec.start(slot, joining.tokens, settings)
        return True

    def cached_of(self, slot: int) -> int:
        """The prompt tokens the slot's joined prompt took from the prefix cache."""
        return self._cached.get(slot, 0)

    def _match(self, g: int, joining: Joining) -> None:
        """The joining prompt's cached prefix, read in place by its row; or, where another joining prompt is
        computing the next block of it, wait (`deferred`) until that prompt's blocks are stored and take them too:
        a burst of prompts sharing a prefix computes it once, not once a prompt."""
        usable = joining.keys[:(len(joining.tokens) - 1) // BLOCK_SIZE]  # (its last token is always computed)
        blocks = self.prefix.match(usable) if len(joining.tokens) > BLOCK_SIZE else []
        nxt = len(blocks)
        if nxt < len(usable) and self._promised.get(usable[nxt], joining.slot) != joining.slot:
            joining.deferred = True
            return
        joining.deferred = False
        joining.blocks, joining.done = blocks, len(blocks) * BLOCK_SIZE
        joining.cached = self._cached[joining.slot] = joining.done
        for k in joining.keys[nxt:]:  # the blocks it computes, for the prompts behind it
            self._promised.setdefault(k, joining.slot)
        if blocks:
            self.prefix.hold(blocks)
            self._held[joining.slot] = blocks
            self._to_all("use_prefix", g, joining.row, np.asarray(blocks, np.int32))

    def _resume(self, g: int) -> None:
        """Deferred joining prompts whose awaited blocks were stored (or given up) match their prefix again."""
        for joining in self.joins.joining(g):
            if joining.deferred:
                usable = joining.keys[:(len(joining.tokens) - 1) // BLOCK_SIZE]
                waited = next((k for k in usable if k not in self.prefix), None)
                if waited is None or self._promised.get(waited, joining.slot) == joining.slot:
                    self._match(g, joining)

    def _unpromise(self, slot: int) -> None:
        for k in [k for k, s in self._promised.items() if s == slot]:
            del self._promised[k]

    def _block(self, parts) -> JoinBlock:
        """The stages' view of a step's joining parts (runner/joins.py), each token with its prompt's adapter."""
        block = self.joins.block(parts)
        if self.adapters.on:
            adapters, at = np.full(len(block.ids), -1, np.int32), 0
            for p in parts:
                adapters[at:at + p.end - p.start] = self.adapters.of_slot[p.joining.slot]
                at += p.end - p.start
            block = dataclasses.replace(block, adapters=adapters)
        return block

    # ---- slots ----
    def _in_flight(self, g: int) -> bool:
        return any(f[0] == g for f in self._flights)

    def insert(self, prefix: Prefix, slot: int, keep: bool = False) -> None:
        """Put a prefilled request into a slot; with `keep` its prefix can be inserted again (warm-up)."""
        self._check_settled("an insert")
        g, row = self.group_of(slot)
        self._to_all("insert", prefix.state, g, row, keep)
        self.adapters.insert(prefix.state, slot, keep)
        self.table.insert(slot, prefix.length + 1, prefix.first.id, prefix.settings)  # the prompt and first token
        if self.spec is not None:
            self.spec.start(slot, prefix.tokens + (prefix.first.id,), prefix.settings)

    def free(self, slot: int) -> None:
        g, row = self.group_of(slot)
        self.joins.remove(g, slot)
        self._unpromise(slot)
        self._cached.pop(slot, None)
        held = self._held.pop(slot, None)
        if held:
            self.prefix.release(held)
        self._to_all("free", g, row)
        self.table.free(slot)
        self.adapters.free(slot)
        if self.spec is not None:
            self.spec.end(slot)

    def window_needed(self, g: int, steps: int = 1, entries: int = 0) -> int:
        """The cache window a group's next `steps` steps need: the bucket holding every active slot's tokens (and
        `entries`, those joining prompts' parts fill)."""
        return self._window_of(max(int(self.table.lengths[self.table.group_slots(g)].max()) + steps - 1, entries))

    def _window_of(self, longest: int) -> int:
        """The cache window that holds `longest` entries."""
        return kv_cache.bucket_length(min(max(longest, 1), self.max_seq_len), self.max_seq_len)

    def _send_decode(self, g: int) -> None:
        """Send the group's next step through the stages (`step` awaits its tokens)."""
        slots = self.table.group_slots(g)
        step, parts = self._decode_step(g, slots)
        x = self.table.next[slots]
        for i in range(self.stages.n):
            x = self.stages.call(i, "decode", x, step)
        sent = slots[self.table.lengths[slots] > 0]
        self._flights.append((g, x, sent, self.table.generation[sent], step))
        for p in parts:  # a prompt's blocks into the prefix cache once the step wrote them
            if p.final and self.ragged:
                self._keep_row(g, p.joining, step.window)

    def _decode_step(self, g: int, slots: np.ndarray) -> tuple[DecodeStep, list]:
        """The group's next step (its `slots`, in row order), and the joining prompts' parts riding in it. A row
        whose prompt's last part rides here holds its prompt after this step (its token: +1), and is stepped from
        the next one on (its position here: -1)."""
        lengths = self.table.lengths[slots]
        positions = np.where(lengths > 0, lengths - 1, -1).astype(np.int32)  # [rows] -1: a row not stepped
        if self.prefix is not None and self.ragged:
            self._resume(g)
        running = int((positions >= 0).sum())
        parts = self.joins.take(g, rows_running=running > 0, decoding=running if self.packed else 0)
        block = self._block(parts) if parts else None
        tokens = running + sum(p.end - p.start for p in parts)
        drafts = [] if self.spec is None else self.spec.drafts(slots, positions, tokens,
                                                               self.joins.sizes[-1] - tokens, self.max_seq_len)
        for p in parts:
            if p.final:
                self.table.lengths[p.joining.slot] = len(p.joining.tokens)
        lengths = self.table.lengths[slots]
        want_scores, want_top = self.table.wants(slots[lengths > 0])
        ends = [p.end for p in parts] + [int(positions[d.row]) + 1 + len(d.tokens) for d in drafts]
        window = self.window_needed(g, entries=max(ends, default=0))
        adapters = self.adapters.rows(slots)
        packed = None
        if self.packed:
            spec = self.spec
            packed = pack_step(positions, block, adapters, self.joins.sizes, self.adapters.on, drafts,
                               spec.verify_rows if spec else 0, spec.k if spec else 0)
        return DecodeStep(g, positions, window, int(lengths.max()), want_scores, want_top, block, adapters,
                          packed=packed), parts

    def _keep_row(self, g: int, joining: Joining, window: int) -> None:
        """Claim pool blocks for a joined prompt's full blocks not cached yet and have every stage write them from
        its row (a window's worth of block ids)."""
        if self.prefix is None or len(joining.tokens) < BLOCK_SIZE:
            return
        claims = self.prefix.claim(joining.keys or self._keys(joining.tokens, joining.settings))
        if claims:
            ids = np.full(window // BLOCK_SIZE, self.prefix.blocks, np.int32)  # past the pool: not written
            for j, b in claims:
                ids[j] = b
            self._to_all("store_row", g, joining.row, ids)
        self._unpromise(joining.slot)  # (stored: the prompts waiting for them find them in the cache)

    def step(self) -> StepResult:
        self._check_settled("a single step")
        t = time.perf_counter()
        for g in range(self.groups):  # every idle group with work goes into the stages
            busy = self.table.lengths[self.table.group_slots(g)].any()
            if not self._in_flight(g) and (self.joins.waiting(g) or busy):
                self._send_decode(g)
        g, future, sent, generations, step = self._flights.popleft()
        rows = np.zeros(self.num_slots, np.bool_)  # a slot freed or refilled since the step was sent takes nothing
        rows[self.table.current(sent, generations)] = True
        out = self.stages.get(future)
        if self.spec is not None and step.packed is not None:  # (a pipeline: the oldest group's step, a call a group)
            self.spec.observe_call(len(step.packed.src), step.packed.verify is not None, 1, t, time.perf_counter())
        return self._result(self.table.group_slots(g), rows, *out, step=step)

    def _result(self, slots, rows, tok, lp, top_ids, top_lp, more=None, kept=None, step=None) -> StepResult:
        """A step's tokens for the group's `slots` (its rows, in order); the slots marked in `rows` take them (and,
        where rows drafted, `more` [rows, K] the tokens after each draft, the first `kept` [rows] of them)."""
        tokens = np.zeros(self.num_slots, np.int32)
        logprobs = np.zeros(self.num_slots, np.float32)
        ids = np.full((self.num_slots, MAX_TOP_LOGPROBS), -1, np.int32)
        lps = np.zeros((self.num_slots, MAX_TOP_LOGPROBS), np.float32)
        tokens[slots], logprobs[slots], ids[slots], lps[slots] = tok, lp, top_ids, top_lp
        # the top-k ran for every row if one wanted it: the others get none
        ids = np.where(self.table.want_top[:, None], ids, -1)
        self.table.advance(rows, tokens)
        result = StepResult(tokens, logprobs, ids, lps, rows=rows)
        if self.spec is not None:
            self.spec.settle(result, slots, more, kept, step.packed if step is not None else None, self.table)
        return result

    # ---- life ----
    def warmup(self, prefill_chunk: Optional[int] = None, decode_steps: int = 1, every_shape: bool = True) -> None:
        """Compile every shape serving runs (runner/warmup.py's `compiled_shapes`): the prefills, inserts, steps
        (and `decode_steps` of them in one call, where `step_many` takes them), joins and frees; with
        `prefill_chunk` (and for the part of a prompt after its cached prefix), the chunked prefills. Without
        `every_shape`, on ragged stages only what generation runs (the prefills and chunked prefills that only
        scored prompts run then compile at their first use)."""
        warm_up(self, prefill_chunk, decode_steps, every_shape)

    @property
    def params(self):
        """The runtime params of a model run in this process (one stage: the whole model)."""
        if not isinstance(self.stages, LocalStages):
            raise AttributeError("a pipelined model's params live in its stage actors")
        return self.stages.stages[0].params

    def generation_model(self):
        """A `runner.generate.Generation` (HF-style generate(), beam search) over the same stages, no second copy of
        the weights: one compiled loop on a stage in this process, a host loop over a pipeline's actors."""
        return Generation(self.cfg, self.stages, self.plan)

    def check_health(self) -> None:
        self.stages.check_health()

    def close(self) -> None:
        if self.spec is not None:
            self.spec.close()
        self.stages.close()

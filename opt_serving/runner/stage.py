"""One stage's share of the decode slots: its layers' params, the KV cache of every slot for those
layers, and the jitted steps. The whole model on one device (or one tensor-parallel mesh) is the stage
that is both first and last; a pipeline is several, each in its own Ray actor (parallel/pipeline.py).

Slots are split into `groups` (the pipeline's micro-batches), each with its own cache of `rows` rows,
so a stage can run one group's decode while the next stage runs another's. Slot s is row s // groups
of group s % groups (consecutive slots alternate groups, so a few requests still fill every group).

Prompts are right-padded to a prefill width (`prefill_buckets`), so a slot's tokens sit at cache entries
0..n-1 and each decode writes at the token's own position. A group's cache holds only the window its
longest slot needs (powers of two from 16): it grows and shrinks a window at a time, where slicing a
window out of a full-length cache made XLA copy it every step. With the backend's attention kernel, which
reads only the entries written so far, it only grows (a shrink copies the whole cache for nothing), and
from 256 entries (KERNEL_MIN_WINDOW): smaller windows would cost nothing a step but their compiles.

The last stage also chooses the tokens (`Sampler`): what leaves it is tokens and scores, never
hidden states. The other stages hand their hidden states on. With LoRA adapters (runner/lora.py's StageLora)
every step takes its rows' adapter slots too, and the stage holds its layers' share of every slot.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving import xla_cache
from opt_serving.backend import Backend
from opt_serving.backend.cpu import heap
from opt_serving.model import beam_search, kv_cache, layout, opt, sample
from opt_serving.model import quantize as quantization
from opt_serving.runner.buckets import KERNEL_MIN_WINDOW, cache_windows
from opt_serving.runner.lora import StageLora
from opt_serving.runner.prefix import BLOCK_SIZE as PREFIX_BLOCK
from opt_serving.runner.programs import Programs
from opt_serving.runner.sampler import Sampler
from opt_serving.runner.stage_steps import StepsInOneCall
from opt_serving.runner.stage_programs import seq_continue_fn, seq_extend_fn, seq_prefill_greedy_fn
from opt_serving.runner.stage_programs import stage_programs
from opt_serving.runner.types import DecodeStep, SlotSettings


def _settles(method):
    """During warm-up (begin_warmup to end_warmup), after each call: what JAX keeps of the programs it just
    compiled besides their executables (xla_cache.drop_staging_caches; not where the programs only compile, whose
    lowerings are what their first runs call) and the heap pages the compiles freed go back, so a stage's peak
    while it compiles its programs is its arrays and executables, not every program's lowering as well."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        if self._warming:
            if not self.programs.compiling:
                xla_cache.drop_staging_caches()
            if self._on_cpu:
                heap.trim()
        return out
    return run


class StageSlots(StepsInOneCall):
    """One stage's layers over `groups` groups of `rows` decode slots (see the module docstring)."""

    def __init__(self, cfg, params, stage: opt.StageSpec, rows: int, groups: int = 1,
                 max_seq_len: Optional[int] = None, backend: Optional[Backend] = None, prefix_blocks: int = 0,
                 lora=None):
        """`params` in the checkpoint's layout, put here in the runtime layout of the backend chosen where
        they lie (layout.runtime_params: on one device q/k/v as one matmul, on a CPU packed; a tensor-parallel
        stage's stay split by heads; int8 ones as model/quantize.py made them); or, with `backend`, already in
        its runtime layout. `prefix_blocks`: the prefix cache's pool blocks (of PREFIX_BLOCK entries) for this
        stage's layers (0: no prefix cache). `lora`: slots for LoRA adapters (model/lora.py's LoraConfig; None:
        none), each step's rows naming theirs (runner/lora.py: every step takes one more argument, last)."""
        if backend is None:
            backend, params = layout.runtime_params(params, weights=quantization.weights_of(params))
        self.cfg, self.spec, self.params, self.backend = cfg, stage, params, backend
        self.rows, self.groups = rows, groups
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        smallest = KERNEL_MIN_WINDOW if backend.attention else kv_cache.MIN_BUCKET
        self.windows = cache_windows(self.max_seq_len, smallest)
        dtype = kv_cache.cache_dtype(params, backend)
        scfg = cfg.replace(num_hidden_layers=stage.num_layers)
        self._new_cache = lambda batch, n: kv_cache.init_cache(scfg, batch, n, dtype)
        self._empty_cache = lambda: self._new_cache(rows, self.windows[0])  # smallest window
        self.caches = [self._empty_cache() for _ in range(groups)]
        self.pending: dict[int, dict] = {}  # handle -> a prefilled request's batch-1 cache, until inserted
        # the prefix cache's blocks (runner/prefix.py: the driver decides which block holds what)
        self.pool = kv_cache.init_pool(scfg, prefix_blocks, PREFIX_BLOCK, dtype) if prefix_blocks else None
        # ragged steps: each group row's cached prefix, read from the pool (ptab [rows, Mp] blocks, plen [rows]
        # entries; steps.ragged_step); without a prefix cache an empty pool stands in
        mp = max(1, -(-self.max_seq_len // PREFIX_BLOCK))
        self.ptab = [np.zeros((rows, mp), np.int32) for _ in range(groups)]
        self.plen = [np.zeros(rows, np.int32) for _ in range(groups)]
        self._no_pool = kv_cache.init_pool(scfg, 0, PREFIX_BLOCK, dtype)
        # the one device of a stage that is not tensor-parallel: arrays a step made are committed to it and fresh
        # zeros are not, and jit compiles each apart
        devices = {d for leaf in jax.tree_util.tree_leaves(params) if hasattr(leaf, "sharding")
                   for d in leaf.sharding.device_set}
        self._devices = devices
        self._device = next(iter(devices)) if len(devices) == 1 else None
        self._on_cpu = bool(devices) and all(d.platform == "cpu" for d in devices)
        self._alone = self._device is not None and all(  # (warm-up compiles without running: begin_warmup)
            isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding)
            for leaf in jax.tree_util.tree_leaves(params) if hasattr(leaf, "sharding"))
        self._warming = False  # from begin_warmup to end_warmup (_settles)
        self._init_steps()
        self.programs = Programs()  # (warm-up compiles them without running them)
        if self.pool is not None and self._device is not None:  # placed as the pools its stores make
            self.pool = jax.device_put(self.pool, self._device)
        self.sampler = Sampler(cfg, backend, rows, groups, self.max_seq_len, self.programs.jit) if stage.last else None
        self.lora = StageLora(cfg, lora, stage, params)  # (lora None: every step takes None, traces no LoRA)

        self.ragged = backend.ragged  # prompts continue rows and cached prefixes are read in place (steps.ragged_step)
        self.seqs: dict = {}  # key -> a whole-sequence cache (generate() over a pipeline)
        (self._prefill, self._chunk, self._step, self._step_joining, self._step_packed, self._steps, self._seq_prefill,
         self._seq_decode,
         self._seq_reorder, self._insert_cache, self._gather, self._store, self._store_row, self._resize,
         self._free) = stage_programs(cfg, stage, backend, self.max_seq_len, self._new_cache,
                                      self.sampler.choose_rows if stage.first and stage.last else None,
                                      self.programs.jit)

    # ---- prefill ----
    @_settles
    def prefill(self, handles: Sequence[int], x, ids, mask, lengths, settings: Sequence[SlotSettings],
                state_rows: int, adapters=None):
        """One prefill pass: keep each request's cache rows under its handle. A stage that is not last
        returns its hidden states for the next; the last returns the first tokens (see Sampler.prefill).
        `adapters`: each row's LoRA adapter (int32 [rows], -1: none)."""
        caches, h = self._prefill(self.params, x, mask, self.lora.batch(adapters, mask.shape[0]))
        for handle, cache in zip(handles, caches):
            self.pending[handle] = cache
        if self.sampler is None:
            return h
        return self.sampler.prefill(self.params, handles, h, ids, mask, lengths, settings, state_rows)

    @_settles
    def prefill_chunk(self, handle: int, x, start: int, mask, size: int, final=None, gather=None, next_ids=None,
                      adapter=None):
        """One chunk of a prompt prefilled in chunks (x: its ids [1, C], or the previous stage's hidden states
        [1, C, D]; mask [1, C] its real tokens) at positions start.., into the request's batch-1 cache of
        `size` entries, kept under `handle` as `prefill` keeps it. The cache is new at start 0, or with
        `gather` (pool blocks int32 [size // PREFIX_BLOCK], cached entries) made of prefix-cache blocks. A stage
        that is not last returns its hidden states; the last returns (first, scores): on the last chunk
        (`final`: the whole prompt's ids, mask [1, L] and length, its last position in the chunk, its
        settings) the first token as `prefill` returns it, else None; with `next_ids` [1, C] (the token after
        each position) the chunk's prompt scores (Sampler.chunk_scores), else None. `adapter`: its LoRA adapter
        (int32 [1])."""
        if gather is not None:
            cache = self._gather(self.pool, *gather)
        elif start == 0:
            cache = self._new_cache(1, size)
            if self._device is not None:  # placed as the later chunks' caches are: one compile for both
                cache = jax.device_put(cache, self._device)
        else:
            cache = self.pending[handle]
        h, self.pending[handle] = self._chunk(self.params, cache, x, np.int32(start), mask,
                                              self.lora.batch(adapter, 1))
        if self.sampler is None:
            return h
        scores = None if next_ids is None else self.sampler.chunk_scores(self.params, h, next_ids)
        return (None if final is None else self.sampler.prefill_chunked(self.params, handle, h, *final)), scores

    @_settles
    def store_prefix(self, handle: int, ids) -> None:
        """A prefilled request's full blocks into the prefix cache's pool: block j of its cache into pool block
        ids[j] (int32 [entries // PREFIX_BLOCK]; the pool's size for blocks not to keep)."""
        self.pool = self._store(self.pool, self.pending[handle], ids)

    @_settles
    def insert(self, handle: int, group: int, row: int, keep: bool = False) -> None:
        """A prefilled request into a slot (`keep`: its rows stay for another insert, as warm-up does)."""
        pcache = self.pending[handle] if keep else self.pending.pop(handle)
        self._fit_cache(group, kv_cache.cache_max_len(pcache), shrink=False)
        self.caches[group] = self._insert_cache(self.caches[group], pcache, np.int32(row))
        if self.sampler is not None:
            self.sampler.insert(handle, group, row, keep)

    @_settles
    def drop(self, handle: int) -> None:
        """A prefilled request that will not be inserted."""
        self.pending.pop(handle, None)
        if self.sampler is not None:
            self.sampler.drop(handle)

    # ---- decode ----
    @_settles
    def decode(self, x, step: DecodeStep):
        """One decode step of a group's rows: x is the newest tokens [rows] (first stage) or the previous
        stage's hidden states [rows, D]. The cache is fitted to the step's window first. With its `join`, prompts
        joining free rows ride in the same pass (hidden states then [rows + T, D] between stages) and their rows'
        tokens are their first. Returns hidden states, or on the last stage the chosen tokens and their scores."""
        group, positions, join = step.group, step.positions, step.join
        self._fit_cache(group, step.window, shrink=not self.backend.attention)
        prefix = self._prefix(group)
        if step.packed is not None:
            p = step.packed
            h, self.caches[group] = self._step_packed(self.params, self.caches[group], x, p.src, p.ids, p.rows,
                                                      p.entries, p.out, prefix, self.lora.packed(p), p.verify)
        elif join is None:
            h, self.caches[group] = self._step(self.params, self.caches[group], x, positions,
                                               np.int32(step.read_len), prefix,
                                               self.lora.batch(step.adapters, positions.shape[0], self.ragged))
        else:
            block = (join.ids, join.rows, join.entries, join.seg)
            h, self.caches[group] = self._step_joining(self.params, self.caches[group], x, positions,
                                                       np.int32(step.read_len), block, join.last, join.last_rows,
                                                       prefix, self.lora.joining(step.adapters, positions.shape[0],
                                                                                 join))
        if self.sampler is None:
            return h
        return self.sampler.choose(self.params, h, step)

    decode_steps = _settles(StepsInOneCall.decode_steps)
    send_steps = _settles(StepsInOneCall.send_steps)

    def _prefix(self, group: int):
        """What a ragged step of the group reads cached prefixes from (steps.ragged_step's `prefix`); None on a stage
        that prefills prompts in passes of their own."""
        if not self.ragged:
            return None
        pool = self.pool if self.pool is not None else self._no_pool
        return pool["k"], pool["v"], self.ptab[group], self.plen[group]

    @_settles
    def use_prefix(self, group: int, row: int, blocks) -> None:
        """The row's prompt starts with these prefix-cache blocks (int32 [m]): its first m * PREFIX_BLOCK entries.
        A ragged stage reads them from the pool; another copies them into the row."""
        blocks = np.asarray(blocks, np.int32)
        if self.ragged:
            self.ptab[group][row] = 0
            self.ptab[group][row, :len(blocks)] = blocks
            self.plen[group][row] = len(blocks) * PREFIX_BLOCK
            return
        raise NotImplementedError("a stage without ragged steps takes cached prefixes through prefill_chunk")

    @_settles
    def store_row(self, group: int, row: int, ids) -> None:
        """A row's full blocks into the prefix cache's pool: block j of the row into pool block ids[j] (int32 [m];
        the pool's size for blocks not to keep), after the steps that wrote them."""
        n = kv_cache.cache_max_len(self.caches[group]) // PREFIX_BLOCK  # (one program a cache size)
        blocks = np.full(n, kv_cache.pool_blocks(self.pool), np.int32)
        blocks[:min(n, len(ids))] = np.asarray(ids, np.int32)[:n]
        self.pool = self._store_row(self.pool, self.caches[group], np.int32(row), blocks)

    def use_tokenizer(self, tokenizer_json: str, eos: int) -> None:
        """The last stage: the tokenizer structured output's grammars are matched against."""
        if self.sampler is not None:
            self.sampler.use_tokenizer(tokenizer_json, eos)

    def set_lora(self, slot: int, part, for_generate: bool = False) -> None:
        """LoRA slot `slot` holds `part` from the next step on (StageLora.set)."""
        self.lora.set(slot, part, for_generate)

    def lora_layout(self):
        return self.lora.layout

    @_settles
    def free(self, group: int, row: int) -> None:
        self.plen[group][row] = 0
        self.caches[group] = self._free(self.caches[group], np.int32(row))
        if self.sampler is not None:
            self.sampler.free(group, row)

    def cache_windows(self) -> list[int]:
        """The cache sizes this stage's groups step through (warm-up compiles each)."""
        return list(self.windows)

    def is_ragged(self) -> bool:
        """Does this stage run ragged steps (prompts continuing rows, cached prefixes read in place)?"""
        return self.ragged

    def platform(self) -> str:
        """Where this stage's weights lie: "cpu", "gpu", ... (the slot model sizes its joining blocks by it)."""
        return next(iter(self._devices)).platform if self._devices else "cpu"

    def _fit_cache(self, group: int, need: int, shrink: bool) -> None:
        """Resize a group's cache to the smallest window holding `need` entries, one window at a time (so
        only neighbouring sizes compile); without `shrink` it only grows."""
        target = next(w for w in self.windows if w >= need)
        at = self.windows.index(kv_cache.cache_max_len(self.caches[group]))
        while self.windows[at] < target or (shrink and self.windows[at] > target):
            at += 1 if self.windows[at] < target else -1
            self.caches[group] = self._resize(self.caches[group], self.windows[at])

    def begin_warmup(self) -> None:
        """Warm-up (Slots.warmup) starts: until end_warmup, each call settles the memory its compiles used, and on a
        stage whose weights lie on one device alone compiles its programs without running them (runner/programs.py).
        On a mesh (tensor-parallel, or a pipeline stage's mesh of one device) the programs' outputs carry their
        mesh in ways only a run shows, so there they run."""
        self._warming = True
        self.lora.warm()
        if self._alone:
            self.programs.begin()

    def abandon_warmup(self) -> None:
        """Warm-up failed: the programs run again (the compiles begun are waited for, their errors dropped: the
        failure that stopped warm-up is the one raised)."""
        self._warming = False
        if self.programs.compiling:
            with contextlib.suppress(Exception):
                self.programs.end()

    def end_warmup(self) -> None:
        """After warm-up grew group 0's cache to every window (its rows freed): compile the shrinking resizes
        where steps use them, then start every group from an empty smallest window cut from it. Arrays a
        step made are committed to their devices and fresh zeros are not, and jit compiles each apart: an
        empty cache made here is placed as the ones warm-up compiled the steps for."""
        if not self.backend.attention:
            for w in reversed(self.windows[:-1]):
                self._fit_cache(0, w, shrink=True)
        # one at a time, each old cache dropped before the next is made: making all the new ones first held
        # every group's cache twice (at OPT-1.3b's 8 x 256, a third of a stage's weights more at its peak)
        first, self.caches = self.caches[0], [None] * self.groups
        for g in range(self.groups):
            self.caches[g] = self._resize(self.caches[0] if g else first, self.windows[0])
            if g == 0:
                del first  # the others are cut from group 0's new cache: the old one goes first
        if self.sampler is not None:
            self.sampler.settle_groups()
        self._warming = False
        if self.programs.compiling:
            self.programs.end()  # (their lowerings stay: the first run of each calls the executable kept there)
        else:
            xla_cache.drop_staging_caches()
        if self._on_cpu:  # the weights are in place: from now on a step's temporaries stay in the heap
            heap.keep_heap()

    def ready(self) -> bool:
        return True

    # ---- whole sequences: generate() over a pipeline (runner/generate.py), left-padded batches ----
    def seq_open(self, key, batch: int, max_len: int) -> None:
        self.seqs[key] = self._new_cache(batch, max_len)

    def seq_prefill(self, key, x, mask, all_logits: bool = False, exclude=None):
        """-> hidden states [B, S, D], or on the last stage logits [B, V] (all positions: [B, S, V]); with
        `exclude` [B] (int32, -1 none; greedy rows) the last stage's argmax tokens [B] instead, each leaving out its
        excluded token (the screened head, as generate()'s first greedy token)."""
        if exclude is not None:
            fn = seq_prefill_greedy_fn(self.cfg, self.spec, self.backend)
            out, self.seqs[key] = fn(self.params, self.seqs[key], x, mask, np.asarray(exclude, np.int32),
                                     self.lora.generating(mask.shape[0]))
            return np.asarray(out) if self.spec.last else out
        out, self.seqs[key] = self._seq_prefill(self.params, self.seqs[key], x, mask, all_logits,
                                                self.lora.generating(mask.shape[0]))
        return np.asarray(out) if self.spec.last else out

    def seq_decode(self, key, x, positions, write_index):
        """-> hidden states [B, D], or on the last stage logits [B, V]."""
        out, self.seqs[key] = self._seq_decode(self.params, self.seqs[key], x, positions, write_index,
                                               self.lora.generating(positions.shape[0]))
        return np.asarray(out) if self.spec.last else out

    def seq_reorder(self, key, index) -> None:
        """Beam search: row i of the cache continues from row index[i]."""
        index = np.asarray(index, np.int32)
        n = kv_cache.cache_batch(self.seqs[key])
        if index.shape != (n,) or index.min(initial=0) < 0 or index.max(initial=0) >= n:
            raise ValueError(f"reorder index must be {n} row numbers in [0, {n}), got {index}")
        self.seqs[key] = self._seq_reorder(self.seqs[key], index)

    def seq_close(self, key) -> None:
        self.seqs.pop(key, None)

    # ---- speculative decoding (runner/speculative.py): a row's drafted tokens checked in one pass ----
    def seq_extend(self, key, x, start, chunk_mask, exclude=None, head: bool = True):
        """Tokens x [B, C] (the previous stage's hidden states [B, C, D] on a stage that is not first) at entries
        (= positions: unpadded rows) start..start+C-1 of each row, after its valid entries before `start` (any
        after it, drafts a check refused, are dropped: steps.extend_step); `chunk_mask` [B, C] marks the real ones
        (a right-padded chunk) -> hidden states [B, C, D], or on the last stage logits [B, C, V]; with `exclude`
        [B, C] (int32, -1 none; greedy rows) the last stage's argmax tokens [B, C] instead, each leaving out its
        excluded token (the screened head: no logits made). `head` False: only fed, the last stage returns None."""
        greedy = exclude is not None
        fn = seq_extend_fn(self.cfg, self.spec, self.backend, greedy, head or not self.spec.last)
        ex = np.asarray(exclude if greedy else np.zeros((0, 0)), np.int32)
        out, self.seqs[key] = fn(self.params, self.seqs[key], x, np.asarray(start, np.int32),
                                 np.asarray(chunk_mask, np.int32), ex, self.lora.generating(chunk_mask.shape[0]))
        if not self.spec.last:
            return out
        return np.asarray(out) if head else None

    def seq_continue(self, key, token: int, start: int, n: int, eos: int, held, cap: int) -> np.ndarray:
        """Greedy tokens after `token` (at entry `start`), up to n <= cap, stopping after `eos`, in one compiled
        loop (stage_programs.seq_continue_fn; a stage that is the whole model) -> the tokens [<= n]."""
        if not (self.spec.first and self.spec.last):
            raise ValueError("seq_continue runs on a stage that is the whole model")
        fn = seq_continue_fn(self.cfg, self.spec, self.backend, cap)
        out, count, self.seqs[key] = fn(self.params, self.seqs[key], np.array([token], np.int32), np.int32(start),
                                        np.int32(n), np.int32(eos), np.asarray(held, np.int32),
                                        self.lora.generating(1))
        return np.asarray(out)[:int(count)]

    # ---- a whole generate() as one compiled loop, on a stage that is the whole model ----
    def seq_generate(self, ids, mask, settings, max_new: int, new_bucket: int, pad: int, output_scores: bool):
        """Greedy or sampled rows (left-padded ids, mask [B, S]; sampling.make_settings' `settings`) -> (history
        [B, S + new_bucket], steps taken, processed scores [new_bucket, B, V] or [0, ...]): model/sample.py."""
        return sample.search(self.cfg, self.params, jnp.asarray(ids), jnp.asarray(mask), settings,
                             jnp.int32(max_new), new_bucket, pad, output_scores, self.backend,
                             self.lora.generating(len(ids)))

    def seq_beam_search(self, ids, mask, settings, max_new: int, k: int, n_return: int, length_penalty: float,
                        early_stop: bool, eos: int, pad: int, output_scores: bool, token=None):
        """Beam search over prompts repeated k times (rows [B*K]) -> model/beam_search.py's `search` result.
        `token`: beam_search.stoppable's, asked before every step (a stage in the asking process only)."""
        return beam_search.search(self.cfg, self.params, jnp.asarray(ids), jnp.asarray(mask), settings, max_new, k,
                                  n_return, length_penalty, early_stop, eos, pad, output_scores, self.backend,
                                  None if token is None else jnp.int32(token), self.lora.generating(len(ids)))


class Stages(Protocol):
    """How the driver reaches the stages. `call` returns a future (or, in process, the value itself);
    a future may be passed as an argument of the next stage's call; `get` waits for futures."""
    n: int

    def call(self, i: int, method: str, *args) -> Any: ...
    def get(self, futures) -> Any: ...
    def check_health(self) -> None: ...
    def close(self) -> None: ...


class LocalStages:
    """Stages in this process: calls run at once."""

    def __init__(self, stages: Sequence):
        self.stages = list(stages)
        self.n = len(self.stages)

    def call(self, i: int, method: str, *args):
        return getattr(self.stages[i], method)(*args)

    def get(self, futures):
        return futures

    def check_health(self) -> None:
        pass

    def close(self) -> None:
        pass

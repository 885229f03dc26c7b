"""The programs a stage jits (runner/stage.py's StageSlots runs them): one pass of its layers at each kind of step,
and the cache's own moves (insert a prefilled prompt, resize, free a row, the prefix cache's stores and gathers).

Each pass takes its rows' LoRA adapters as one more argument, last (model/lora.with_lora; None: no adapters). The
step functions are closures over the model's config, the stage's layers and its backend, which are fixed for a
stage: only arrays (and the few static sizes named) vary between calls, so each shape compiles once.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import Backend
from opt_serving.model import kv_cache, opt, steps
from opt_serving.model.lora import applied, with_lora
from opt_serving.runner.buckets import cache_bucket
from opt_serving.runner.sampler import split_rows


class StagePrograms(NamedTuple):
    """A stage's jitted programs (`stage_programs`)."""
    prefill: Callable        # k right-padded prompts in one pass -> k batch-1 caches, hidden states [k, n, D]
    chunk: Callable          # a chunk of a prompt into its batch-1 cache -> hidden states [1, C, D]
    step: Callable           # one decode step of a group's rows -> hidden states [rows, D], the cache
    step_joining: Callable   # the same with prompts joining free rows (a JoinBlock's arrays)
    step_packed: Optional[Callable]  # a ragged step's tokens as one list (a PackedTokens' arrays)
    steps: Optional[Callable]  # n decode steps in one call, each fed the last's tokens (whole-model stages only)
    seq_prefill: Callable    # generate() over a pipeline: a left-padded batch's prefill
    seq_decode: Callable     # ... and one decode step of it
    seq_reorder: Callable    # ... beam search: rows continue from others
    insert_cache: Callable   # a prefilled prompt's cache into a row of a group's cache
    gather: Callable         # prefix-cache blocks -> a batch-1 cache
    store: Callable          # a batch-1 cache's blocks into the pool
    store_row: Callable      # a group row's blocks into the pool
    resize: Callable         # a group's cache to another window (static size)
    free: Callable           # a group row freed


def stage_programs(cfg, stage: opt.StageSpec, backend: Backend, max_seq_len: int, new_cache,
                   choose=None, jit=jax.jit) -> StagePrograms:
    """The jitted programs of a stage over `stage`'s layers on `backend` (`new_cache(batch, entries)`: an empty
    cache of its layers; `choose`: the sampler's token choice, traced into the steps taken in one call, on a stage
    that is the whole model; without it there are none; `jit`: how each is jitted, runner/programs.py's
    `Programs.jit` for a stage that warm-up compiles without running)."""
    prefill, chunk, step, step_joining, step_packed = _passes(cfg, stage, backend, max_seq_len, new_cache)
    seq_prefill, seq_decode = _seq_passes(cfg, stage, backend)
    steps = None if choose is None else jit(with_lora(_many_steps(step, choose, _rows_pass(cfg, stage, backend))),
                                            static_argnums=(10,), donate_argnums=(1, 5))
    return StagePrograms(
        prefill=jit(with_lora(prefill)),
        chunk=jit(with_lora(chunk), donate_argnums=(1,)),
        step=jit(with_lora(step), donate_argnums=(1,)),
        step_joining=jit(with_lora(step_joining), donate_argnums=(1,)),
        step_packed=None if step_packed is None else jit(step_packed, donate_argnums=(1,)),  # (its own LoRA)
        steps=steps,
        seq_prefill=jit(with_lora(seq_prefill), static_argnums=(4,), donate_argnums=(1,)),
        seq_decode=jit(with_lora(seq_decode), donate_argnums=(1,)),
        seq_reorder=jit(kv_cache.reorder, donate_argnums=(0,)),
        insert_cache=jit(lambda cache, pcache, row: kv_cache._insert(cache, pcache, row), donate_argnums=(0,)),
        gather=jit(kv_cache.gather_blocks),  # one compile per cache size
        store=jit(kv_cache.store_blocks, donate_argnums=(0,)),
        store_row=jit(lambda pool, cache, row, ids: kv_cache.store_blocks(pool, cache, ids, row),
                      donate_argnums=(0,)),
        resize=jit(lambda cache, n: kv_cache._resize(cache, n), static_argnums=(1,)),
        free=jit(kv_cache.free_slot, donate_argnums=(0,)))


def _passes(cfg, stage: opt.StageSpec, backend: Backend, max_seq_len: int, new_cache):
    """The slots' passes of the stage's layers: (prefill, chunk, step, step_joining, step_packed (None without
    ragged steps)), not jitted."""
    def prefill(params, x, mask):
        """k right-padded prompts (ids [k, n], or the previous stage's hidden states [k, n, D]) in one
        pass -> k batch-1 caches and the hidden states [k, n, D] (final ones on the last stage)."""
        k, n = mask.shape  # [k, n]: n a prefill width, the cache a coarser size (cache_bucket)
        cache = new_cache(k, cache_bucket(n, max_seq_len))
        h, cache = steps.prefill_step(cfg, params, cache, x, mask, return_hidden=True, stage=stage,
                                      backend=backend)
        return split_rows(cache, k), h

    def chunk(params, cache, x, start, mask):
        """A chunk of a prompt's prefill into its batch-1 cache (steps.extend_step) -> hidden states [1, C, D]."""
        return steps.extend_step(cfg, params, cache, x, start, mask, return_hidden=True, stage=stage, backend=backend)

    ragged = backend.ragged  # prompts continue rows and cached prefixes are read in place (steps.ragged_step)
    no_block = (np.zeros(0, np.int32),) * 3

    def step(params, cache, x, pos, read_len, prefix=None):
        """The newest token (or its hidden state) of each row goes in at its own position; a row at position -1
        is not stepped (free, or its prompt is being prefilled: ragged steps leave its entries alone)."""
        if ragged:
            write = jnp.where(pos >= 0, pos, kv_cache.cache_max_len(cache))
            return steps.ragged_step(cfg, params, cache, x, jnp.maximum(pos, 0), write, no_block, prefix,
                                     stage=stage, backend=backend)
        pos = jnp.maximum(pos, 0)
        return steps.decode_step(cfg, params, cache, x, pos, pos, read_len=read_len, return_hidden=True,
                                 stage=stage, backend=backend)

    def step_joining(params, cache, x, pos, read_len, block, last, last_rows, prefix=None):
        # as `step`, with short prompts joining free rows whole in the same pass (steps.decode_joining_step; ragged
        # stages take every step's tokens as one list: step_packed); the last stage hands the sampler each
        # prompt's hidden state at its last token
        pos = jnp.maximum(pos, 0)
        h, cache = steps.decode_joining_step(cfg, params, cache, x, pos, pos, read_len, block, stage=stage,
                                             backend=backend)
        if stage.last:  # [B + T, D] -> [B, D]
            b = pos.shape[0]
            h = h[:b].at[last_rows].set(h[b + last], mode="drop")
        return h, cache

    return prefill, chunk, step, step_joining, _packed_pass(cfg, stage, backend) if ragged else None


def _packed_pass(cfg, stage: opt.StageSpec, backend: Backend):
    """A ragged stage's step of one list of tokens (step_packed), not jitted."""
    def step_packed(params, cache, x, src, ids, rows, entries, out, prefix=None, lora=None, verify=None):
        """A ragged step of one list of N tokens (runner.types.PackedTokens): x is the group's newest tokens [B]
        (first stage: a running row's token is x[src]) or the previous stage's hidden states [N, D]; the last
        stage hands the sampler each row's hidden state at its token `out` [B] -> [B, D]. There, with more
        tokens than rows, the last layer computes only those B past its k/v (opt.OPT's keep): the prompt
        tokens but each prompt's last need nothing more from it. (Not under LoRA adapters, whose products
        take every token's adapter.) With `verify` [E] (speculative decoding: the drafts' tokens in the list, -1
        padding) the last stage hands the sampler their hidden states too: [B + E, D]."""
        empty = jnp.zeros(0, jnp.int32)
        if stage.first:
            x = jnp.where(src >= 0, x[jnp.maximum(src, 0)], ids)  # [N]
            tokens, block = empty, (x, rows, entries)
        else:
            tokens, block = x, (empty, rows, entries)
        picks = out if verify is None else jnp.concatenate([out, verify])
        cut = stage.last and lora is None and picks.shape[0] < src.shape[0]
        keep = jnp.clip(picks, 0, src.shape[0] - 1) if cut else None
        with applied(lora):
            h, cache = steps.ragged_step(cfg, params, cache, tokens, empty, empty, block, prefix, stage=stage,
                                         backend=backend, keep=keep)
        if stage.last and keep is None:  # [N, D] -> [B (+ E), D]
            h = jnp.take(h, picks, axis=0, mode="clip")
        return h, cache
    return step_packed


def _rows_pass(cfg, stage: opt.StageSpec, backend: Backend):
    """A step of some of a group's rows only (the steps in one call, `_many_steps`), not jitted: a ragged one
    where the backend has ragged steps, else steps.rows_decode_step."""
    def rows_step(params, cache, x, pos, rows, prefix):
        """x [R] the rows' newest tokens, pos [R] their positions, rows [R] which rows of the cache (past them:
        padding, not stepped) -> hidden states [R, D], the cache: a step's products run at R rows, not the group's."""
        if not backend.ragged:
            return steps.rows_decode_step(cfg, params, cache, x, pos, rows, stage=stage, backend=backend)
        empty = jnp.zeros(0, jnp.int32)
        return steps.ragged_step(cfg, params, cache, empty, empty, empty, (x, rows, jnp.maximum(pos, 0)), prefix,
                                 stage=stage, backend=backend)
    return rows_step


def _seq_passes(cfg, stage: opt.StageSpec, backend: Backend):
    """generate()'s passes over a pipeline's whole-sequence caches: (seq_prefill, seq_decode), not jitted."""
    def seq_prefill(params, cache, x, mask, all_logits):
        return steps.prefill_step(cfg, params, cache, x, mask, all_logits=all_logits, stage=stage,
                                  backend=backend)

    def seq_decode(params, cache, x, positions, write_index):
        return steps.decode_step(cfg, params, cache, x, positions, write_index, stage=stage, backend=backend)

    return seq_prefill, seq_decode


def _many_steps(step, choose, rows_step):
    """`step` and the sampler's `choose` n times in one program (a stage that is the whole model), not jitted;
    `rows_step` (`_rows_pass`): the same step of some rows only."""
    def steps(params, cache, x, pos, read_len, state, settings, active, want_scores, want_top, n, prefix, rows=None):
        """`n` decode steps of a group in one call, each fed the tokens the last one chose (as n calls
        of `step` and Sampler.choose would) -> the cache, the sampling state, each step's (tokens, logprobs, top
        ids, top logprobs), stacked [n, rows, ...], and the group's newest tokens [B] (the next call's x, which
        can then stay on the device). Rows at position -1 stay so. x is the group's newest tokens [B]; with
        `rows` (int32 [R], DecodeStep.rows) pos [R] is those rows' and only they are computed: their tokens and
        sampling state are taken out of the group's before the steps and put back after, and the outputs are
        [n, R, ...]."""
        stepped, group_x = pos >= 0, x
        if rows is not None:  # (a padding row reads the last row's settings; it is not active, so nothing changes)
            x = x.at[rows].get(mode="fill", fill_value=0)
            settings, active = _take(settings, rows), active.at[rows].get(mode="fill", fill_value=False)
            whole, state = state, _take(state, rows)

        def one(carry, _):
            cache, x, pos, read_len, state = carry
            h, cache = step(params, cache, x, pos, read_len, prefix) if rows is None else \
                rows_step(params, cache, x, pos, rows, prefix)
            state, out = choose(params, h, state, settings, active, want_scores, want_top)
            return (cache, out[0], jnp.where(stepped, pos + 1, pos), read_len + 1, state), out
        (cache, last, _, _, state), outs = jax.lax.scan(one, (cache, x, pos, read_len, state), length=n)
        if rows is not None:
            state = jax.tree_util.tree_map(lambda a, b: a.at[rows].set(b, mode="drop"), whole, state)
            last = group_x.at[rows].set(last, mode="drop")
        return cache, state, outs, last

    return steps


def _take(tree, rows):
    """Each leaf's rows `rows` (past its rows: its last)."""
    return jax.tree_util.tree_map(lambda a: a.at[rows].get(mode="clip"), tree)


@functools.lru_cache(maxsize=None)
def seq_extend_fn(cfg, stage, backend, greedy: bool, head: bool = True):
    """A speculative check's pass (StageSlots.seq_extend): drafted tokens [B, C] after each row's cache, each
    query's attention as its own decode step's (steps.extend_step per_query) -> the greedy tokens [B, C] on the last
    stage (screened head), else its hidden states or logits. `head` False: the last stage's hidden states, no head
    run (tokens only fed to the cache: a head reads as many weights as the draft's layers do)."""
    def extend(params, cache, x, start, chunk_mask, exclude):
        out, cache = steps.extend_step(cfg, params, cache, x, start, chunk_mask, return_hidden=greedy or not head,
                                       stage=stage, backend=backend, per_query=True)
        if greedy and head and stage.last:  # [B, C, D] -> the tokens [B, C]
            b, c = chunk_mask.shape
            out = opt.lm_argmax(params, out.reshape(b * c, -1), exclude.reshape(-1), backend=backend).reshape(b, c)
        return out, cache
    return jax.jit(with_lora(extend), donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def seq_prefill_greedy_fn(cfg, stage, backend):
    """A speculative run's prefill: the first greedy token from the whole prompt (as plain generate()'s)."""
    def prefill(params, cache, x, mask, exclude):
        out, cache = steps.prefill_step(cfg, params, cache, x, mask, all_logits=False, return_hidden=True, stage=stage,
                                        backend=backend)
        return (opt.lm_argmax(params, out, exclude, backend=backend) if stage.last else out), cache
    return jax.jit(with_lora(prefill), donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def seq_continue_fn(cfg, stage, backend, cap: int):
    """Greedy decoding continued in one compiled loop, on a stage that is the whole model (StageSlots.seq_continue:
    a speculative run's rounds that draft nothing, which called one token at a time would each cost a round trip
    to the host): the newest token [1] goes in at entry `start` (entries from there on dropped: drafts a check
    refused), then up to `n` <= cap tokens are chosen, each as generate()'s decode steps choose it (step i leaves
    out `held` [cap][i]: EOS held back by min_new_tokens; -1 none), stopping after `eos` -> (tokens [cap], how
    many were chosen, cache)."""
    def run(params, cache, token, start, n, eos, held):
        entries = jnp.arange(cache["mask"].shape[1])[None]  # [1, max_len]
        cache = dict(cache, mask=cache["mask"] & (entries < start))

        def body(c):
            i, tok, cache, out = c
            h, cache = steps.decode_step(cfg, params, cache, tok, (start + i)[None], start + i,
                                         read_len=start + i + 1, return_hidden=True, stage=stage, backend=backend)
            tok = opt.lm_argmax(params, h, held[i][None], backend=backend)  # [1]
            return i + 1, tok, cache, out.at[i].set(tok[0])

        def going(c):
            return (c[0] < n) & (c[1][0] != eos)
        i, _, cache, out = jax.lax.while_loop(going, body, (jnp.int32(0), token, cache, jnp.zeros(cap, jnp.int32)))
        return out, i, cache
    return jax.jit(with_lora(run), donate_argnums=(1,))

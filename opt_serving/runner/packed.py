"""A ragged step's tokens as one list (runner.types.PackedTokens), as `Slots` sends it to the stages:

    [ each running row's newest token | the rows' drafts (speculative decoding) | the prompts' parts | padding ]

padded to the smallest block size that holds them, so a step's products run at the tokens it has, not at every row
of the group. A row's drafts continue it: each is written at the entry after the one before it and reads the row's
entries up to itself, as a prompt's later part does.

Several steps in one call (DecodeStep.rows) likewise compute only the running rows, padded to a
buckets.step_rows size: `rows_in` takes their inputs out of the group's, `rows_out` puts their outputs back.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from opt_serving.runner.buckets import step_rows
from opt_serving.runner.types import JoinBlock, PackedTokens


def pack_step(positions: np.ndarray, block: Optional[JoinBlock], adapters, sizes: Sequence[int],
              lora: bool, drafts: Sequence = (), verify_rows: int = 0, k: int = 0) -> PackedTokens:
    """The step's list: positions [rows] each row's newest token's position (-1: not stepped), `block` the prompts'
    parts, `adapters` [rows] each row's LoRA adapter slot (with `lora`: adapters are served), `drafts` the rows'
    drafts (runner/ngram.Draft: row, tokens), checked in `verify_rows` rows by the sampler, at most `k` a row."""
    rows = len(positions)
    running = np.flatnonzero(positions >= 0).astype(np.int32)
    nd, real = len(running), 0 if block is None else int((block.rows < rows).sum())  # (the block's padding last)
    nv = sum(len(d.tokens) for d in drafts)
    n = next(b for b in sizes if b >= nd + nv + real)
    src, ids = np.full(n, -1, np.int32), np.zeros(n, np.int32)
    at_rows, entries, out = np.full(n, rows, np.int32), np.zeros(n, np.int32), np.zeros(rows, np.int32)
    src[:nd], at_rows[:nd], entries[:nd], out[running] = running, running, positions[running], np.arange(nd)
    tokens = None
    if lora:
        tokens = np.full(n, -1, np.int32)
        if adapters is not None:
            tokens[:nd] = np.asarray(adapters, np.int32)[running]
    spec = {}
    if drafts:
        verify = np.full(verify_rows, -1, np.int32)
        draft_ids, draft_at = np.full((rows, k), -1, np.int32), np.full((rows, k), -1, np.int32)
        at = nd
        for d in drafts:
            m = len(d.tokens)
            ids[at:at + m], at_rows[at:at + m] = d.tokens, d.row
            entries[at:at + m] = positions[d.row] + 1 + np.arange(m)
            verify[at - nd:at - nd + m] = np.arange(at, at + m)
            draft_ids[d.row, :m], draft_at[d.row, :m] = d.tokens, np.arange(at - nd, at - nd + m)
            if tokens is not None and adapters is not None:
                tokens[at:at + m] = adapters[d.row]
            at += m
        spec = dict(verify=verify, draft_ids=draft_ids, draft_at=draft_at)
    if block is not None:
        first = nd + nv
        ids[first:first + real], at_rows[first:first + real], entries[first:first + real] = (
            block.ids[:real], block.rows[:real], block.entries[:real])
        final = block.last_rows < rows  # the prompts whose last part is here: their rows' first tokens
        out[block.last_rows[final]] = first + block.last[final]
        if tokens is not None and block.adapters is not None:
            tokens[first:first + real] = block.adapters[:real]
    return PackedTokens(src, ids, at_rows, entries, out, tokens, **spec)


def running_rows(sent: np.ndarray) -> Optional[np.ndarray]:
    """DecodeStep.rows for several steps of the rows `sent` (bool [B]): the running ones, padded with B to a
    buckets.step_rows size; None where that size is every row."""
    running = np.flatnonzero(sent).astype(np.int32)
    r = step_rows(len(running), len(sent))
    return None if r >= len(sent) else np.concatenate([running, np.full(r - len(running), len(sent), np.int32)])


def rows_in(rows: np.ndarray, positions: np.ndarray, adapters: Optional[np.ndarray]):
    """The inputs of the steps of `rows` (int32 [R], padded with the group's row count): their positions and LoRA
    adapters, each [R] from the group's [B] (a padding row: position -1, no adapter). Their tokens are taken out
    of the group's in the steps' program, where the group's may already be (the last call's, on the device)."""
    b = len(positions)
    real, at = rows < b, np.minimum(rows, b - 1)
    positions = np.where(real, positions[at], -1).astype(np.int32)
    return positions, None if adapters is None else np.where(real, adapters[at], -1).astype(np.int32)


def rows_out(a: np.ndarray, rows: np.ndarray, b: int) -> np.ndarray:
    """The steps' outputs of `rows` [n, R, ...] into the group's [n, b, ...] (the rows not computed: zeros)."""
    real = rows < b
    out = np.zeros((a.shape[0], b) + a.shape[2:], a.dtype)
    out[:, rows[real]] = a[:, real]
    return out

"""A ragged step's tokens as one list (runner.types.PackedTokens), as `Slots` sends it to the stages:

    [ each running row's newest token | the rows' drafts (speculative decoding) | the prompts' parts | padding ]

padded to the smallest block size that holds them, so a step's products run at the tokens it has, not at every row
of the group. A row's drafts continue it: each is written at the entry after the one before it and reads the row's
entries up to itself, as a prompt's later part does.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

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

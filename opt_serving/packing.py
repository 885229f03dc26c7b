"""Host-side hot paths of serving: packing prompts into batches, scanning for stop sequences.

These run in Python for every batch and every streamed token, so they have a
Cython twin in `_speedups.pyx` with exactly the same results. The compiled one
is used when it is built (`./build.sh` or `pip install -e .`) unless
OPT_SERVING_NO_CEXT=1; `HAVE_CEXT` says which is live, `PY` always holds the
pure-Python versions (the tests compare the two).
"""
from __future__ import annotations

import operator
import os
from types import SimpleNamespace
from typing import Sequence

import numpy as np

_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1


def _row_array(tokens, b: int, length: int) -> np.ndarray:
    """One prompt as an int32 array, with an error naming the row for anything odd."""
    n = len(tokens)
    if n > length:
        raise ValueError(f"row {b} has {n} tokens, longer than the padded length {length}")
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"row {b} is not a flat list of token ids (shape {arr.shape})")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"row {b}: token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < _INT32_MIN or arr.max() > _INT32_MAX:
        raise ValueError(f"row {b}: token id out of int32 range")
    return arr.astype(np.int32)


def pack_left_padded(token_lists: Sequence[Sequence[int]], length: int,
                     pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ragged prompts -> left-padded `(ids, mask, positions)`, each int32 `[batch, length]`.

    Left padding keeps every prompt's last token in the last column, so one
    decode step appends to all rows at the same index. Positions count real
    tokens from 0 (pads get 0); the model adds OPT's offset of 2 itself.
    """
    length = operator.index(length)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    batch = len(token_lists)
    ids = np.full((batch, length), pad_id, dtype=np.int32)
    mask = np.zeros((batch, length), dtype=np.int32)
    positions = np.zeros((batch, length), dtype=np.int32)
    for b, tokens in enumerate(token_lists):
        row = _row_array(tokens, b, length)
        n = row.shape[0]
        if n:
            ids[b, length - n:] = row
            mask[b, length - n:] = 1
            positions[b, length - n:] = np.arange(n, dtype=np.int32)
    return ids, mask, positions


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n, so jitted shapes come from a short fixed list."""
    best = -1
    for b in buckets:
        if b >= n and (best < 0 or b < best):
            best = b
    if best < 0:
        largest = max(buckets) if len(buckets) else None
        raise ValueError(f"length {n} is longer than the largest bucket {largest}")
    return best


def _check_stops(stops) -> None:
    if isinstance(stops, (str, bytes)):
        raise TypeError("stops must be a list of stop sequences, not a single string")
    for s in stops:
        if len(s) == 0:
            raise ValueError("stop sequences must not be empty")


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, int]:
    """Where to cut streamed `text` at a stop string, and how much of it is safe to emit.

    Returns `(cut, safe_len)`. `cut` is the index of the earliest complete stop
    match beginning at or after `start`, or -1. `safe_len` is the length of the
    prefix that no stop can still claim: `cut` when there is a match, else the
    start of the earliest tail of `text` that is a proper beginning of some stop
    (held back until more text rules it in or out), else `len(text)`.
    Pass the previous `safe_len` as `start` when scanning a growing text.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    _check_stops(stops)
    n = len(text)
    start = max(0, min(operator.index(start), n))
    cut = -1
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (cut < 0 or i < cut):
            cut = i
    if cut >= 0:
        return cut, cut
    safe = n
    for s in stops:
        # longest k < len(s) with text ending in s[:k], not reaching before `start`
        for k in range(min(len(s) - 1, n - start), 0, -1):
            if n - k < safe and text.endswith(s[:k]):
                safe = n - k
                break
    return -1, safe


def find_stop_ids(ids: Sequence[int], stops: Sequence[Sequence[int]],
                  start: int = 0) -> tuple[int, int]:
    """`find_stop` over token ids: `stops` are token sequences, indices count tokens."""
    _check_stops(stops)
    n = len(ids)
    start = max(0, min(operator.index(start), n))
    # only the tail from `start` matters, so a growing list costs O(new tokens) per call
    stops = [[operator.index(t) for t in s] for s in stops]
    tail = [operator.index(t) for t in ids[start:]]
    m = len(tail)
    for i in range(m):
        for s in stops:
            if tail[i:i + len(s)] == s:
                return start + i, start + i
    safe = m
    for s in stops:
        for k in range(min(len(s) - 1, m), 0, -1):
            if m - k < safe and tail[m - k:] == s[:k]:
                safe = m - k
                break
    return -1, start + safe


PY = SimpleNamespace(pack_left_padded=pack_left_padded, bucket_length=bucket_length,
                     find_stop=find_stop, find_stop_ids=find_stop_ids)

HAVE_CEXT = False
if os.environ.get("OPT_SERVING_NO_CEXT") != "1":
    try:
        from opt_serving import _speedups
    except ImportError:  # not built: the Python versions above stay in place
        pass
    else:
        pack_left_padded = _speedups.pack_left_padded  # noqa: F811
        bucket_length = _speedups.bucket_length  # noqa: F811
        find_stop = _speedups.find_stop  # noqa: F811
        find_stop_ids = _speedups.find_stop_ids  # noqa: F811
        HAVE_CEXT = True

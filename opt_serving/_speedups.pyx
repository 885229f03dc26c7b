# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled twins of the functions in `opt_serving/packing.py`.

Same signatures, same results, same errors (tests/test_packing.py runs both on
the same inputs). Read packing.py for what each function means; this file only
says how it is made fast. Anything unusual (numpy rows, bools, huge ints)
drops to the same numpy path as the Python version, so errors match.
"""
import operator

import numpy as np

from cpython.long cimport PyLong_AsLongLong, PyLong_AsLongLongAndOverflow
from cpython.number cimport PyNumber_Index
from libc.stdlib cimport free, malloc

cdef long long INT32_MIN = -2147483648
cdef long long INT32_MAX = 2147483647


def _row_array(tokens, Py_ssize_t b, Py_ssize_t length):
    # kept identical to packing._row_array (importing it would be circular)
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
    if arr.min() < INT32_MIN or arr.max() > INT32_MAX:
        raise ValueError(f"row {b}: token id out of int32 range")
    return arr.astype(np.int32)


def pack_left_padded(token_lists, length, pad_id):
    cdef Py_ssize_t L = operator.index(length)
    if L < 0:
        raise ValueError(f"length must be >= 0, got {L}")
    cdef Py_ssize_t batch = len(token_lists)
    ids_arr = np.full((batch, L), pad_id, dtype=np.int32)
    mask_arr = np.zeros((batch, L), dtype=np.int32)
    pos_arr = np.zeros((batch, L), dtype=np.int32)
    cdef int[:, ::1] ids = ids_arr
    cdef int[:, ::1] mask = mask_arr
    cdef int[:, ::1] pos = pos_arr
    cdef int[::1] row_view
    cdef list row_list
    cdef Py_ssize_t bi, j, n, off
    cdef long long v
    cdef int overflow = 0
    cdef bint fast
    for bi in range(batch):
        tokens = token_lists[bi]
        n = len(tokens)
        if n > L:
            raise ValueError(f"row {bi} has {n} tokens, longer than the padded length {L}")
        off = L - n
        fast = type(tokens) is list
        if fast:
            # the common case, a list of Python ints: straight into the buffers
            row_list = <list>tokens
            for j in range(n):
                item = row_list[j]
                if type(item) is not int:
                    fast = False
                    break
                v = PyLong_AsLongLongAndOverflow(item, &overflow)
                if overflow or v < INT32_MIN or v > INT32_MAX:
                    fast = False
                    break
                ids[bi, off + j] = <int>v
                mask[bi, off + j] = 1
                pos[bi, off + j] = <int>j
        if not fast:
            row_view = _row_array(tokens, bi, L)
            for j in range(n):
                ids[bi, off + j] = row_view[j]
                mask[bi, off + j] = 1
                pos[bi, off + j] = <int>j
    return ids_arr, mask_arr, pos_arr


def bucket_length(n, buckets):
    best = -1
    for b in buckets:
        if b >= n and (best < 0 or b < best):
            best = b
    if best < 0:
        largest = max(buckets) if len(buckets) else None
        raise ValueError(f"length {n} is longer than the largest bucket {largest}")
    return best


def _check_stops(stops):
    if isinstance(stops, (str, bytes)):
        raise TypeError("stops must be a list of stop sequences, not a single string")
    for s in stops:
        if len(s) == 0:
            raise ValueError("stop sequences must not be empty")


def find_stop(str text not None, stops, start=0):
    _check_stops(stops)
    cdef Py_ssize_t n = len(text)
    cdef Py_ssize_t st = max(0, min(operator.index(start), n))
    cdef Py_ssize_t cut = -1, i, j, k, safe
    cdef str s
    for s in stops:
        i = text.find(s, st)
        if i >= 0 and (cut < 0 or i < cut):
            cut = i
    if cut >= 0:
        return cut, cut
    # held-back tail: compare characters in place instead of slicing + endswith
    safe = n
    for s in stops:
        for k in range(min(len(s) - 1, n - st), 0, -1):
            if n - k >= safe:
                break
            for j in range(k):
                if <Py_UCS4>text[n - k + j] != <Py_UCS4>s[j]:
                    break
            else:
                safe = n - k
                break
    return -1, safe


cdef long long* _to_c(seq, Py_ssize_t m) except NULL:
    cdef long long* buf = <long long*>malloc((m if m > 0 else 1) * sizeof(long long))
    if buf == NULL:
        raise MemoryError()
    cdef Py_ssize_t i
    try:
        for i in range(m):
            buf[i] = PyLong_AsLongLong(PyNumber_Index(seq[i]))
    except BaseException:
        free(buf)
        raise
    return buf


def find_stop_ids(ids, stops, start=0):
    _check_stops(stops)
    cdef Py_ssize_t n = len(ids)
    cdef Py_ssize_t st = max(0, min(operator.index(start), n))
    tail = ids[st:]
    if isinstance(tail, np.ndarray):
        tail = tail.tolist()
    elif type(tail) is not list:
        tail = list(tail)
    stops = [list(s) for s in stops]
    cdef Py_ssize_t m = len(tail), ns = len(stops)
    cdef Py_ssize_t i, j, k, q, ls, safe
    cdef long long* t = NULL
    cdef long long** sv = <long long**>malloc((ns if ns > 0 else 1) * sizeof(long long*))
    cdef Py_ssize_t* sl = <Py_ssize_t*>malloc((ns if ns > 0 else 1) * sizeof(Py_ssize_t))
    if sv == NULL or sl == NULL:
        free(sv)
        free(sl)
        raise MemoryError()
    for q in range(ns):
        sv[q] = NULL
    try:
        # convert the stops first: the Python version checks them before the tail
        for q in range(ns):
            sl[q] = len(stops[q])
            sv[q] = _to_c(stops[q], sl[q])
        t = _to_c(tail, m)
        for i in range(m):
            for q in range(ns):
                ls = sl[q]
                if i + ls > m:
                    continue
                for j in range(ls):
                    if t[i + j] != sv[q][j]:
                        break
                else:
                    return st + i, st + i
        safe = m
        for q in range(ns):
            for k in range(min(sl[q] - 1, m), 0, -1):
                if m - k >= safe:
                    break
                for j in range(k):
                    if t[m - k + j] != sv[q][j]:
                        break
                else:
                    safe = m - k
                    break
        return -1, st + safe
    finally:
        for q in range(ns):
            free(sv[q])
        free(sv)
        free(sl)
        free(t)

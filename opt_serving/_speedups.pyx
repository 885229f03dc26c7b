# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled twin of the function in `opt_serving/text/packing.py`.

Same signature, same results, same errors (tests/test_packing.py runs both on
the same inputs). Read packing.py for what it means; this file only says how it
is made fast.
"""
import operator


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

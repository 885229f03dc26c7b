"""glibc's malloc told to keep its heap, in a process that steps a model on the CPU (`keep_heap`).

XLA's CPU runtime gives each call of a compiled function its temporaries as one block, allocated when the call
starts and freed when it ends. The decode slots' token choice needs tens of MB of them at 32 slots (the
sampling branch's [slots, vocabulary] arrays are laid out even in steps that take the plain argmax), more than
the largest block glibc keeps in its heap by its own rule (32 MB); and a block freed at the top of a heap is
handed back to the kernel once the free space passes the trim threshold. Either way the pages a step touches
were faulted in and zeroed again at every decode step. With both thresholds raised the block stays in the heap
and every step reuses it.

The engine calls this once its model is loaded and warmed up (StageSlots.end_warmup), not before: a higher trim
threshold set during the load would keep the float32 weights freed there (after packing) in the process.
OPT_SERVING_KEEP_HEAP=0, or a malloc setting of the user's own (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
a glibc.malloc tunable in GLIBC_TUNABLES), leaves malloc as it is; so does a C library without mallopt.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator, Mapping

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
# blocks below this come from the heap (a step's temporaries; the weights, allocated before, are not affected)
MMAP_THRESHOLD = 256 << 20
# free space at the top of a heap kept for the next step rather than handed back
TRIM_THRESHOLD = 1 << 30

_done = False


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether keep_heap may change malloc's settings: not turned off, and none of the user's own."""
    return (env.get("OPT_SERVING_KEEP_HEAP", "1") != "0"
            and not any(k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
            and "glibc.malloc." not in env.get("GLIBC_TUNABLES", ""))


def keep_heap(env: Mapping[str, str] = os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once) -> whether they are raised."""
    global _done
    if _done or not wanted(env):
        return _done
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done


# while a model loads: blocks from this size on come straight from the kernel and go back to it when freed
LOAD_MMAP_THRESHOLD = 1 << 20
DEFAULT_TRIM_THRESHOLD = 128 << 10  # glibc's


@contextlib.contextmanager
def returning_freed_blocks(env: Mapping[str, str] = os.environ) -> Iterator[bool]:
    """While a model loads a layer at a time (model/layout.py: runtime_parts), each layer's freed checkpoint
    arrays go back to the kernel: glibc's mmap threshold, left to itself, climbs to the size of each large block
    freed (up to 32 MB), after which the next layers' blocks come from the heap, where the freed ones stay
    between the packed weights kept (130 MB of a 220 MB stage's share stayed resident so, measured). The
    threshold is fixed at 1 MB for the load and stays there until keep_heap raises it after warm-up (setting it
    ends glibc's dynamic rule for good); where keep_heap's settings were in force already, they are put back.
    Yields whether it changed anything (not where the user set malloc up, or not glibc)."""
    mallopt = _mallopt() if wanted(env) else None
    if mallopt is None:
        yield False
        return
    mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
    try:
        yield True
    finally:
        if _done:  # keep_heap's settings, as they were
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def _mallopt():
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def trim() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc's malloc_trim), wherever they lie: a compile's
    freed memory between blocks still in use is not trimmed by the thresholds. -> whether any was returned."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))

"""Host-side hot path of serving: scanning streamed text for stop strings.

It runs in Python for every streamed token, so it has a Cython twin in
`_speedups.pyx` with exactly the same results. The compiled one is used when it
is built (`./build.sh` or `pip install -e .`) unless OPT_SERVING_NO_CEXT=1
(Settings.cext); `HAVE_CEXT` says which is live, `PY` always holds the
pure-Python version (the tests compare the two).
"""
from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Sequence

from opt_serving.settings import Settings


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


PY = SimpleNamespace(find_stop=find_stop)

HAVE_CEXT = False
if Settings.from_env().cext:
    try:
        from opt_serving import _speedups
    except ImportError:  # not built: the Python version above stays in place
        pass
    else:
        find_stop = _speedups.find_stop  # noqa: F811
        HAVE_CEXT = True

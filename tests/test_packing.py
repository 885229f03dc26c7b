"""packing.py and its Cython twin: both checked against a brute-force oracle and against each other."""
import os
import random
import subprocess
import sys

import pytest

from opt_serving.text import packing

try:
    from opt_serving import _speedups as C
except ImportError:
    C = None

PY = packing.PY
IMPLS = [pytest.param(PY, id="python"),
         pytest.param(C, id="cython", marks=pytest.mark.skipif(
             C is None, reason="opt_serving._speedups not built (run ./build.sh)"))]
needs_c = pytest.mark.skipif(C is None, reason="opt_serving._speedups not built (run ./build.sh)")


# ---- the oracle: the definition, written as plainly as possible ----

def oracle_stop(seq, stops, start):
    """The earliest stop at or after start, and the safe length (see packing.find_stop)."""
    n = len(seq)
    start = max(0, min(start, n))
    for i in range(start, n):
        if any(list(seq[i:i + len(s)]) == list(s) for s in stops):
            return i, i
    for i in range(start, n):
        tail = list(seq[i:])
        if any(len(tail) < len(s) and list(s[:len(tail)]) == tail for s in stops):
            return -1, i
    return -1, n


# ---- find_stop (text) ----

@pytest.mark.parametrize("impl", IMPLS)
def test_find_stop_edge_cases(impl):
    assert impl.find_stop("hello wor", ["world"]) == (-1, 6)          # "wor" held back
    assert impl.find_stop("hello world!", ["world", "lo w"]) == (3, 3)  # earliest match wins
    assert impl.find_stop("abc", []) == (-1, 3)
    assert impl.find_stop("", ["x"]) == (-1, 0)
    assert impl.find_stop("xx\n\nyy", ["\n\n"]) == (2, 2)
    assert impl.find_stop("x\n", ["\n\n"]) == (-1, 1)
    assert impl.find_stop("ab ab", ["ab"], start=1) == (3, 3)        # matches before start ignored
    assert impl.find_stop("abc", ["c"], start=99) == (-1, 3)         # start clamped
    assert impl.find_stop("naïve 🙂 tea", ["🙂 t"]) == (6, 6)          # non-ASCII, 4-byte chars
    assert impl.find_stop("naïve 🙂", ["🙂 t"]) == (-1, 6)
    with pytest.raises(ValueError, match="must not be empty"):
        impl.find_stop("abc", ["x", ""])
    with pytest.raises(TypeError, match="not a single string"):
        impl.find_stop("abc", "b")
    with pytest.raises(TypeError):
        impl.find_stop(b"abc", [b"b"])


@pytest.mark.parametrize("impl", IMPLS)
def test_find_stop_random_matches_oracle(impl):
    rng = random.Random(2)
    alphabet = "ab\né"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(0, 3))]
        start = rng.randint(0, len(text) + 1)
        assert impl.find_stop(text, stops, start) == oracle_stop(text, stops, start), \
            (text, stops, start)


@pytest.mark.parametrize("impl", IMPLS)
def test_find_stop_streaming_emits_exactly_the_text_before_the_stop(impl):
    """Feeding text a chunk at a time, with start = previous safe_len, never emits
    any part of a stop and ends with exactly the text before the first stop."""
    rng = random.Random(3)
    for _ in range(300):
        full = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 2))]
        firsts = [full.find(s) for s in stops if s in full]
        expected = full[:min(firsts)] if firsts else full
        text, emitted, safe, cut, i = "", "", 0, -1, 0
        while i < len(full) and cut < 0:
            step = rng.randint(1, 5)
            text, i = text + full[i:i + step], i + step
            cut, new_safe = impl.find_stop(text, stops, start=safe)
            assert new_safe >= safe
            emitted += text[safe:new_safe]
            safe = new_safe
        if cut < 0:  # generation ended: the held-back tail is released
            emitted += text[safe:]
        assert emitted == expected, (full, stops)


# ---- which implementation is live ----

def test_no_cext_env_selects_python_versions():
    code = ("from opt_serving.text import packing as p; "
            "print(p.HAVE_CEXT, p.find_stop is p.PY.find_stop)")
    env = dict(os.environ, OPT_SERVING_NO_CEXT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]


@needs_c
def test_built_extension_is_used_by_default():
    if os.environ.get("OPT_SERVING_NO_CEXT") == "1":
        pytest.skip("OPT_SERVING_NO_CEXT=1 in this environment")
    assert packing.HAVE_CEXT
    assert packing.find_stop is C.find_stop

"""packing.py and its Cython twin: both checked against brute-force oracles and against each other."""
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from opt_serving import packing

try:
    from opt_serving import _speedups as C
except ImportError:
    C = None

PY = packing.PY
IMPLS = [pytest.param(PY, id="python"),
         pytest.param(C, id="cython", marks=pytest.mark.skipif(
             C is None, reason="opt_serving._speedups not built (run ./build.sh)"))]
needs_c = pytest.mark.skipif(C is None, reason="opt_serving._speedups not built (run ./build.sh)")


# ---- oracles: the definitions, written as plainly as possible ----

def oracle_pack(rows, length, pad):
    ids = [[pad] * length for _ in rows]
    mask = [[0] * length for _ in rows]
    pos = [[0] * length for _ in rows]
    for b, row in enumerate(rows):
        for j, t in enumerate(row):
            col = length - len(row) + j
            ids[b][col], mask[b][col], pos[b][col] = t, 1, j
    return [np.array(x, dtype=np.int32).reshape(len(rows), length) for x in (ids, mask, pos)]


def oracle_stop(seq, stops, start):
    """Works for str and for lists of ids alike."""
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


# ---- pack_left_padded ----

@pytest.mark.parametrize("impl", IMPLS)
def test_pack_edge_cases(impl):
    ids, mask, pos = impl.pack_left_padded([[5, 6, 7], [8], []], 4, pad_id=1)
    assert ids.tolist() == [[1, 5, 6, 7], [1, 1, 1, 8], [1, 1, 1, 1]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert pos.tolist() == [[0, 0, 1, 2], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert ids.dtype == mask.dtype == pos.dtype == np.int32
    # a full row, numpy and tuple rows, numpy int scalars inside a list
    rows = [[1, 2], np.array([3, 4], dtype=np.int64), (9,), [np.int32(7), 8]]
    ids, mask, _ = impl.pack_left_padded(rows, 2, pad_id=0)
    assert ids.tolist() == [[1, 2], [3, 4], [0, 9], [7, 8]]
    assert mask.sum() == 7
    ids, mask, pos = impl.pack_left_padded([], 3, pad_id=1)
    assert ids.shape == mask.shape == pos.shape == (0, 3)
    assert impl.pack_left_padded([[]], 0, pad_id=1)[0].shape == (1, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_errors_name_the_problem(impl):
    with pytest.raises(ValueError, match=r"row 1 has 3 tokens, longer than the padded length 2"):
        impl.pack_left_padded([[1], [1, 2, 3]], 2, pad_id=0)
    with pytest.raises(ValueError, match="length must be >= 0"):
        impl.pack_left_padded([[1]], -1, pad_id=0)
    with pytest.raises(TypeError, match="row 0: token ids must be integers"):
        impl.pack_left_padded([[1.5, 2.0]], 4, pad_id=0)
    with pytest.raises(TypeError, match="row 1: token ids must be integers"):
        impl.pack_left_padded([[1], [True]], 4, pad_id=0)
    with pytest.raises(ValueError, match="row 0: token id out of int32 range"):
        impl.pack_left_padded([[2**31]], 4, pad_id=0)
    with pytest.raises(ValueError, match="row 0 is not a flat list"):
        impl.pack_left_padded([[[1, 2]]], 4, pad_id=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_random_matches_oracle(impl):
    rng = random.Random(0)
    for _ in range(200):
        length = rng.randint(0, 12)
        rows = [[rng.randint(-5, 50_000) for _ in range(rng.randint(0, length))]
                for _ in range(rng.randint(0, 6))]
        pad = rng.randint(0, 3)
        got = impl.pack_left_padded(rows, length, pad)
        for g, want in zip(got, oracle_pack(rows, length, pad)):
            np.testing.assert_array_equal(g, want)


@needs_c
def test_pack_python_and_cython_identical_on_realistic_batch():
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 50272, size=rng.integers(1, 513)).tolist() for _ in range(64)]
    for a, b in zip(PY.pack_left_padded(rows, 512, 1), C.pack_left_padded(rows, 512, 1)):
        np.testing.assert_array_equal(a, b)


# ---- bucket_length ----

@pytest.mark.parametrize("impl", IMPLS)
def test_bucket_length(impl):
    buckets = [256, 64, 1024, 128]
    assert [impl.bucket_length(n, buckets) for n in (0, 1, 64, 65, 1000, 1024)] == \
        [64, 64, 64, 128, 1024, 1024]
    with pytest.raises(ValueError, match="length 1025 is longer than the largest bucket 1024"):
        impl.bucket_length(1025, buckets)
    with pytest.raises(ValueError, match="largest bucket None"):
        impl.bucket_length(1, [])


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


# ---- find_stop_ids ----

@pytest.mark.parametrize("impl", IMPLS)
def test_find_stop_ids_edge_cases(impl):
    assert impl.find_stop_ids([1, 2, 3, 4], [[3, 4]]) == (2, 2)
    assert impl.find_stop_ids([1, 2, 3], [[3, 4], [2, 3, 9]]) == (-1, 1)
    assert impl.find_stop_ids(np.array([5, 2, 2], dtype=np.int32), [[2]], start=2) == (2, 2)
    assert impl.find_stop_ids([], [[2]]) == (-1, 0)
    assert impl.find_stop_ids((7, 8), [(8,)]) == (1, 1)
    with pytest.raises(ValueError, match="must not be empty"):
        impl.find_stop_ids([1], [[]])
    with pytest.raises(TypeError):
        impl.find_stop_ids([1.5], [[1]])
    with pytest.raises(TypeError):
        impl.find_stop_ids([1], [[1.0]])


@pytest.mark.parametrize("impl", IMPLS)
def test_find_stop_ids_random_matches_oracle(impl):
    rng = random.Random(4)
    for _ in range(3000):
        ids = [rng.randint(0, 2) for _ in range(rng.randint(0, 14))]
        stops = [[rng.randint(0, 2) for _ in range(rng.randint(1, 4))]
                 for _ in range(rng.randint(0, 3))]
        start = rng.randint(0, len(ids) + 1)
        arg = np.array(ids, dtype=np.int64) if rng.random() < 0.3 else ids
        assert impl.find_stop_ids(arg, stops, start) == oracle_stop(ids, stops, start), \
            (ids, stops, start)


# ---- which implementation is live ----

def test_no_cext_env_selects_python_versions():
    code = ("from opt_serving import packing as p; "
            "print(p.HAVE_CEXT, p.find_stop is p.PY.find_stop, p.pack_left_padded is p.PY.pack_left_padded)")
    env = dict(os.environ, OPT_SERVING_NO_CEXT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True", "True"]


@needs_c
def test_built_extension_is_used_by_default():
    if os.environ.get("OPT_SERVING_NO_CEXT") == "1":
        pytest.skip("OPT_SERVING_NO_CEXT=1 in this environment")
    assert packing.HAVE_CEXT
    assert packing.find_stop is C.find_stop and packing.pack_left_padded is C.pack_left_padded

"""The shapes the runner's programs are compiled at: the padded widths of prompts (prefill buckets), the sizes of a
prefilled prompt's cache (cache buckets), a chunked prompt's cache (job sizes) and chunk widths, and the windows a
group's decode cache steps through. The steps pad to these and warm-up (runner/warmup.py) compiles exactly these,
so both read them from here."""
from __future__ import annotations

import functools

from opt_serving.model import kv_cache
from opt_serving.runner.prefix import BLOCK_SIZE as PREFIX_BLOCK
from opt_serving.runner.types import PREFILL_MIN_BUCKET


# The smallest cache window where the attention kernel reads only the entries written so far: a step then
# costs the same in any window, so the small ones only cost start-up (every window compiles each step).
KERNEL_MIN_WINDOW = 256


def cache_windows(max_seq_len: int, smallest: int = kv_cache.MIN_BUCKET) -> list[int]:
    """The cache sizes a group's cache steps through (kv_cache.windows): powers of two from `smallest` (16), then
    max_seq_len."""
    return kv_cache.windows(max_seq_len, smallest)


@functools.lru_cache(maxsize=None)  # read for every prompt admitted (prefill_bucket)
def prefill_buckets(max_seq_len: int) -> list[int]:
    """The padded prompt widths prefill computes at: powers of two from 8, and from 64 on four a doubling
    (64, 80, 96, 112, 128, 160, ...), then max_seq_len. A prompt's pass computes its padding too: prompts
    spread over 64-512 tokens compute a third more than their tokens with powers of two alone, a twelfth with
    these. Each width is one more prefill to compile, not more inserts: its cache is a `cache_bucket`'s."""
    return _buckets(max_seq_len, [q * 2 ** i for i in range(4, 15) for q in (5, 6, 7)])


@functools.lru_cache(maxsize=None)
def cache_buckets(max_seq_len: int) -> list[int]:
    """The sizes of a prefilled prompt's cache: powers of two from 8, and from 64 on also 1.5 times them
    (96, 192, 384, ...), then max_seq_len. Every size compiles an insert into each cache window that holds
    it, so the cache is not cut as finely as the prefill widths (the entries past a prompt are empty)."""
    return _buckets(max_seq_len, [3 * 2 ** i for i in range(5, 16)])


def job_size(n: int, max_seq_len: int) -> int:
    """The cache of a prompt prefilled in chunks (or after a cached prefix, steps.extend_step): powers of two from 32,
    then max_seq_len. Fewer sizes than `cache_buckets` (each is one more compile of every chunk width), and
    each is one of them, so its inserts are compiled already."""
    return kv_cache.bucket_length(n, max_seq_len, 2 * PREFIX_BLOCK)


def job_sizes(max_seq_len: int) -> list[int]:
    return sorted({job_size(min(2 ** i, max_seq_len), max_seq_len) for i in range(17)})


def chunk_widths(chunk: int) -> list[int]:
    """The widths a chunk is computed at: `chunk`, and for a prompt's last chunk (or what a cached prefix leaves
    of it) the powers of two from 16 below it, so a short remainder is not padded to a whole chunk (a prompt of
    300 tokens in chunks of 256 computed 512)."""
    return [w for w in (2 ** i for i in range(4, 16)) if w < chunk] + [chunk]


def chunk_width(n: int, chunk: int) -> int:
    """The width of a chunk that has n tokens left to prefill."""
    return next(w for w in chunk_widths(chunk) if w >= min(n, chunk))


# the fewest rows a call of several decode steps computes (Slots.step_many): with fewer, a product still costs about
# what reading its weights costs
MIN_STEP_ROWS = 4


def step_rows(running: int, rows: int) -> int:
    """The rows a call of several decode steps computes for `running` rows of a group of `rows`: powers of two from
    MIN_STEP_ROWS, at most `rows`. Past a few rows a product's time grows with its rows (arithmetic, not reading
    the weights), so 16 requests on 32 slots should not pay for 32."""
    r = MIN_STEP_ROWS
    while r < running:
        r *= 2
    return min(r, rows)


def step_row_sizes(rows: int) -> list[int]:
    """Every size `step_rows` gives in a group of `rows` (warm-up compiles the steps at each)."""
    return sorted({step_rows(n, rows) for n in range(1, rows + 1)})


def _buckets(max_seq_len: int, more: list[int]) -> list[int]:
    """Powers of two from 8 and the widths `more` (none below PREFILL_MIN_BUCKET) under max_seq_len, then it."""
    L = max_seq_len
    widths = [2 ** i for i in range(3, 17)] + more
    return sorted({min(max(w, PREFILL_MIN_BUCKET), L) for w in widths if w < L} | {L})


def prefill_bucket(n: int, max_seq_len: int) -> int:
    """The prefill width of a prompt of n tokens (at most max_seq_len)."""
    return _smallest_holding(n, prefill_buckets(max_seq_len), max_seq_len)


def cache_bucket(n: int, max_seq_len: int) -> int:
    """The cache size of a prompt of n tokens, or of a prefill width (at most max_seq_len)."""
    return _smallest_holding(n, cache_buckets(max_seq_len), max_seq_len)


def _smallest_holding(n: int, sizes: list[int], max_seq_len: int) -> int:
    if not 0 < n <= max_seq_len:
        raise ValueError(f"a prompt of {n} tokens does not fit a context of {max_seq_len}")
    return next(b for b in sizes if b >= n)

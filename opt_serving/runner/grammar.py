"""Structured output where the tokens are chosen: an llguidance matcher per constrained request, and each step's
token masks.

A constrained request's `SlotSettings.grammar` is an llguidance grammar, made and checked at the text level
(structured.py). The stage that samples (runner/sampler.py: the whole model in this process, or the last pipeline
stage's actor) keeps a matcher for it: under its prefill's handle until it takes a slot, then under the slot.
Before a step, `masks` writes the step's constrained rows' masks into an int32 bitmask [rows, W] (token t allowed
where bit t % 32 of word t // 32 is set), which the batched sampling step applies to those rows alone
(sampling.allow_only); after it, `consume` advances each matcher by the token chosen. A mask depends on every token
before it, so a constrained row's steps are taken one at a time (StageSlots.decode_steps).

llguidance was measured against xgrammar and outlines-core on this project's CPU with OPT's tokenizer
(benchmark/probes/bench_grammar_libs.py, benchmark/README.md): it takes JSON schemas, regexes and Lark grammars,
builds a request's parser in a millisecond where the others compile a schema for a second or more, and its masks cost less
than xgrammar's.
"""
from __future__ import annotations

import copy
import functools
import logging
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)


def mask_words(vocab: int) -> int:
    """int32 words of one row of a token bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


def tokenizer_json(tokenizer) -> str:
    """A transformers tokenizer with a Rust backend (OPT's GPT-2 BPE) as the JSON that backend reads: what a
    pipeline's last stage is sent to build its `ll_tokenizer` from."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"structured output needs a tokenizer with a Rust (tokenizers) backend, not "
                         f"{type(tokenizer).__name__}")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer_json: str, vocab: int, eos: int):
    """llguidance's view of a tokenizer over the model's `vocab` rows (every token's bytes and the tables its masks
    are computed with; half a second for OPT's), made once per process."""
    import llguidance
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)


class Matchers:
    """The matchers of one sampler's constrained requests: `pending` by prefill handle, `slots[group][row]`."""

    def __init__(self, groups: int, vocab: int):
        self.vocab, self.words = vocab, mask_words(vocab)
        self.tokenizer = None
        self.eos = -1
        self.pending: dict = {}
        self.slots: list[dict[int, object]] = [{} for _ in range(groups)]

    def use_tokenizer(self, tokenizer_json: str, eos: int) -> None:
        self.tokenizer, self.eos = ll_tokenizer(tokenizer_json, self.vocab, eos), eos

    def new(self, grammar: str):
        """A matcher at the start of `grammar`. ValueError if llguidance cannot build its parser (the text level
        checked the grammar first, so this is a bug or a resource limit)."""
        if self.tokenizer is None:
            raise ValueError("structured output: the sampling stage was given no tokenizer (Slots.use_tokenizer)")
        import llguidance
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"structured output: {m.get_error()}")
        return m

    # ---- where a request's matcher lives ----
    def insert(self, handle, group: int, row: int, keep: bool = False) -> None:
        """The pending request `handle` takes slot (group, row); with `keep` its matcher stays for another insert
        (a copy goes to the slot). A request without a matcher clears the slot's."""
        m = self.pending.get(handle) if keep else self.pending.pop(handle, None)
        if m is None:
            self.slots[group].pop(row, None)
        else:
            self.slots[group][row] = m.deep_copy() if keep else m

    def drop(self, handle) -> None:
        self.pending.pop(handle, None)

    def free(self, group: int, row: int) -> None:
        self.slots[group].pop(row, None)

    def constrained(self, group: int) -> bool:
        return bool(self.slots[group])

    # ---- a step ----
    def masks(self, rows: Sequence[tuple[int, object]], n: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The masks of a step over n rows, where `rows` = (row, matcher) are its constrained ones -> (bitmask
        int32 [n, W], constrained bool [n]); None when there are none. A matcher that can take nothing more
        (finished, or broken by a token it refused) allows EOS alone, so its request ends."""
        if not rows:
            return None
        import llguidance.numpy
        bitmask = np.zeros((n, self.words), np.int32)
        constrained = np.zeros(n, np.bool_)
        for row, m in rows:
            constrained[row] = True
            if m.is_error():
                bitmask.view(np.uint32)[row, self.eos // 32] = 1 << (self.eos % 32)
            else:
                llguidance.numpy.fill_next_token_bitmask(m, bitmask, row)
        return bitmask, constrained

    def slot_rows(self, group: int) -> list[tuple[int, object]]:
        return list(self.slots[group].items())

    @staticmethod
    def consume(rows: Sequence[tuple[int, object]], tokens: np.ndarray) -> None:
        """Advance each (row, matcher) by its row's chosen token."""
        for row, m in rows:
            if not m.is_stopped() and not m.consume_token(int(tokens[row])):
                log.warning("structured output: a chosen token broke its grammar (%s)", m.get_error())

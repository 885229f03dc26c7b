"""The prefix cache's host side (vLLM's automatic prefix caching): which pool block holds the KV cache of which
block of a prompt, found by a chained hash of the prompt's tokens, least recently used evicted first.

A prompt's tokens split into blocks of `block_size`; block j's key is a hash of block j-1's key and block j's
tokens, so a key names the whole prefix up to its block's end, and two prompts share a block exactly when they
share every token before its end. The KV of a prompt's full blocks is written into the pool blocks `claim`
hands out (every stage keeps its own pool of the same blocks, for its own layers: runner/stage.py); a later
prompt's `match` gives the pool blocks of its longest cached prefix, whose entries it then gathers instead of
computing them. A block's echo scores (each of its tokens' log-probability and top alternatives, where a prompt
that asked for them computed them) are kept beside it, on the host, so a prompt whose scores are asked can reuse
a prefix too.

Eviction is least recently used, over the blocks: matching or claiming a prompt's blocks marks them used, its
first block last, so of one prompt's blocks the later ones go first (a block is useless once the block before
it is gone). Nothing here runs a model: the driver (runner/slots.py) turns hand-outs into stage calls.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Optional, Sequence

import numpy as np

# tokens a block (vLLM's default): a prompt reuses its cached prefix in whole blocks, and every cache size a
# prefill makes from 16 on is a multiple of it
BLOCK_SIZE = 16


def default_blocks(num_slots: int, max_seq_len: int) -> int:
    """The prefix cache's blocks by default: a quarter of the tokens the decode slots hold at their longest, at
    least one whole context, so its pool adds about a quarter to the KV cache's memory (the planner counts it)."""
    return max(num_slots * max_seq_len // 4, max_seq_len) // BLOCK_SIZE


class PrefixCache:
    """`blocks` pool blocks of `block_size` tokens each (see the module docstring)."""

    def __init__(self, blocks: int, block_size: int = BLOCK_SIZE):
        if blocks < 1:
            raise ValueError(f"a prefix cache needs at least one block, got {blocks}")
        self.blocks, self.block_size = blocks, block_size
        self._held: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> block, oldest first
        self._key_of: dict[int, bytes] = {}  # block -> its key
        self._free = list(range(blocks - 1, -1, -1))
        self._scores: dict[int, tuple] = {}  # block -> (logprobs [bs], top ids [bs, K], top logprobs [bs, K])
        self._holds: collections.Counter[int] = collections.Counter()  # block -> rows reading it in place
        self.evictions = 0

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._held)

    def __contains__(self, key: bytes) -> bool:
        return key in self._held

    def keys(self, tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """The chained keys of the prompt's full blocks; the chain starts from `salt`, what else the KV depends on
        (a LoRA adapter's weights: runner/lora.py), so prompts of another salt never share a block."""
        bs, out, key = self.block_size, [], salt
        ids = np.asarray(tokens, np.int64)
        for j in range(len(tokens) // bs):
            key = hashlib.blake2b(key + ids[j * bs:(j + 1) * bs].tobytes(), digest_size=16).digest()
            out.append(key)
        return out

    def match(self, keys: Sequence[bytes], scored: bool = False, touch: bool = True) -> list[int]:
        """The pool blocks of the longest run of `keys` held from the first (with `scored`, only blocks whose
        echo scores are kept too); `touch` marks them used."""
        out = []
        for k in keys:
            b = self._held.get(k)
            if b is None or (scored and b not in self._scores):
                break
            out.append(b)
        if touch:
            self._touch(keys[:len(out)])
        return out

    def claim(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """Pool blocks for the prompt's blocks not held yet -> (block index j, pool block) for each, to be
        written with block j's KV; blocks held already are marked used. The least recently used blocks of
        other prompts are evicted for room; a prompt longer than the pool keeps its first blocks."""
        self._touch(keys)  # the prompt's own blocks are never the ones evicted
        mine, out = set(keys), []
        for j, k in enumerate(keys):
            if k in self._held:
                continue
            b = self._take(mine)
            if b is None:
                break
            self._held[k], self._key_of[b] = b, k
            out.append((j, b))
        self._touch(keys)
        return out

    def hold(self, blocks: Sequence[int]) -> None:
        """Rows read these blocks in place (ragged steps): never evicted until `release`d as often."""
        self._holds.update(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        self._holds.subtract(blocks)
        self._holds = +self._holds  # (drops the blocks no row holds any more)

    def forget(self, blocks: Sequence[int]) -> None:
        """Let blocks go whose KV was never written (the prefill that would have written them failed)."""
        for b in blocks:
            if b in self._key_of:
                self._release(self._key_of[b])

    def set_scores(self, block: int, scores: tuple) -> None:
        if block in self._key_of:
            self._scores[block] = scores

    def scores(self, block: int) -> Optional[tuple]:
        return self._scores.get(block)

    def clear(self) -> None:
        for k in list(self._held):
            self._release(k)
        self._holds.clear()

    def _touch(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):  # the first block last: the most recently used
            if k in self._held:
                self._held.move_to_end(k)

    def _take(self, mine: set) -> Optional[int]:
        """A free block, or the least recently used one evicted (never one of `mine`); None if none."""
        if self._free:
            return self._free.pop()
        # the least recently used block that no running row reads in place
        oldest = next((k for k in self._held if self._held[k] not in self._holds), None)
        if oldest is None or oldest in mine:
            return None
        self.evictions += 1
        return self._release(oldest, free=False)

    def _release(self, key: bytes, free: bool = True) -> int:
        b = self._held.pop(key)
        del self._key_of[b]
        self._scores.pop(b, None)
        if free:
            self._free.append(b)
        return b

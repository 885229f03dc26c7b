"""Each token's own text, as OpenAI and vLLM show it in `logprobs` (tokens and the keys of top_logprobs).

The vocabulary spells byte-level BPE tokens in GPT-2's printable stand-ins ("\u0120world" for " world"); clients
want the text the token decodes to alone (" world"), so that "".join(tokens) is the completion text and
top_logprobs[i][" yes"] can be looked up. A token holding only part of a multi-byte character has no text of
its own: it is written as its bytes, escaped the way OpenAI and vLLM do ("bytes:\\xe2\\x80"). Special tokens
("</s>") are written as they are spelled.
"""
from __future__ import annotations

import functools
from typing import Optional


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it stands for (the inverse of its bytes_to_unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def escape_bytes(data: bytes) -> str:
    """Bytes that are not whole UTF-8 characters, as OpenAI writes such a token: "bytes:\\xe2\\x80"."""
    return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenTexts:
    """token id -> its text (cached; the vocabulary is fixed)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        token_id = int(token_id)
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._text(token_id)
        return text

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special

    def token_bytes(self, token_id: int) -> Optional[bytes]:
        """The bytes a byte-level BPE token stands for; None for a special token or another kind of vocabulary."""
        if token_id in self._special:
            return None
        spelled = self.tokenizer.convert_ids_to_tokens(token_id)
        table = byte_decoder()
        if not isinstance(spelled, str) or not spelled or any(c not in table for c in spelled):
            return None
        return bytes(table[c] for c in spelled)

    def _text(self, token_id: int) -> str:
        if token_id in self._special:
            return self.tokenizer.convert_ids_to_tokens(token_id)
        data = self.token_bytes(token_id)
        if data is None:  # not byte-level: what the tokenizer decodes it to alone
            return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return escape_bytes(data)

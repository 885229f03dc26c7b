"""Load the tokenizer that belongs to a model folder (or the embedded opt-tiny one).

A model folder carries OPT's GPT-2 byte-level BPE as vocab.json + merges.txt
(or a tokenizer.json) beside the weights; a folder with metaseq's names
(gpt2-vocab.json + gpt2-merges.txt, e.g. ../shared/opt-assets) loads in place.
OPT prepends </s> (id 2) to every prompt; tokenizer_config.json says so, and a
folder without one gets the same settings here, so "Hello world" encodes as
OPT does: [2, 31414, 232]. A chat template in the folder (`chat_template` in
tokenizer_config.json, or chat_template.jinja) comes with the tokenizer
(`tokenizer.chat_template`; text/chat.py renders chat requests with it).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

from opt_serving.config import TINY_VOCAB_SIZE, get_config
from opt_serving.model.embedded import ensure_embedded_model
from opt_serving.spec import EMBEDDED_NAMES

# the real OPT convention (../shared/opt-assets/README.md); the embedded model writes the same
OPT_TOKENIZER_CONFIG = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>",
                        "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>",
                        "add_bos_token": True}

METASEQ_FILES = ("gpt2-vocab.json", "gpt2-merges.txt")  # metaseq's projects/OPT/assets names


def _has_metaseq_files(folder: Path) -> bool:
    return all((folder / name).is_file() for name in METASEQ_FILES)


def has_tokenizer(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()) or _has_metaseq_files(folder)


def install_tokenizer(folder: str | os.PathLike, vocab_json: str | os.PathLike,
                      merges_txt: str | os.PathLike) -> None:
    """Put OPT's tokenizer files (metaseq's gpt2-vocab.json / gpt2-merges.txt) into a model folder."""
    folder = Path(folder)
    for src in (vocab_json, merges_txt):
        if not Path(src).is_file():
            raise FileNotFoundError(f"tokenizer file not found: {src}")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vocab_json, folder / "vocab.json")
    shutil.copyfile(merges_txt, folder / "merges.txt")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(OPT_TOKENIZER_CONFIG, indent=2, sort_keys=True) + "\n")


def load_tokenizer(path: str | os.PathLike | None = None):
    """A transformers tokenizer for a model folder; None or "opt-tiny" means the embedded model."""
    if path is None or str(path) in EMBEDDED_NAMES:
        path = ensure_embedded_model()
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not has_tokenizer(folder):
        raise FileNotFoundError(
            f"{folder} has no tokenizer: expected vocab.json + merges.txt (OPT's GPT-2 BPE), "
            f"tokenizer.json, or metaseq's {' + '.join(METASEQ_FILES)}")
    import transformers
    settings = {k: v for k, v in OPT_TOKENIZER_CONFIG.items() if k != "tokenizer_class"}
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        # metaseq's file names: read in place (the folder may be read-only, e.g. ../shared/opt-assets)
        vocab, merges = (str(folder / name) for name in METASEQ_FILES)
        template = folder / "chat_template.jinja"  # (what from_pretrained reads beside the files it knows)
        if template.is_file():
            settings["chat_template"] = template.read_text(encoding="utf-8")
        return transformers.GPT2Tokenizer(vocab=vocab, merges=merges, **settings)
    if (folder / "tokenizer_config.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.GPT2Tokenizer.from_pretrained(folder, **settings)


def tokenizer_for_dummy(model_name: str, tokenizer: str | os.PathLike | None = None):
    """What `load_tokenizer` should read for random weights of `model_name` (no weights folder to take it
    from): `tokenizer` if given, else the embedded one (None) when the model's vocabulary is no larger than
    its; otherwise ValueError, since generated ids past the embedded vocabulary would decode to nothing."""
    if tokenizer is not None:
        return tokenizer
    vocab = get_config(model_name).vocab_size
    if vocab > TINY_VOCAB_SIZE:
        raise ValueError(
            f"{model_name} with random weights (--dummy) has a {vocab}-token vocabulary, larger than the "
            f"embedded tokenizer's {TINY_VOCAB_SIZE}: give a tokenizer folder with --tokenizer DIR "
            f"(tokenizer=DIR), e.g. one holding OPT's gpt2-vocab.json + gpt2-merges.txt")
    return None


def text_decoder(tokenizer, skip_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
    """ids -> text, as `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.

    For transformers' Rust-backed tokenizers (OPT's GPT2Tokenizer among them) that is the backend's own decode,
    which is what transformers calls when nothing is cleaned up; called directly here because a streamed
    token's text takes two decodes (completion.Detokenizer), and transformers' conversion of the arguments
    around each (`to_py_obj` on every id) cost about five times the decode itself. A tokenizer class that
    decodes its own way (or a pure-Python one) goes through its `decode`."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (another transformers layout: its decode as it is)
        TokenizersBackend = PreTrainedTokenizerBase = None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and backend is not None
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                             clean_up_tokenization_spaces=False)

"""Load the tokenizer that belongs to a model folder (or the embedded opt-tiny one).

A model folder carries OPT's GPT-2 byte-level BPE as vocab.json + merges.txt
(or a tokenizer.json) beside the weights. OPT prepends </s> (id 2) to every
prompt; tokenizer_config.json says so, and a folder without one gets the same
settings here, so "Hello world" encodes as OPT does: [2, 31414, 232].
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# the real OPT convention (../shared/opt-assets/README.md); the embedded model writes the same
OPT_TOKENIZER_CONFIG = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>",
                        "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>",
                        "add_bos_token": True}

EMBEDDED_NAMES = ("opt-tiny", "tiny", "jax/opt-tiny")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())


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
        from opt_serving.embedded import ensure_embedded_model
        path = ensure_embedded_model()
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not has_tokenizer(folder):
        raise FileNotFoundError(
            f"{folder} has no tokenizer: expected vocab.json + merges.txt (OPT's GPT-2 BPE) or "
            f"tokenizer.json; for a real OPT model copy metaseq's gpt2-vocab.json and "
            f"gpt2-merges.txt there with opt_serving.tokenizer.install_tokenizer()")
    import transformers
    if (folder / "tokenizer_config.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(folder)
    settings = {k: v for k, v in OPT_TOKENIZER_CONFIG.items() if k != "tokenizer_class"}
    return transformers.GPT2Tokenizer.from_pretrained(folder, **settings)

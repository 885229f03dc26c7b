"""Copy OPT tokenizer files beside the converted weights.

Accepts a Hugging Face tokenizer folder or metaseq's assets (gpt2-vocab.json,
gpt2-merges.txt), which are renamed to the names transformers' GPT2Tokenizer expects.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from opt_serving.checkpoint.formats import CheckpointError
from opt_serving.text.tokenizer import OPT_TOKENIZER_CONFIG

_SOURCES = {"vocab.json": ("vocab.json", "gpt2-vocab.json"),
            "merges.txt": ("merges.txt", "gpt2-merges.txt")}
_OPTIONAL = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")


def tokenizer_files(src: str | Path) -> dict[str, Path]:
    """{destination name: source file}; raises naming what is missing."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"tokenizer folder {src} does not exist")
    found = {}
    for dest, candidates in _SOURCES.items():
        for c in candidates:
            if (src / c).is_file():
                found[dest] = src / c
                break
        else:
            raise CheckpointError(f"tokenizer folder {src} has no {' or '.join(candidates)}")
    for name in _OPTIONAL:
        if (src / name).is_file():
            found[name] = src / name
    return found


def copy_tokenizer(src: str | Path, dest: Path) -> None:
    files = tokenizer_files(src)
    for name, path in files.items():
        shutil.copyfile(path, dest / name)
    if "tokenizer_config.json" not in files:
        (dest / "tokenizer_config.json").write_text(json.dumps(OPT_TOKENIZER_CONFIG, indent=2) + "\n")

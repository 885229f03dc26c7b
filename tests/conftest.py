"""Fixtures shared by several test files."""
import shutil
from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "opt-assets"


@pytest.fixture(scope="session")
def opt_tokenizer(tmp_path_factory):
    """The real OPT tokenizer (../shared/opt-assets, set up in a temporary folder the way OPT's is);
    skips where the assets are absent."""
    if not ASSETS.is_dir():
        pytest.skip(f"OPT tokenizer files not found at {ASSETS} (../shared/opt-assets is absent)")
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("opt-tokenizer")
    shutil.copy(ASSETS / "gpt2-vocab.json", d / "vocab.json")
    shutil.copy(ASSETS / "gpt2-merges.txt", d / "merges.txt")
    (d / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>", '
        '"unk_token": "</s>", "pad_token": "<pad>", "add_bos_token": true}')
    return AutoTokenizer.from_pretrained(str(d))

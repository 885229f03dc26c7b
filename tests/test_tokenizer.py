"""opt_serving/tokenizer.py: tokenizer folders under either naming, and the tokenizer random weights get."""
import shutil
from pathlib import Path

import pytest

from opt_serving.embedded import ensure_embedded_model
from opt_serving.tokenizer import has_tokenizer, load_tokenizer, tokenizer_for_dummy

ASSETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "opt-assets"
PROMPTS = ["Hello world", "Paris is the capital city of", " leading space, punctuation!"]


@pytest.fixture(scope="module")
def metaseq_dir(tmp_path_factory) -> Path:
    """The embedded tokenizer's files under metaseq's names, and nothing else."""
    tiny = ensure_embedded_model()
    d = tmp_path_factory.mktemp("metaseq-tok")
    shutil.copyfile(tiny / "vocab.json", d / "gpt2-vocab.json")
    shutil.copyfile(tiny / "merges.txt", d / "gpt2-merges.txt")
    return d


def test_metaseq_file_names_load_as_the_same_tokenizer(metaseq_dir):
    assert has_tokenizer(metaseq_dir)
    ours, embedded = load_tokenizer(metaseq_dir), load_tokenizer()
    for text in PROMPTS:
        ids = ours(text)["input_ids"]
        assert ids == embedded(text)["input_ids"]
        assert ids[0] == 2  # OPT's settings without a tokenizer_config.json: </s> first
        assert ours.decode(ids, skip_special_tokens=True) == text
    assert (ours.pad_token_id, ours.eos_token_id) == (1, 2)
    assert len(ours) == len(embedded)


def test_half_a_metaseq_pair_is_no_tokenizer(tmp_path, metaseq_dir):
    shutil.copyfile(metaseq_dir / "gpt2-vocab.json", tmp_path / "gpt2-vocab.json")
    assert not has_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="gpt2-vocab.json \\+ gpt2-merges.txt"):
        load_tokenizer(tmp_path)


def test_random_weights_take_the_embedded_tokenizer_only_when_it_covers_the_vocabulary(metaseq_dir):
    assert tokenizer_for_dummy("jax/opt-tiny") is None  # 1024 tokens: the embedded tokenizer's own size
    assert tokenizer_for_dummy("jax/opt-125m", metaseq_dir) == metaseq_dir
    with pytest.raises(ValueError, match=r"50272-token vocabulary.*--tokenizer DIR"):
        tokenizer_for_dummy("jax/opt-125m")
    with pytest.raises(ValueError, match="unknown OPT model"):
        tokenizer_for_dummy("jax/opt-7q")


@pytest.mark.skipif(not (ASSETS / "gpt2-vocab.json").is_file(),
                    reason="../shared/opt-assets (the real OPT tokenizer) is not on this machine")
def test_real_opt_tokenizer_reads_in_place():
    tok = load_tokenizer(ASSETS)
    assert tok("Hello world")["input_ids"] == [2, 31414, 232]
    assert len(tok) == 50265

"""opt_serving/text/tokenizer.py: tokenizer folders under either naming, and the tokenizer random weights get."""
import functools
import shutil
from pathlib import Path

import pytest

from opt_serving.model.embedded import ensure_embedded_model
from opt_serving.text.tokenizer import has_tokenizer, load_tokenizer, text_decoder, tokenizer_for_dummy

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


def _decoders_agree(tok, ids_list):
    for skip in (True, False):
        decode = text_decoder(tok, skip_special_tokens=skip)
        for ids in ids_list:
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_text_decoder_gives_the_tokenizers_own_decode(opt_tokenizer):
    """The Rust backend's decode, called directly, is transformers' decode without clean-up: on random ids
    (split characters, specials, runs of spaces and punctuation that clean-up would change) and on text."""
    import numpy as np
    assert isinstance(text_decoder(opt_tokenizer), functools.partial)
    assert text_decoder(opt_tokenizer).func == opt_tokenizer.backend_tokenizer.decode  # the direct path ran
    rng = np.random.default_rng(0)
    ids_list = [rng.integers(0, len(opt_tokenizer), n).tolist() for n in (1, 2, 5, 40) for _ in range(50)]
    ids_list += [opt_tokenizer.encode(t) for t in ("a , b . c ! don 't", "naïve café ☕ 😀", "  x  ")]
    ids_list += [[2, 0, 1, 3] + opt_tokenizer.encode(" 😀")[1:2], []]
    _decoders_agree(opt_tokenizer, ids_list)


def test_text_decoder_keeps_a_tokenizer_classes_own_decode():
    """A tokenizer class that decodes its own way is called through its decode."""
    from opt_serving.text.fake import byte_tokenizer
    base = byte_tokenizer()

    class Shouting(type(base)):
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).upper()

    tok = byte_tokenizer()
    tok.__class__ = Shouting
    assert text_decoder(tok)([4 + ord("a"), 4 + ord("b")]) == "AB"
    _decoders_agree(base, [[4 + b for b in "é!".encode()], [2, 4 + 65, 1]])

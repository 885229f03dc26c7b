"""The embedded opt-tiny model (model/embedded.py) and the tokenizer helper (text/tokenizer.py)."""
import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from opt_serving.model import embedded
from opt_serving.config import OPT_CONFIGS, OPTConfig, TINY_VOCAB_SIZE
from opt_serving.model.weights import load_numpy_folder
from opt_serving.text.tokenizer import install_tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
OPT_ASSETS = REPO / ".." / "shared" / "opt-assets"
needs_assets = pytest.mark.skipif(not (OPT_ASSETS / "gpt2-vocab.json").is_file(),
                                  reason=f"real OPT tokenizer not available at {OPT_ASSETS}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return embedded.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def files_of(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_build_is_deterministic_across_processes(tiny, tmp_path):
    # a second build in another process (fresh hash seeds for the Rust BPE trainer)
    env = dict(os.environ, OPT_SERVING_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "opt_serving", "tiny"], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.strip()
    other = Path(out)
    assert other == tmp_path / "opt-tiny-np"
    assert files_of(other) == files_of(tiny)
    match, mismatch, errors = filecmp.cmpfiles(tiny, other, files_of(tiny), shallow=False)
    assert mismatch == [] and errors == [] and len(match) == len(files_of(tiny))


def test_config_and_weights(tiny):
    cfg = OPTConfig.from_hf_json(tiny)
    assert cfg == OPT_CONFIGS["tiny"]
    cfg, params = load_numpy_folder(tiny)
    assert params["decoder.embed_tokens.weight"].shape == (TINY_VOCAB_SIZE, cfg.hidden_size)
    assert all(a.dtype == np.float32 for a in params.values())
    ln_w = params["decoder.layers.0.self_attn_layer_norm.weight"]
    ln_b = params["decoder.layers.0.self_attn_layer_norm.bias"]
    assert np.all(ln_w == 1) and np.all(ln_b == 0)
    # non-zero linear biases, so a dropped bias shows in parity tests elsewhere
    assert np.abs(params["decoder.layers.0.fc1.bias"]).max() > 0.01
    q0, q1 = params["decoder.layers.0.self_attn.q_proj.weight"], params["decoder.layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(q0, q1)


def test_tokenizer_like_opt(tiny):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    assert type(tok).__name__ == "GPT2Tokenizer"
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<s>", "<pad>", "</s>", "<unk>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (1, 2, 2)
    assert len(tok) <= OPT_CONFIGS["tiny"].vocab_size
    ids = tok("Hello world").input_ids
    assert ids[0] == 2 and len(ids) > 2
    for text in ["The river ran slowly past the old mill.",
                 "Unseen words: zebra quixotic 12345, naïve café 🙂\n\ttabs"]:
        ids = tok(text).input_ids
        assert ids[0] == 2 and max(ids) < TINY_VOCAB_SIZE
        assert tok.decode(ids, skip_special_tokens=True) == text
    # trained on the embedded corpus: common words are single tokens
    assert len(tok(" the river").input_ids) == 3


def test_cached_copy_is_reused_and_stale_one_rebuilt(tmp_path):
    folder = embedded.ensure_embedded_model(tmp_path)
    inode = folder.stat().st_ino
    assert embedded.ensure_embedded_model(tmp_path).stat().st_ino == inode  # reused
    marker = folder / embedded.MARKER
    stale = json.loads(marker.read_text())
    stale["recipe_version"] = -1
    marker.write_text(json.dumps(stale))
    rebuilt = embedded.ensure_embedded_model(tmp_path)
    assert rebuilt == folder and folder.stat().st_ino != inode
    assert json.loads(marker.read_text())["recipe_version"] == embedded.RECIPE_VERSION
    inode = folder.stat().st_ino
    assert embedded.ensure_embedded_model(tmp_path, force=True).stat().st_ino != inode
    # no temp or trash folders left behind
    assert [p.name for p in tmp_path.iterdir()] == ["opt-tiny-np"]


def test_half_written_folder_is_replaced(tmp_path):
    junk = tmp_path / "opt-tiny-np"
    junk.mkdir()
    (junk / "decoder.embed_tokens.weight").write_bytes(b"truncated")
    folder = embedded.ensure_embedded_model(tmp_path)
    cfg, params = load_numpy_folder(folder)
    assert params["decoder.embed_tokens.weight"].shape == (TINY_VOCAB_SIZE, cfg.hidden_size)


def test_env_var_and_racing_processes(tmp_path):
    env = dict(os.environ, OPT_SERVING_CACHE=str(tmp_path))
    code = "from opt_serving.model.embedded import ensure_embedded_model as e; print(e())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {o.strip() for o, _ in outs} == {str(tmp_path / "opt-tiny-np")}
    assert [p.name for p in tmp_path.iterdir()] == ["opt-tiny-np"]
    load_numpy_folder(tmp_path / "opt-tiny-np")
    assert (tmp_path / "opt-tiny-np" / embedded.MARKER).is_file()


def test_generation_is_not_degenerate(tiny):
    """Greedy decoding with the transformers reference model varies with the prompt and over time."""
    import torch
    import transformers
    cfg, params = load_numpy_folder(tiny)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**cfg.to_hf_dict()))
    state = {"model." + k.replace("decoder.layer_norm.", "decoder.final_layer_norm."):
             torch.from_numpy(np.array(v)) for k, v in params.items()}
    state["lm_head.weight"] = state["model.decoder.embed_tokens.weight"]
    model.load_state_dict(state)
    tok = load_tokenizer(tiny)
    continuations = []
    for prompt in ["Paris is the capital city of", "Hello world", "Question: Why is the sky blue?"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=1)
        new = out[0, ids.shape[1]:].tolist()
        assert len(set(new)) >= 6, new
        continuations.append(new)
    assert len({tuple(c) for c in continuations}) == 3


# ---- tokenizer.py ----

def test_load_tokenizer_defaults_to_embedded(tiny, monkeypatch):
    monkeypatch.setenv("OPT_SERVING_CACHE", str(tiny.parent))
    tok = load_tokenizer()
    assert tok("Hello world").input_ids == load_tokenizer("opt-tiny")("Hello world").input_ids
    assert tok("Hello world").input_ids[0] == 2


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no tokenizer: expected vocab.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        install_tokenizer(tmp_path, tmp_path / "missing.json", tmp_path / "missing.txt")


@needs_assets
def test_real_opt_tokenizer(tmp_path):
    install_tokenizer(tmp_path, OPT_ASSETS / "gpt2-vocab.json", OPT_ASSETS / "gpt2-merges.txt")
    assert load_tokenizer(tmp_path)("Hello world").input_ids == [2, 31414, 232]
    # a folder with only the two files still gets OPT's settings
    (tmp_path / "tokenizer_config.json").unlink()
    tok = load_tokenizer(tmp_path)
    assert tok("Hello world").input_ids == [2, 31414, 232]
    assert tok.pad_token_id == 1

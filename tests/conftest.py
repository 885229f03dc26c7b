"""Fixtures and model configs shared by several test files (`from conftest import TINY`:
pytest puts tests/ on sys.path)."""
import os
import shutil
from pathlib import Path

import pytest

from opt_serving.config import OPTConfig

ASSETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "opt-assets"

# Tests compile afresh and write nothing under the user's home (test_xla_cache.py turns the cache on in
# processes of its own); the servers and Ray workers tests start inherit this.
os.environ.setdefault("OPT_SERVING_COMPILE_CACHE", "0")

# The tiny pre-LN model most unit tests build: two layers of four heads, milliseconds to run.
TINY = OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=64, max_position_embeddings=64)
# OPT-350m's shape at TINY's size: 16-wide embeddings projected in/out, post-LN, no final layer norm
TINY_POST_LN = TINY.replace(word_embed_proj_dim=16, do_layer_norm_before=False)
# Four layers to slice into pipeline stages, 64 wide to split over tensor-parallel devices.
SMALL = OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  ffn_dim=256, max_position_embeddings=64, word_embed_proj_dim=64)


def hf_model(cfg, seed=0):
    """Hugging Face's OPTForCausalLM for `cfg`, randomly initialised from `seed`, with the 1-D
    parameters (biases, norms) moved off their 0 / 1 init so a wrong bias or norm path shows."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**cfg.to_hf_dict())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


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


# OPT's real vocabulary at a test's size: the real tokenizer's ids (structured output, logit_bias, prompt scores)
# through a model that compiles in seconds
OPT_VOCAB_SMALL = OPTConfig(vocab_size=50272, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            ffn_dim=128, max_position_embeddings=256, word_embed_proj_dim=64)


@pytest.fixture(scope="session")
def opt_vocab_server(opt_tokenizer):
    """A random-weight OPT_VOCAB_SMALL model (Hugging Face's, the reference, and the engine over the same weights,
    four decode steps a call as served by default) behind the real OPT tokenizer, served under two names (vLLM's
    --served-model-name) -> (generator, base URL, `openai` client, the HF model)."""
    openai = pytest.importorskip("openai")
    from opt_serving.engine import Engine, OPTSlots
    from opt_serving.generator import Generator
    from opt_serving.model import weights
    from opt_serving.service.app import create_app
    from opt_serving.service.testserver import serve_in_thread
    hf = hf_model(OPT_VOCAB_SMALL, seed=1)
    slots = OPTSlots(OPT_VOCAB_SMALL, weights.params_from_hf_state_dict(OPT_VOCAB_SMALL, hf.state_dict()),
                     num_slots=8, max_seq_len=256)
    # (however long a step takes on a busy machine, four a call while nobody waits for a slot)
    g = Generator(Engine(slots, decode_steps=4, decode_call_s=3600), opt_tokenizer, model_name="opt-small")
    with serve_in_thread(create_app(g, model_name=["opt-small", "my-opt"])) as url:
        yield g, url, openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120), hf
    g.close()

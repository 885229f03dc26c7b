"""Conversion streams: peak memory stays far below the model's size (measured in a fresh process)."""
import numpy as np

from opt_serving.config import OPTConfig
from opt_serving.model.weights import load_array
from opt_serving.testing import checkpoints as ck


def test_peak_rss_well_under_model_size(tmp_path):
    cfg = OPTConfig(vocab_size=32768, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    ffn_dim=2048, max_position_embeddings=64, word_embed_proj_dim=512)
    sd = ck.random_metaseq_state_dict(cfg, seed=0)
    model_bytes = sum(t.numel() * 2 for t in sd.values())  # about 84 MB in fp16
    ck.write_fsdp_shards_from_state_dict(tmp_path / "ckpt", sd, cfg, parts=2, shards=8)
    m = ck.measure_conversion(tmp_path / "ckpt", tmp_path / "np")
    grown = m["peak_rss"] - m["baseline_rss"]
    print(f"model {model_bytes / 1e6:.0f} MB, peak RSS {m['peak_rss'] / 1e6:.0f} MB, "
          f"{grown / 1e6:.1f} MB above the post-import baseline")
    assert m["bytes"] == model_bytes
    # the imports (torch) alone take ~230 MB, so the bound is on what converting added
    assert grown < 0.25 * model_bytes
    for key in ("decoder.embed_tokens.weight", "decoder.layers.7.fc2.weight"):
        np.testing.assert_array_equal(load_array(tmp_path / "np" / key), sd[key].numpy())

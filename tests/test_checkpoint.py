"""Every checkpoint format converts to a numpy folder equal to the source parameters, bit for bit."""
from pathlib import Path

import numpy as np
import pytest
import torch

from opt_serving.checkpoint import group_shards
from opt_serving.checkpoint.convert import convert
from opt_serving.checkpoint.formats import detect, parse_shard_name
from opt_serving.model.weights import load_array, load_numpy_folder, param_shapes
from opt_serving.testing import checkpoints as ck

ASSETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "opt-assets"
needs_assets = pytest.mark.skipif(not ASSETS.is_dir(), reason=f"OPT assets not found at {ASSETS}")


def quiet(_msg):
    pass


def run(src, out, **kw):
    return convert(src, out, log=quiet, progress=False, **kw)


def assert_equal_to_source(out: Path, model, dtype=np.float16):
    cfg, params = load_numpy_folder(out)
    assert cfg == ck._opt_config(model)
    source = ck.metaseq_state_dict(model)
    assert set(params) == set(source)  # nothing missing, nothing extra (no output_projection, version)
    for key, t in source.items():
        got = params[key]
        assert got.dtype == dtype, key
        np.testing.assert_array_equal(got, t.to(torch.float32).numpy().astype(dtype), err_msg=key)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        list(param_shapes(cfg)) + ["config.json"])


@pytest.fixture(scope="module")
def tiny():
    return ck.random_hf_model(ck.tiny_config(), seed=1)


@pytest.fixture(scope="module")
def tiny_350m_style():
    # 350m's shape: embeddings narrower than the decoder (project_in/out) and post-LayerNorm
    return ck.random_hf_model(ck.tiny_config(hidden=32, word_embed_proj_dim=16, pre_ln=False), seed=2)


def test_fsdp_2_parts_x_3_shards_with_padding(tiny, tmp_path):
    files = ck.write_fsdp_shards(tmp_path / "ckpt", tiny, parts=2, shards=3)
    pads = [e["params"]["flat_param_0"]["padding"]
            for f in files for e in torch.load(f, weights_only=False)["shard_metadata"]["param_metadata"]]
    assert any(pads), "the fixture should exercise FSDP padding"
    result = run(tmp_path / "ckpt", tmp_path / "np")
    assert result.format == "metaseq-fsdp"
    assert_equal_to_source(tmp_path / "np", tiny)


def test_micro_fsdp_2x19_trailing_all_padding_shards(tmp_path):
    model = ck.random_hf_model(ck.tiny_config(hidden=8, heads=2, vocab=16, max_positions=8), seed=3)
    files = ck.write_fsdp_shards(tmp_path / "ckpt", model, parts=2, shards=19)
    last = torch.load(files[18], weights_only=False)  # part 0, shard 18
    root = next(e for e in last["shard_metadata"]["param_metadata"] if e["fsdp_path"] == "")
    assert root["params"]["flat_param_0"]["padding"] == last["model"]["flat_param_0"].numel() > 0, \
        "the last shard's root flat param should be all padding"
    assert [f.name for f in detect(str(tmp_path / "ckpt")).files[0]][:3] == [
        "checkpoint_last-model_part-0-shard0.pt", "checkpoint_last-model_part-0-shard1.pt",
        "checkpoint_last-model_part-0-shard2.pt"]
    run(str(tmp_path / "ckpt" / "checkpoint_last-model_part-*-shard*.pt"), tmp_path / "np")
    assert_equal_to_source(tmp_path / "np", model)


def test_350m_style_from_fsdp_and_hf(tiny_350m_style, tmp_path):
    ck.write_fsdp_shards(tmp_path / "ckpt", tiny_350m_style, parts=2, shards=3)
    run(tmp_path / "ckpt", tmp_path / "np")
    assert_equal_to_source(tmp_path / "np", tiny_350m_style)
    cfg, _ = load_numpy_folder(tmp_path / "np")
    assert cfg.word_embed_proj_dim == 16 and not cfg.do_layer_norm_before
    assert (tmp_path / "np" / "decoder.project_in_dim.weight").exists()
    assert not (tmp_path / "np" / "decoder.layer_norm.weight").exists()
    ck.write_hf(tmp_path / "hf", tiny_350m_style)
    run(tmp_path / "hf", tmp_path / "np_hf")
    assert_equal_to_source(tmp_path / "np_hf", tiny_350m_style)


def test_singleton(tiny, tmp_path):
    ck.write_singleton(tmp_path / "restored.pt", tiny)
    assert run(tmp_path / "restored.pt", tmp_path / "np").format == "metaseq-singleton"
    assert_equal_to_source(tmp_path / "np", tiny)


def test_singleton_glued_by_convert_to_singleton_keeps_part_0s_cfg(tiny, tmp_path):
    """metaseq's convert_to_singleton glues the parts but copies cfg from part 0: model_parallel_size 2."""
    ck.write_singleton(tmp_path / "restored.pt", tiny, cfg_parts=2)
    said = []
    result = convert(tmp_path / "restored.pt", tmp_path / "np", log=said.append, progress=False)
    assert result.format == "metaseq-singleton"
    assert any("model_parallel_size 2 but the tensors are full-size: a glued singleton" in m for m in said)
    assert_equal_to_source(tmp_path / "np", tiny)


def test_reshard_parts_split_fused_qkv_per_part(tiny, tmp_path):
    files = ck.write_reshard_parts(tmp_path / "ckpt", tiny, parts=2)
    assert "decoder.layers.0.self_attn.qkv_proj.weight" in torch.load(files[0], weights_only=False)["model"]
    assert run(tmp_path / "ckpt", tmp_path / "np").format == "metaseq-mp-parts"
    assert_equal_to_source(tmp_path / "np", tiny)


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_hf_folder(tiny, tmp_path, safetensors):
    ck.write_hf(tmp_path / "hf", tiny, safetensors=safetensors)
    assert run(tmp_path / "hf", tmp_path / "np").format == "hf"
    assert_equal_to_source(tmp_path / "np", tiny)


def test_dtypes(tiny, tmp_path):
    ck.write_reshard_parts(tmp_path / "ckpt", tiny, parts=2)
    run(tmp_path / "ckpt", tmp_path / "f32", dtype="float32")
    assert_equal_to_source(tmp_path / "f32", tiny, dtype=np.float32)
    run(tmp_path / "ckpt", tmp_path / "bf16", dtype="bfloat16")
    key = "decoder.layers.1.fc2.weight"
    got = load_array(tmp_path / "bf16" / key)
    assert got.dtype.name == "bfloat16"
    want = ck.metaseq_state_dict(tiny)[key].to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(got).view(np.int16), want)


def test_opt175b_manifest_sorts_into_8_parts_x_124_shards():
    if not ASSETS.is_dir():
        pytest.skip(f"OPT assets not found at {ASSETS}")
    from opt_serving.checkpoint.md5 import read_md5_csv
    names = list(read_md5_csv(ASSETS / "opt175b_md5sum_shards.csv"))
    assert len(names) == 992
    assert names[:3] == ["checkpoint_last-model_part-0-shard0.pt", "checkpoint_last-model_part-0-shard1.pt",
                         "checkpoint_last-model_part-0-shard10.pt"]  # the CSV is in lexical order
    grid = group_shards([Path("/ckpt") / n for n in names])
    assert len(grid) == 8 and all(len(part) == 124 for part in grid)
    for p, part in enumerate(grid):
        assert [parse_shard_name(f.name)[1:] for f in part] == [(p, s) for s in range(124)]


@needs_assets
def test_tokenizer_copied_from_metaseq_assets(tiny, tmp_path):
    from transformers import AutoTokenizer
    ck.write_singleton(tmp_path / "restored.pt", tiny)
    run(tmp_path / "restored.pt", tmp_path / "np", tokenizer=ASSETS)
    tok = AutoTokenizer.from_pretrained(tmp_path / "np")
    assert tok("Hello world").input_ids == [2, 31414, 232]


def test_cli_reports_detected_format(tiny, tmp_path, capsys):
    from opt_serving.cli import main
    ck.write_fsdp_shards(tmp_path / "ckpt", tiny, parts=2, shards=3)
    rc = main(["convert", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "np"),
               "--no-progress"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "found metaseq-fsdp: 2 model-parallel part(s) x 3 FSDP shard(s) = 6 files" in err
    assert_equal_to_source(tmp_path / "np", tiny)


def test_converted_model_generates_like_hf(tiny, tmp_path):
    wrapper = pytest.importorskip("opt_serving.model.wrapper")
    ck.write_fsdp_shards(tmp_path / "ckpt", tiny, parts=2, shards=3)
    run(tmp_path / "ckpt", tmp_path / "np")
    ours = wrapper.get_model("jax/opt-tiny", path=tmp_path / "np", dtype="float32")
    ref = tiny.float()
    ids = torch.tensor([[2, 17, 45, 9, 33]])
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1).numpy()
    got = np.asarray(ours.generate(input_ids=ids.numpy(), max_new_tokens=8, do_sample=False))
    np.testing.assert_array_equal(got, want)

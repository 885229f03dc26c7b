"""Numpy weights folder <-> Flax param tree: names, round trip through get_model, clear errors."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from opt_serving.model import param_tree, weights, wrapper

from conftest import TINY, TINY_POST_LN

CFG, CFG_350M = TINY, TINY_POST_LN


def hf_model(cfg):
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(transformers.OPTConfig(**cfg.to_hf_dict())).eval()


def save_hf_as_numpy(model, cfg, folder):
    arrays = {weights.hf_key_to_metaseq(k): v.numpy() for k, v in model.state_dict().items()
              if weights.hf_key_to_metaseq(k) is not None}
    weights.save_numpy_folder(folder, cfg, arrays)


@pytest.mark.parametrize("cfg", [CFG, CFG_350M], ids=["pre_ln", "350m"])
def test_every_metaseq_key_maps_into_the_flax_tree(cfg):
    tree = param_tree.param_tree_shapes(cfg)
    hf_keys = set(hf_model(cfg).state_dict()) - {"lm_head.weight"}
    assert {weights.metaseq_key_to_hf(n) for n in weights.param_shapes(cfg)} == hf_keys
    seen = set()
    for name, shape in weights.param_shapes(cfg).items():
        path, transpose = weights.flax_path(name)
        node = tree
        for p in path:
            node = node[p]
        assert tuple(node.shape) == (shape[::-1] if transpose else shape), name
        seen.add(path)
    n_leaves = len(__import__("jax").tree_util.tree_leaves(tree))
    assert len(seen) == n_leaves  # every Flax leaf is loaded from exactly one file


def test_numpy_folder_round_trip_through_get_model(tmp_path):
    cfg = CFG_350M
    hf = hf_model(cfg)
    save_hf_as_numpy(hf, cfg, tmp_path / "opt-350m-np")
    ids = np.random.RandomState(0).randint(3, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    # Alpa's convention: path is the parent holding <name>-np; config.json inside wins over the preset
    model = wrapper.get_model("jax/opt-350m", path=tmp_path)
    assert model.config == cfg
    np.testing.assert_allclose(np.asarray(model(ids)), ref, atol=1e-4)
    # the folder itself also works, and the params go back to the same files
    again = wrapper.get_model("jax/opt-350m", path=tmp_path / "opt-350m-np")
    for name, arr in weights.params_to_arrays(cfg, again.params).items():
        np.testing.assert_array_equal(arr, weights.load_array(tmp_path / "opt-350m-np" / name))
    # facebook/ built from the same numpy folder is the HF reference
    fb = wrapper.get_model("facebook/opt-350m", path=tmp_path)
    with torch.no_grad():
        np.testing.assert_allclose(fb(torch.tensor(ids)).logits.numpy(), ref, atol=1e-5)


def test_load_params_converts_dtype(tmp_path):
    save_hf_as_numpy(hf_model(CFG), CFG, tmp_path)
    _, params = weights.load_params(tmp_path, dtype=jnp.float16)
    assert {x.dtype for x in __import__("jax").tree_util.tree_leaves(params)} == {jnp.dtype("float16")}


def test_missing_file_and_shape_mismatch_are_named(tmp_path):
    save_hf_as_numpy(hf_model(CFG), CFG, tmp_path)
    name = "decoder.layers.1.fc1.weight"
    (tmp_path / name).unlink()
    with pytest.raises(FileNotFoundError, match="missing weight file .*decoder.layers.1.fc1.weight"):
        weights.load_params(tmp_path)
    weights.save_array(tmp_path / name, np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match=r"shape mismatch .*fc1.weight.*\(3, 3\).*\(64, 32\)"):
        wrapper.get_model("jax/opt-125m", path=tmp_path)
    (tmp_path / name).write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="corrupt weight file"):
        weights.load_params(tmp_path)


def test_missing_folder_and_unknown_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="no numpy weights folder for 'jax/opt-1.3b'"):
        wrapper.get_model("jax/opt-1.3b", path=tmp_path)
    with pytest.raises(ValueError, match="unknown OPT model 'jax/opt-7b'"):
        wrapper.get_model("jax/opt-7b", path=tmp_path)
    with pytest.raises(ValueError, match="must start with one of"):
        wrapper.get_model("opt-125m", path=tmp_path)
    with pytest.raises(KeyError, match="not an OPT parameter"):
        weights.flax_path("decoder.something.weight")

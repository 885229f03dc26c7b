"""Tensor parallelism over 8 host devices equals the single-device model.

jax must see 8 CPU devices before it is imported, so the real tests run in a child
pytest with XLA_FLAGS set; in the parent only `test_in_8_device_subprocess` runs.
"""

import numpy as np
import pytest

from opt_serving.config import OPTConfig
from opt_serving.parallel import cost
from opt_serving.testing.multidevice import rerun_with_8_devices

needs8 = pytest.mark.multidevice

CFG = OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                ffn_dim=256, max_position_embeddings=64, word_embed_proj_dim=64)


def test_in_8_device_subprocess():
    out = rerun_with_8_devices(__file__)
    # the child ran the 8-device tests rather than skipping them
    assert "3 passed, 2 deselected" in out, out[-2000:]


def test_specs_agree_with_the_cost_model():
    """sharding.py splits exactly the dims cost.py charges as split (no jax devices needed)."""
    from opt_serving.model.weights import flax_path, param_shapes
    from opt_serving.parallel.sharding import TP_RULES, param_spec
    shapes = param_shapes(CFG.replace(word_embed_proj_dim=32))   # with project_in/out
    for name, shape in shapes.items():
        spec = tuple(param_spec(name, TP_RULES))
        spec = spec + (None,) * (len(shape) - len(spec))
        if flax_path(name)[1]:
            spec = spec[::-1]                         # back to torch [out, in]
        split = [i for i, a in enumerate(spec) if a == "tp"]
        want = cost.tp_dim(name)
        assert split == ([] if want is None else [want]), name


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from opt_serving.model import param_tree
    from opt_serving.model.weights import params_to_arrays, save_numpy_folder
    params = param_tree.init_params(CFG, seed=3, std=0.2)
    path = tmp_path_factory.mktemp("tiny")
    save_numpy_folder(path, CFG, params_to_arrays(CFG, params))
    return path


def _greedy(model_prefill, model_decode, cache, ids, mask, steps):
    """Prefill then `steps` greedy decode steps; returns every step's logits and the tokens."""
    import jax.numpy as jnp
    logits, cache = model_prefill(cache, ids, mask)
    all_logits, tokens = [np.asarray(logits)], []
    s = ids.shape[1]
    pos = np.asarray(mask).sum(1) - 1
    tok = np.asarray(logits[:, -1]).argmax(-1)
    for i in range(steps):
        tokens.append(tok)
        pos = pos + 1
        lg, cache = model_decode(cache, jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32),
                                 jnp.full(ids.shape[0], s + i, jnp.int32))
        all_logits.append(np.asarray(lg))
        tok = np.asarray(lg).argmax(-1)
    return all_logits, np.stack(tokens, 1), cache


@needs8
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_single_device(folder, tp):
    import jax
    import jax.numpy as jnp
    from opt_serving.model import steps
    from opt_serving.model.kv_cache import init_cache
    from opt_serving.model.weights import load_params
    from opt_serving.parallel.sharding import ShardedOPT, load_sharded_params, make_mesh

    assert len(jax.devices()) == 8
    _, ref_params = load_params(folder)
    mesh = make_mesh(jax.devices()[:tp], tp)
    params = load_sharded_params(folder, CFG, mesh)
    # each device holds 1/tp of a column-parallel kernel, vocab rows and the cache heads
    q = params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert {s.data.shape for s in q.addressable_shards} == {(64, 64 // tp)}
    emb = params["embed_tokens"]["embedding"]
    assert {s.data.shape for s in emb.addressable_shards} == {(128 // tp, 64)}
    model = ShardedOPT(CFG, params, mesh)
    cache = model.init_cache(2, 32)
    assert {s.data.shape for s in cache["k"][0].addressable_shards} == {(2, 4 // tp, 32, 16)}

    ids = jnp.asarray([[1, 1, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42]], jnp.int32)   # row 0 left-padded
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1] * 6], jnp.int32)
    ref = _greedy(lambda c, i, m: steps.prefill(CFG, ref_params, c, i, m),
                  lambda c, *a: steps.decode(CFG, ref_params, c, *a),
                  init_cache(CFG, 2, 32), ids, mask, 6)
    got = _greedy(model.prefill, model.decode, cache, ids, mask, 6)
    for a, b in zip(ref[0], got[0]):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(got[1], ref[1])
    assert {s.data.shape for s in got[2]["v"][1].addressable_shards} == {(2, 4 // tp, 32, 16)}


@needs8
def test_bad_degree_is_explained(folder):
    import jax
    from opt_serving.parallel.sharding import load_sharded_params, make_mesh
    with pytest.raises(ValueError, match="tensor parallel degree 8 does not divide attention heads = 4"):
        load_sharded_params(folder, CFG, make_mesh(jax.devices()))
    with pytest.raises(ValueError, match="needs 2 devices"):
        make_mesh(jax.devices()[:3], 2)

"""Random weights drawn where they live (model/sources.py): a subset of the model, a pipeline stage's layers
or a tensor-parallel device's slice, holds exactly the numbers of the one-device model with the same seed;
and a model built a layer at a time in its runtime layout computes what the whole checkpoint tree does.
The tensor-parallel cases run in a child process that sees 8 host devices."""
import numpy as np
import pytest

from opt_serving.testing.multidevice import rerun_with_8_devices

from conftest import SMALL, TINY_POST_LN

needs8 = pytest.mark.multidevice
CFG = SMALL
IDS = np.array([[1, 1, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42]], np.int32)
MASK = np.array([[0, 0, 1, 1, 1, 1], [1] * 6], np.int32)


def _leaves(tree) -> dict:
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _same(a, b):
    a, b = _leaves(a), _leaves(b)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_in_8_device_subprocess():
    out = rerun_with_8_devices(__file__)
    assert "2 passed, 8 deselected" in out, out[-2000:]


def test_each_tensor_has_its_own_numbers_from_the_seed():
    """Tensors of one shape differ from each other and between seeds; the seed gives them back exactly; biases
    are zero and norms one."""
    from opt_serving.model import param_tree
    a, again, other = (param_tree.init_params(CFG, s) for s in (3, 3, 4))
    _same(a, again)
    q, k = (np.asarray(a["layers_0"]["self_attn"][n]["kernel"]) for n in ("q_proj", "k_proj"))
    assert not np.array_equal(q, k)
    assert not np.array_equal(q, np.asarray(a["layers_1"]["self_attn"]["q_proj"]["kernel"]))
    assert not np.array_equal(q, np.asarray(other["layers_0"]["self_attn"]["q_proj"]["kernel"]))
    assert 0.015 < q.std() < 0.025  # normal(0, 0.02)
    assert not np.asarray(a["layers_0"]["fc1"]["bias"]).any()
    np.testing.assert_array_equal(np.asarray(a["layers_0"]["final_layer_norm"]["ln"]["scale"]), 1)


def _file_mappings(nbytes: int) -> list[int]:
    """Resident kB of each mapping of this process of a deleted file of `nbytes` (rounded up to pages)."""
    size = -(-nbytes // 4096) * 4096
    out, lines = [], open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.endswith("(deleted)"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            rss = next(int(x.split()[1]) for x in lines[i + 1:i + 8] if x.startswith("Rss:"))
            if hi - lo == size:
                out.append(rss)
    return out


def test_a_drawn_embedding_on_a_cpu_is_a_mapped_file_read_only_where_looked_up():
    """An embedding drawn for one CPU device is drawn into a file with no name and mapped, as a folder's file
    is: the device's array is the mapping (none of it resident), a lookup of two rows brings in only the pages
    that hold them, and it holds the numbers the in-memory draw gives. A matrix under FILE_BACKED_BYTES (the
    positions) is drawn into memory."""
    import gc
    import jax.numpy as jnp
    from opt_serving.model import sources
    name, shape = "decoder.embed_tokens.weight", (16384, 1024)  # 64 MiB in float32
    nbytes = shape[0] * shape[1] * 4
    assert nbytes >= sources.FILE_BACKED_BYTES > 2050 * 1024 * 4
    before = len(_file_mappings(nbytes))
    x = sources.RandomSource(7).place(name, shape, None, jnp.float32)
    positions = sources.RandomSource(7).place("decoder.embed_positions.weight", (2050, 1024), None, jnp.float32)
    assert len(_file_mappings(2050 * 1024 * 4)) == 0
    assert _file_mappings(nbytes)[before:] == [0]
    rows = np.asarray(jnp.take(x, jnp.array([3, 5000]), axis=0))
    # kB: two rows of 4 kB, in the pages (or the page cache's folios, up to 2 MiB) that hold them
    assert 0 < _file_mappings(nbytes)[before] * 1024 <= nbytes // 8
    drawn = sources.Drawn(sources.tensor_key(7, name), shape, sources.DUMMY_STD)
    np.testing.assert_array_equal(rows, np.concatenate([drawn[3:4, :], drawn[5000:5001, :]]))
    np.testing.assert_array_equal(np.asarray(x), drawn[:, :])
    np.testing.assert_array_equal(np.asarray(positions), sources.Drawn(
        sources.tensor_key(7, "decoder.embed_positions.weight"), (2050, 1024), sources.DUMMY_STD)[:, :])
    del x, rows
    gc.collect()
    assert len(_file_mappings(nbytes)) == before  # the file goes with the array


@pytest.mark.parametrize("cfg", [CFG, TINY_POST_LN], ids=["pre-ln", "post-ln projected"])
def test_any_subset_draws_the_whole_models_numbers(cfg):
    """A pipeline stage's names alone, in any order of stages, give the whole model's tensors for them."""
    from opt_serving.model import param_tree
    from opt_serving.parallel.stage_weights import stage_param_names, stage_specs
    whole = param_tree.init_params(cfg, seed=9, dtype="bfloat16")
    for spec in reversed(stage_specs(cfg, 2)):
        alone = param_tree.init_params(cfg, seed=9, dtype="bfloat16", names=stage_param_names(cfg, spec))
        _same(param_tree.stage_params(alone, spec), param_tree.stage_params(whole, spec))


def test_the_runtime_layout_built_a_layer_at_a_time_computes_what_the_whole_tree_does(tmp_path):
    """jax/ builds its packed runtime params from the folder a layer at a time (layout.runtime_parts): the same
    logits as the checkpoint tree put in that layout at once, and the same checkpoint params back."""
    from opt_serving.model import layout, param_tree
    from opt_serving.models import get_model
    from opt_serving.model.weights import params_to_arrays, save_numpy_folder
    from opt_serving.model.wrapper import OPTModel
    params = param_tree.init_params(CFG, seed=5, std=0.2)
    save_numpy_folder(tmp_path, CFG, params_to_arrays(CFG, params))
    streamed = get_model("jax/opt-tiny", tmp_path)
    at_once = OPTModel(CFG, params)
    assert streamed.model.backend == at_once.backend
    np.testing.assert_array_equal(np.asarray(streamed(IDS, MASK)), np.asarray(at_once(IDS, MASK)))
    _same(streamed.params, params)
    dummy = get_model("jax/opt-tiny", dummy=True, seed=5)
    _same(layout.checkpoint_params(dummy.config, dummy.model.backend, dummy.model.fused_params),
          param_tree.init_params(dummy.config, seed=5))


@needs8
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_devices_draw_their_slices_of_the_one_device_draw(tp):
    """Each device of a tp mesh draws only its slice (its shard has the slice's shape), and together they hold
    the one-device model's numbers; the mesh path of alpa/ gives the one-device dummy model's logits."""
    import jax
    from opt_serving.model import param_tree, sources
    from opt_serving.model.wrapper import get_model
    from opt_serving.parallel.sharding import load_sharded_params, make_mesh
    mesh = make_mesh(jax.devices()[:tp], tp)
    sharded = load_sharded_params(sources.RandomSource(seed=11), CFG, mesh)
    fc1 = sharded["layers_1"]["fc1"]["kernel"]  # [in, out], out split
    assert {s.data.shape for s in fc1.addressable_shards} == {(CFG.hidden_size, CFG.ffn_dim // tp)}
    _same(sharded, param_tree.init_params(CFG, seed=11))
    model = get_model("alpa/opt-tiny", dummy=True, seed=11, tensor_parallel=tp, pipeline_parallel=1)
    one = get_model("jax/opt-tiny", dummy=True, seed=11)
    np.testing.assert_allclose(np.asarray(model(IDS, MASK)), np.asarray(one(IDS, MASK)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_a_transposed_view_is_put_on_one_device_as_its_numbers(tmp_path, dtype):
    """put() of a checkpoint's [out, in] matrix as [in, out] (a transposed view of a memory-mapped file, of an int8
    array), turned on the device: the same numbers as numpy's copy, in the asked dtype."""
    from opt_serving.model.sources import put
    rng = np.random.default_rng(0)
    mapped = np.lib.format.open_memmap(tmp_path / "w.npy", mode="w+", dtype=np.float16, shape=(300, 70))
    mapped[:] = rng.standard_normal((300, 70))
    q = rng.integers(-127, 128, (130, 90)).astype(np.int8)
    for host in (mapped.T, q.T, q[:, :40].T):  # the last: a strided view, copied by numpy as before
        got = put(host, None, dtype)
        want = np.ascontiguousarray(host, dtype=np.dtype(dtype) if dtype else host.dtype)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(np.asarray(got), want)

"""Pipeline stages, chained in this process, reproduce the whole model."""
import numpy as np
import pytest

from conftest import SMALL

CFG = SMALL
IDS = np.array([[1, 1, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42]], np.int32)   # row 0 left-padded
MASK = np.array([[0, 0, 1, 1, 1, 1], [1] * 6], np.int32)


def _run(prefill, decode, steps=5):
    logits = [np.asarray(prefill(IDS, MASK))]
    tokens = []
    pos, tok = MASK.sum(1) - 1, logits[0][:, -1].argmax(-1).astype(np.int32)
    for i in range(steps):
        tokens.append(tok)
        pos = (pos + 1).astype(np.int32)
        lg = np.asarray(decode(tok, pos, np.full(2, IDS.shape[1] + i, np.int32)))
        logits.append(lg)
        tok = lg.argmax(-1).astype(np.int32)
    return logits, np.stack(tokens, 1)


@pytest.fixture(scope="module")
def reference():
    from opt_serving.model import param_tree, steps
    from opt_serving.model.kv_cache import init_cache
    params = param_tree.init_params(CFG, seed=5, std=0.2)
    state = {"cache": init_cache(CFG, 2, 32)}

    def prefill(ids, mask):
        out, state["cache"] = steps.prefill(CFG, params, state["cache"], ids, mask)
        return out

    def decode(*args):
        out, state["cache"] = steps.decode(CFG, params, state["cache"], *args)
        return out
    return params, _run(prefill, decode)


def _check(got, ref):
    for a, b in zip(ref[0], got[0]):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(got[1], ref[1])


@pytest.mark.parametrize("split", [[2, 2], [1, 3], [1, 1, 1, 1]])
def test_local_stages_equal_the_model(reference, split):
    """The model's own modules over each stage's layers (opt.StageSpec), as the stage actors run them."""
    from opt_serving.model import param_tree
    from opt_serving.parallel.stage_weights import stage_specs
    from opt_serving.runner.stage import StageSlots
    params, ref = reference
    specs = stage_specs(CFG, len(split), split)
    assert [(s.start, s.stop, s.first, s.last) for s in specs][-1] == (4 - split[-1], 4, len(split) == 1, True)
    stages = [StageSlots(CFG, param_tree.stage_params(params, s), s, rows=1) for s in specs]
    for s in stages:
        s.seq_open(0, 2, 32)

    def prefill(ids, mask):
        x = ids
        for s in stages:
            x = s.seq_prefill(0, x, mask, True)
        return x

    def decode(tok, pos, idx):
        x = tok
        for s in stages:
            x = s.seq_decode(0, x, pos, idx)
        return x
    _check(_run(prefill, decode), ref)


def test_split_layers_checks_cover():
    from opt_serving.parallel.stage_weights import split_layers
    assert [len(r) for r in split_layers(10, 3)] == [4, 3, 3]
    with pytest.raises(ValueError, match="does not cover 4 layers"):
        split_layers(4, 2, [1, 2])

# The Ray stage actors are tested through the alpa/ backend in test_parallel_backend.py.


def test_a_node_without_the_weights_names_itself_and_the_path(tmp_path):
    from opt_serving.parallel.stage_weights import load_stage_params, stage_specs
    missing = tmp_path / "opt-tiny-np"
    with pytest.raises(FileNotFoundError, match=r"node \S+ .*has no numpy weights folder at .*opt-tiny-np"):
        load_stage_params(missing, CFG, stage_specs(CFG, 2)[1])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A float numpy folder of SMALL and the same weights quantized on disk (`convert --quantize int8`)."""
    import shutil
    from opt_serving.model import param_tree, quantize
    from opt_serving.model.weights import params_to_arrays, save_numpy_folder
    d = tmp_path_factory.mktemp("stage-folders")
    save_numpy_folder(d / "f32", CFG, params_to_arrays(CFG, param_tree.init_params(CFG, seed=2, std=0.2)))
    shutil.copytree(d / "f32", d / "q8")
    for name in quantize.quantized_names(CFG):
        quantize.quantize_file(d / "q8", name)
    quantize.write_marker(d / "q8")
    return d


def _leaves(tree) -> dict:
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("split", [[2, 2], [1, 2, 1]])
def test_a_stage_loaded_alone_equals_its_slice_of_the_whole_model(folders, split, quantize):
    """Each stage reads only its tensors, from the folder or drawn from the seed: exactly the whole model's
    tree cut to the stage (jax/'s loaders for the whole), for float and int8 weights (the int8 head's copy on
    the last stage only, the embedding on the first)."""
    from opt_serving.model import param_tree, sources
    from opt_serving.model import quantize as quantization
    from opt_serving.model.weights import load_params
    from opt_serving.parallel.stage_weights import load_stage_params, stage_specs
    if quantize:
        whole = quantization.load_params(folders / "f32", CFG)
        random_whole = quantization.quantize_params(param_tree.init_params(CFG, seed=4))
    else:
        whole = load_params(folders / "f32", CFG)[1]
        random_whole = param_tree.init_params(CFG, seed=4)
    for spec in stage_specs(CFG, len(split), split):
        for source, want in ((sources.RandomSource(seed=4), random_whole), (folders / "f32", whole)):
            got = _leaves(load_stage_params(source, CFG, spec, quantize=quantize))
            expected = _leaves(param_tree.stage_params(want, spec))
            assert got.keys() == expected.keys()
            for k in got:
                np.testing.assert_array_equal(got[k], expected[k], err_msg=f"{spec} {source} {k}")
        if quantize:  # read as they are from the quantized folder: the float folder's numbers (`got`)
            from_disk = _leaves(load_stage_params(folders / "q8", CFG, spec, quantize=quantize))
            assert ("['lm_head']['qkernel']" in from_disk) == spec.last
            assert ("['embed_tokens']['embedding']" in from_disk) == spec.first
            assert from_disk.keys() == got.keys()
            for k, v in from_disk.items():
                np.testing.assert_array_equal(v, got[k], err_msg=k)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_stages_built_a_layer_at_a_time_compute_what_their_whole_trees_do(folders, quantize):
    """load_stage (the stage actor's loader: the runtime layout built a layer at a time) chained over the
    stages gives the logits of StageSlots over each stage's checkpoint tree put in that layout at once."""
    from opt_serving.parallel.stage_weights import load_stage, load_stage_params, stage_specs
    from opt_serving.runner.stage import StageSlots
    specs = stage_specs(CFG, 2)
    chains = []
    for streamed in (True, False):
        stages = []
        for spec in specs:
            if streamed:
                backend, params = load_stage(folders / "f32", CFG, spec, quantize=quantize)
                assert not backend.greedy_head  # no screen where a stage is not both first and last
                assert ("lm_head" in params) == spec.last  # no packed head on the first stage
                if spec.last and backend.products and not quantize:  # the packed head alone, no float32 embedding
                    assert params["embed_tokens"]["embedding"].shape == (CFG.vocab_size, 0)
                stages.append(StageSlots(CFG, params, spec, rows=1, backend=backend))
            else:
                stages.append(StageSlots(CFG, load_stage_params(folders / "f32", CFG, spec, quantize=quantize),
                                         spec, rows=1))
        x = IDS
        for s in stages:
            s.seq_open(0, 2, 16)
            x = s.seq_prefill(0, x, MASK, True)
        chains.append(np.asarray(x))
    np.testing.assert_array_equal(chains[0], chains[1])


def test_the_stage_actor_offers_exactly_the_declared_stage_calls_and_the_runner_makes_no_other():
    """runner.types.STAGE_CALLS is the stage interface: StageSlots implements every call, the Ray stage actor is
    generated from it (each forwarding to its StageSlots), and every call runner/slots.py sends a stage is in it."""
    import inspect
    import re
    from opt_serving.parallel.stage_actor import StageActor
    from opt_serving.runner import slots
    from opt_serving.runner.stage import StageSlots
    from opt_serving.runner.types import STAGE_CALLS

    class Recorder:
        def __init__(self):
            self.seen = []

        def __getattr__(self, name):
            return lambda *args: self.seen.append((name, args)) or name

    for name, step in STAGE_CALLS.items():
        assert callable(getattr(StageSlots, name, None)), name
        actor = StageActor.__new__(StageActor)  # no model: the forwarding alone
        actor.slots, actor._busy, actor._calls = Recorder(), 0.0, 0
        assert getattr(StageActor, name)(actor, 1, "x") == name and actor.slots.seen == [(name, (1, "x"))]
        assert actor._calls == (1 if step else 0), name  # the steps count as the stage's busy time
    sent = set(re.findall(r'(?:call\([^,]+, |_to_all\()"([a-z_]+)"', inspect.getsource(slots)))
    assert sent and sent <= set(STAGE_CALLS), sent - set(STAGE_CALLS)


def test_a_placement_no_node_could_hold_is_refused_naming_the_resources():
    """never_placed: a plan whose stage bundles the cluster's nodes could never hold (even idle) is refused when
    it is made (RayStages, serve's placement), naming what it needs and what the nodes have; one they could hold
    is not, however busy they are now (Ray waits for room then)."""
    from opt_serving.parallel.placement import never_placed
    node = lambda cpus, gpus=0, alive=True: {"Alive": alive, "Resources": {"CPU": cpus, "memory": 1e9,
                                                                             **({"GPU": gpus} if gpus else {})}}
    four = [{"CPU": 1.0}] * 4
    why = never_placed(four, "SPREAD", [node(2)])  # pipeline_parallel=4 on a 2-CPU local Ray
    assert why is not None and "CPU 4" in why and "CPU 2" in why
    assert never_placed(four, "SPREAD", [node(2), node(2)]) is None
    assert never_placed(four, "STRICT_SPREAD", [node(8), node(8)]) is not None  # one stage a node: 2 nodes for 4
    assert never_placed(four, "STRICT_SPREAD", [node(1)] * 4) is None
    assert never_placed(four, "SPREAD", [node(2), node(2, alive=False)]) is not None  # a dead node holds nothing
    gpu = [{"CPU": 1.0, "GPU": 2.0}] * 2
    assert "GPU 4" in never_placed(gpu, "PACK", [node(16, gpus=2)])
    assert never_placed(gpu, "PACK", [node(16, gpus=4)]) is None
    assert never_placed([{"CPU": 3.0}], "PACK", [node(2), node(2)]) is not None  # a bundle lies on one node

"""alpa/ equals jax/: tensor parallel 2 and 4 (8 host devices, child process), pipeline 2, 4 and
2 x tensor 2 (Ray stage actors; beam search on pp 2 and 2 x 2), a dead stage reported, and a
rebuild in the same process. Ray starts are slow on 2 cores: one test holds them. int8 weights on every
plan: a one-device stage runs jax/'s int8 products (the same numbers as jax/ int8), a tensor-parallel
group XLA's product on the int8 numbers and their scales (the float model on the dequantized weights).
"""

import time

import numpy as np
import pytest

from opt_serving.testing.multidevice import rerun_with_8_devices

from conftest import SMALL

needs8 = pytest.mark.multidevice

CFG = SMALL
IDS = np.array([[1, 1, 5, 9, 17, 3], [4, 8, 15, 16, 23, 42], [7, 7, 7, 2, 9, 11]], np.int32)
MASK = np.array([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 1, 1, 1, 1, 1]], np.int32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from opt_serving.model import param_tree
    from opt_serving.model.weights import params_to_arrays, save_numpy_folder
    path = tmp_path_factory.mktemp("opt-tiny")
    # large weights so that logits differ clearly between tokens (greedy is not a tie-break test)
    save_numpy_folder(path, CFG, params_to_arrays(CFG, param_tree.init_params(CFG, seed=10, std=0.3)))
    return path


@pytest.fixture(scope="module")
def int8_folders(folder, tmp_path_factory):
    """(the folder quantized on disk as `convert --quantize int8` writes it, the float folder of its
    dequantized weights: the numbers an int8 model multiplies by)."""
    import shutil
    from opt_serving.model import quantize
    from opt_serving.model.weights import load_numpy_folder, save_numpy_folder
    d = tmp_path_factory.mktemp("int8")
    shutil.copytree(folder, d / "q8")
    names = quantize.quantized_names(CFG)
    for name in names:
        quantize.quantize_file(d / "q8", name)
    quantize.write_marker(d / "q8")
    cfg, arrays = load_numpy_folder(folder)
    save_numpy_folder(d / "dequantized", cfg, {k: quantize.dequantize_rows(*quantize.quantize_rows(v))
                                               if k in names else np.asarray(v) for k, v in arrays.items()})
    return d / "q8", d / "dequantized"


@pytest.fixture(scope="module")
def reference(folder):
    from opt_serving.model.wrapper import get_model
    ref = get_model("jax/opt-tiny", folder)
    return (np.asarray(ref(IDS, MASK)), ref.generate(IDS, MASK, max_new_tokens=8),
            ref.generate(IDS, MASK, max_new_tokens=6, num_beams=3))


def test_in_8_device_subprocess():
    out = rerun_with_8_devices(__file__)
    assert "4 passed" in out, out[-2000:]


@needs8
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_jax(folder, reference, tp):
    from opt_serving.model.wrapper import get_model
    model = get_model("alpa/opt-tiny", folder, tensor_parallel=tp, pipeline_parallel=1)
    assert model.plan.tp == tp and model.plan.pp == 1
    q = model.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert len(q.sharding.device_set) == tp
    logits, greedy, beams = reference
    np.testing.assert_allclose(np.asarray(model(IDS, MASK)), logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(model.generate(IDS, MASK, max_new_tokens=8), greedy)
    np.testing.assert_array_equal(model.generate(IDS, MASK, max_new_tokens=6, num_beams=3), beams)
    # the search's host callback (asked before each step) on the sharded loop: no change, and a stop
    np.testing.assert_array_equal(model.generate(IDS, MASK, max_new_tokens=6, num_beams=3,
                                                 should_stop=lambda: False), beams)
    _assert_stops_when_told(model)


def _assert_stops_when_told(model):
    """A beam search whose should_stop says stop at its third question ends there with SearchStopped."""
    from opt_serving.model.beam_search import SearchStopped
    asked = []

    def should_stop():
        asked.append(len(asked) >= 2)
        return asked[-1]
    with pytest.raises(SearchStopped):
        model.generate(IDS, MASK, max_new_tokens=8, num_beams=3, should_stop=should_stop)
    assert asked[:3] == [False, False, True] and all(asked[2:]) and len(asked) <= 4


@needs8
def test_int8_tensor_parallel_multiplies_the_dequantized_weights(folder, int8_folders):
    from opt_serving.model.wrapper import get_model
    q8, dequantized = int8_folders
    ref = get_model("jax/opt-tiny", dequantized)
    at_load = get_model("alpa/opt-tiny", folder, tensor_parallel=2, pipeline_parallel=1, quantize="int8")
    from_disk = get_model("alpa/opt-tiny", q8, tensor_parallel=2, pipeline_parallel=1, quantize="int8")
    head = at_load.fused_params["lm_head"]["qkernel"]
    assert head.dtype == np.int8 and len(head.sharding.device_set) == 2 and at_load.plan.weights == "int8"
    want = np.asarray(ref(IDS, MASK))
    np.testing.assert_allclose(np.asarray(at_load(IDS, MASK)), want, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(from_disk(IDS, MASK)), np.asarray(at_load(IDS, MASK)))
    np.testing.assert_array_equal(at_load.generate(IDS, MASK, max_new_tokens=8),
                                  ref.generate(IDS, MASK, max_new_tokens=8))
    with pytest.raises(ValueError, match="quantize='int8'"):
        get_model("alpa/opt-tiny", q8, tensor_parallel=2, pipeline_parallel=1)


@needs8
def test_planner_fills_in_left_out_degrees(folder, reference):
    from opt_serving.model.wrapper import get_model
    model = get_model("alpa/opt-tiny", folder, pipeline_parallel=1)
    assert model.plan.pp == 1 and 8 % model.plan.tp == 0 and model.plan.use == "generate"
    np.testing.assert_array_equal(model.generate(IDS, MASK, max_new_tokens=8), reference[1])


# beams: 4 with 2 returned; then a token the model often picks as EOS with early stopping, so
# hypotheses finish and the search ends before max_new_tokens
BEAM_CASES = [dict(max_new_tokens=8, num_beams=4, num_return_sequences=2),
              dict(max_new_tokens=10, num_beams=3, eos_token_id=14, early_stopping=True)]


@pytest.fixture(scope="module")
def beam_reference(folder):
    from opt_serving.model.wrapper import get_model
    ref = get_model("jax/opt-tiny", folder)
    out = [np.asarray(ref.generate(IDS, MASK, **kw)) for kw in BEAM_CASES]
    assert out[0].shape == (2 * len(IDS), IDS.shape[1] + 8)
    assert out[1].shape[1] < IDS.shape[1] + 10, "the EOS case should stop early"
    return out


# what generate() takes beyond greedy: every one runs the same front and token choice on every plan
FEATURE_CASES = [dict(max_new_tokens=6, output_scores=True, return_dict_in_generate=True),
                 dict(max_new_tokens=6, bad_words_ids=[[5], [9, 17]], min_length=10, repetition_penalty=1.3),
                 dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=20, seed=11,
                      num_return_sequences=2)]


@pytest.fixture(scope="module")
def feature_reference(folder):
    from opt_serving.model.wrapper import get_model
    ref = get_model("jax/opt-tiny", folder)
    return [ref.generate(IDS, MASK, **kw) for kw in FEATURE_CASES]


def _same_generation(got, want):
    if hasattr(want, "sequences"):
        np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
        assert len(got.scores) == len(want.scores)
        for a, b in zip(got.scores, want.scores):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pipelines_equal_jax_and_a_dead_stage_is_reported(ray_local, folder, reference,
                                                          beam_reference, feature_reference):
    """Each plan replaces the last one in `model` (no shutdown by hand): the dropped pipeline frees its
    actors and placement group, or the 4-CPU Ray could not place the next one."""
    from opt_serving.model.wrapper import get_model
    from opt_serving.parallel.pipeline import StageDied
    logits, greedy, _ = reference
    model = None
    # pp 2 x tp 2 comes last: it is also the rebuild, in the same process, after a stage died
    for pp, tp in [(2, 1), (4, 1), (2, 2)]:
        model = get_model("alpa/opt-tiny", folder, tensor_parallel=tp, pipeline_parallel=pp)
        assert (model.plan.pp, model.plan.tp) == (pp, tp)
        assert [w["devices"] for w in model.pipeline.where()] == [tp] * pp
        np.testing.assert_allclose(model(IDS, MASK), logits, atol=1e-4, rtol=1e-4)
        # 3 rows in pp micro-batches, in flight together
        np.testing.assert_array_equal(model.generate(IDS, MASK, max_new_tokens=8), greedy)
        if pp == 2:
            # 3 prompts x beams in 2 micro-batches; every stage reorders its cache per step
            for kw, want in zip(BEAM_CASES, beam_reference):
                np.testing.assert_array_equal(model.generate(IDS, MASK, **kw), want)
            for kw, want in zip(FEATURE_CASES, feature_reference):
                _same_generation(model.generate(IDS, MASK, **kw), want)
            # told to stop, the host loop stops before the next micro-batch's step; the stages serve on
            _assert_stops_when_told(model)
            np.testing.assert_array_equal(model.generate(IDS, MASK, **BEAM_CASES[0]), beam_reference[0])
        if pp == 4:
            ray_local.kill(model.pipeline.actors[2])
            with pytest.raises(StageDied, match=r"stage 2 \(layers 2-2\) died.*loaded again"):
                model.generate(IDS, MASK, max_new_tokens=4)
            with pytest.raises(StageDied, match="stage 2"):
                model.generate(IDS, MASK, max_new_tokens=4, num_beams=2)
            with pytest.raises(ValueError, match=r"num_return_sequences \(3\) > num_beams \(2\)"):
                model.generate(IDS, MASK, max_new_tokens=4, num_beams=2, num_return_sequences=3)
    model.close()
    # every stage's CPU comes back (Ray frees a removed placement group's resources asynchronously)
    deadline = time.monotonic() + 30
    while ray_local.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_local.available_resources().get("CPU") == 4


def test_int8_pipelines_equal_jax_int8(ray_local, folder, int8_folders):
    """pp 2 quantizes each stage's weights as it reads them: jax/ int8's numbers, stage by stage; pp 2 x tp 2
    reads the quantized folder, each tp pair splitting int8 weights: the dequantized float model's."""
    from opt_serving.model.wrapper import get_model
    q8, dequantized = int8_folders
    one = get_model("jax/opt-tiny", folder, quantize="int8")
    model = get_model("alpa/opt-tiny", folder, pipeline_parallel=2, tensor_parallel=1, quantize="int8")
    try:
        np.testing.assert_allclose(model(IDS, MASK), np.asarray(one(IDS, MASK)), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(model.generate(IDS, MASK, max_new_tokens=8),
                                      one.generate(IDS, MASK, max_new_tokens=8))
    finally:
        model.close()
    ref = get_model("jax/opt-tiny", dequantized)
    model = get_model("alpa/opt-tiny", q8, pipeline_parallel=2, tensor_parallel=2, quantize="int8")
    try:
        assert [w["devices"] for w in model.pipeline.where()] == [2, 2]
        np.testing.assert_allclose(model(IDS, MASK), np.asarray(ref(IDS, MASK)), atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(model.generate(IDS, MASK, max_new_tokens=8),
                                      ref.generate(IDS, MASK, max_new_tokens=8))
    finally:
        model.close()


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_random_weights_each_stage_draws_are_the_one_device_models(ray_local, quantize):
    """dummy=True: each stage actor draws its own layers from the seed (nothing crosses the object store), and
    together they are jax/'s random model of that seed (int8: quantized as jax/ quantizes it)."""
    from opt_serving.model.wrapper import get_model
    one = get_model("jax/opt-tiny", dummy=True, seed=3, quantize=quantize)
    model = get_model("alpa/opt-tiny", dummy=True, seed=3, pipeline_parallel=2, tensor_parallel=1, quantize=quantize)
    try:
        np.testing.assert_allclose(model(IDS, MASK), np.asarray(one(IDS, MASK)), atol=1e-5, rtol=1e-5)
        other = get_model("jax/opt-tiny", dummy=True, seed=4, quantize=quantize)
        assert not np.allclose(np.asarray(other(IDS, MASK)), np.asarray(one(IDS, MASK)), atol=1e-3)
    finally:
        model.close()


# big enough that a stage's share (8 layers of 50 MB) dwarfs what a process allocates besides it
MEM_CFG = SMALL.replace(vocab_size=4096, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, ffn_dim=4096,
                        max_position_embeddings=128, word_embed_proj_dim=1024)


class _PeakRSS:
    """This process's highest resident memory while the block runs, sampled every 5 ms."""

    def __enter__(self):
        import threading
        from opt_serving.parallel.stage_actor import process_memory
        self.start = self.peak = process_memory()["rss"]
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, process_memory()["rss"])
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


@pytest.mark.parametrize("weights", ["folder", "random"])
def test_each_stage_loads_about_its_share_and_the_driver_nothing(ray_local, tmp_path_factory, weights):
    """pp 2 over an 800 MB model: while loading, each stage actor's peak resident memory grows by its params in
    their runtime layout, plus at most half as much again (a layer in transit, freed blocks given back) and 128
    MB (what compiling the random draws and packing takes); building the whole checkpoint tree first took
    2.2-2.6x its share. The driver's grows by less than a tenth of the model (random weights were drawn whole
    in it and shipped through the object store)."""
    import types
    from opt_serving.model.sources import save_random_folder
    from opt_serving.parallel import cost
    from opt_serving.parallel.pipeline import RayStages
    cfg = MEM_CFG
    folder = None
    if weights == "folder":
        folder = save_random_folder(tmp_path_factory.mktemp("mem") / "np", cfg, seed=1)
    plan = types.SimpleNamespace(pp=2, tp=1, layer_split=[8, 8])
    with _PeakRSS() as driver:
        stages = RayStages(cfg, plan, folder, seed=1, max_seq_len=32)
    try:
        whole = cost.weight_bytes(cfg, "float32")
        assert driver.growth < 0.1 * whole, (driver.growth, whole)
        for i, (actor, spec) in enumerate(zip(stages.actors, stages.specs)):
            loaded = ray_local.get(actor.memory.remote())["loaded"]
            share = (cost.stage_param_bytes(cfg, spec.num_layers, spec.first, spec.last, 1, "float32")
                     + cost.runtime_extra_bytes(cfg, spec.last, 1, "float32", cpu=True, first=spec.first))
            growth = loaded["peak_rss"] - loaded["before"]["rss"]
            assert 0.9 * share < growth < 1.5 * share + 128e6, (i, growth / 1e6, share / 1e6)
    finally:
        stages.close()

"""LoRA adapters on every plan: tensor parallel 2 (8 host devices, child process: A and B split as the layers they
modify) and pipeline 2 (Ray stage actors, each holding its layers' adapters) give PEFT's numbers and tokens, for
get_model() (beside the weights, and merged) and for the engine's slots serving two adapters and the base model
in the same steps; int8 base weights on a tensor-parallel mesh with an adapter equal the one-device model's."""
import threading

import numpy as np
import pytest
import torch

from opt_serving.testing.multidevice import rerun_with_8_devices

from conftest import ALL_TARGETS, SMALL, hf_model, peft_model

needs8 = pytest.mark.multidevice

CFG = SMALL
IDS = np.array([[5, 9, 17, 3, 22, 7], [4, 8, 15, 16, 23, 42]], np.int32)
NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """HF's random model of SMALL as a numpy folder (with its config.json)."""
    from opt_serving.model import weights
    path = tmp_path_factory.mktemp("small")
    params = weights.params_from_hf_state_dict(CFG, hf_model(CFG).state_dict())
    weights.save_numpy_folder(path, CFG, weights.params_to_arrays(CFG, params))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from opt_serving.testing.lora import write_adapter
    d = tmp_path_factory.mktemp("adapters")
    return {"a0": write_adapter(d / "a0", CFG, ALL_TARGETS, rank=8, seed=0, std=0.05),
            "a1": write_adapter(d / "a1", CFG, ("q_proj", "v_proj", "fc2"), rank=16, seed=1, std=0.05)}


def peft_reference(adapter):
    """(PEFT's greedy continuation of IDS, its full-sequence logits) with `adapter` (None: the base model)."""
    model = hf_model(CFG) if adapter is None else peft_model(CFG, adapter)
    with torch.no_grad():
        tokens = model.generate(input_ids=torch.tensor(IDS), max_new_tokens=NEW, do_sample=False, pad_token_id=1,
                                eos_token_id=None).numpy()
        return tokens, model(torch.tensor(IDS)).logits.numpy()


def check_model(m, adapter):
    tokens, logits = peft_reference(adapter)
    np.testing.assert_allclose(np.asarray(m(IDS)), logits, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(m.generate(IDS, max_new_tokens=NEW, eos_token_id=None)), tokens)


def check_engine(slots, adapters):
    """Requests of both adapters and of the base model, in flight together through an engine over `slots`: each
    gets PEFT's tokens for its own."""
    from opt_serving.engine.scheduler import Engine
    from opt_serving.runner.types import SlotSettings
    for name, path in adapters.items():
        slots.loras.add(name, path)
    eng = Engine(slots, start=False, prefill_chunk=0, decode_steps=1)
    eng.warmup()
    eng.start()
    try:
        jobs = []
        for row in range(len(IDS)):
            for name in (*adapters, None):
                done, tokens = threading.Event(), []

                def on_output(o, tokens=tokens, done=done):  # (a true answer would stop the request)
                    tokens.extend(x.id for x in o.tokens)
                    if o.finish_reason:
                        done.set()
                eng.submit(IDS[row].tolist(), SlotSettings(max_tokens=NEW, lora=name), on_output)
                jobs.append((row, name, done, tokens))
        want = {name: peft_reference(None if name is None else adapters[name])[0] for name in (*adapters, None)}
        for row, name, done, tokens in jobs:
            assert done.wait(300)
            assert tokens == want[name][row, IDS.shape[1]:].tolist(), (row, name)
    finally:
        eng.close()


# ---- tensor parallel, in the 8-device child ----

def test_in_8_device_subprocess():
    out = rerun_with_8_devices(__file__)
    assert "4 passed" in out, out[-3000:]


@needs8
@pytest.mark.parametrize("merge", [False, True], ids=["beside", "merged"])
def test_tensor_parallel_get_model_with_an_adapter_equals_peft(folder, adapters, merge):
    from opt_serving.model.wrapper import get_model
    m = get_model("alpa/small", folder, tensor_parallel=2, pipeline_parallel=1, lora=adapters["a0"],
                  merge_lora=merge)
    assert m.plan.tp == 2
    if not merge:  # the adapters split as their layers: q/k/v and fc1's B by output, out_proj and fc2's A by input
        w = m.stages.stages[0].lora.weights["layers_0"]
        assert tuple(w["self_attn"]["q_proj"]["b"].sharding.spec) == (None, None, "tp")
        assert tuple(w["fc2"]["a"].sharding.spec) == (None, "tp")
        assert len(w["fc1"]["b"].sharding.device_set) == 2
    check_model(m, adapters["a0"])


@needs8
def test_tensor_parallel_slots_serve_adapters_side_by_side(folder, adapters):
    from opt_serving.model.lora_config import LoraConfig
    from opt_serving.runner.load import load_slots
    from opt_serving.spec import ModelSpec
    spec = ModelSpec.parse("alpa/small", folder, tensor_parallel=2, pipeline_parallel=1)
    slots = load_slots(spec, "float32", num_slots=8, max_seq_len=32, prefix_caching=False,
                       lora=_options(LoraConfig(2, 16, ALL_TARGETS)))
    check_engine(slots, adapters)


@needs8
def test_int8_tensor_parallel_with_an_adapter_multiplies_the_dequantized_weights(folder, adapters, tmp_path):
    """A tensor-parallel group runs XLA's product on the int8 numbers and their scales: with an adapter, the float
    model on the dequantized weights with the same adapter."""
    from opt_serving.model import quantize, weights
    from opt_serving.model.wrapper import get_model
    cfg, arrays = weights.load_numpy_folder(folder)
    names = quantize.quantized_names(CFG)
    weights.save_numpy_folder(tmp_path, cfg, {k: quantize.dequantize_rows(*quantize.quantize_rows(v))
                                              if k in names else np.asarray(v) for k, v in arrays.items()})
    want = get_model("jax/small", tmp_path, lora=adapters["a1"])
    tp = get_model("alpa/small", folder, tensor_parallel=2, pipeline_parallel=1, quantize="int8", lora=adapters["a1"])
    np.testing.assert_allclose(np.asarray(tp(IDS)), np.asarray(want(IDS)), atol=1e-4, rtol=1e-4)


def _options(config):
    """LoraOptions sizing the slots as `config` says (the adapters are added by check_engine)."""
    from opt_serving.model.lora_config import LoraOptions
    return LoraOptions((), config.max_loras, config.max_lora_rank, config.targets)


# ---- pipeline, on a Ray this module starts ----

def test_pipeline_stages_each_hold_their_layers_adapters(ray_local, folder, adapters):
    """get_model on two stage actors, with the adapter beside the weights and merged, then the engine's slots over
    two stages serving both adapters and the base model."""
    from opt_serving.model.lora_config import LoraConfig
    from opt_serving.model.wrapper import get_model
    from opt_serving.runner.load import load_slots
    from opt_serving.spec import ModelSpec
    for merge in (False, True):
        m = get_model("alpa/small", folder, tensor_parallel=1, pipeline_parallel=2, lora=adapters["a1"],
                      merge_lora=merge)
        try:
            assert m.plan.pp == 2
            if not merge:
                layouts = m.stages.get([m.stages.call(i, "lora_layout") for i in range(2)])
                (a, b), (c, d) = [(x.start, x.stop) for x in layouts]  # each stage its own layers' share
                assert a == 0 and b == c and d == CFG.num_hidden_layers and 0 < b < d
            check_model(m, adapters["a1"])
        finally:
            m.close()
    spec = ModelSpec.parse("alpa/small", folder, tensor_parallel=1, pipeline_parallel=2)
    slots = load_slots(spec, "float32", num_slots=4, max_seq_len=32, prefix_caching=False,
                       lora=_options(LoraConfig(2, 16, ALL_TARGETS)))
    check_engine(slots, adapters)

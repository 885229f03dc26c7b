"""LoRA adapters through the slot runner (runner/lora.py, runner/slots.py, runner/stage.py) and the engine, and in
get_model(): greedy tokens equal PEFT's generate() for requests of two adapters and the base model sharing the
steps (joined, prefilled together, prefilled in chunks, several steps a call), the prefix cache never serving one
adapter's prefix to another, adapter slots reused least recently used first and never while a request holds
them, an adapter added after warm-up compiling nothing new."""
import threading

import numpy as np
import pytest
import torch

from opt_serving.engine.scheduler import Engine
from opt_serving.errors import NotFound, Overloaded
from opt_serving.model import weights
from opt_serving.model.lora_config import LoraConfig, LoraOptions
from opt_serving.model.wrapper import get_model
from opt_serving.runner.load import local_slots
from opt_serving.runner.lora import Adapters
from opt_serving.runner.types import SlotSettings
from opt_serving.testing.lora import write_adapter

from conftest import ALL_TARGETS, TINY, hf_model, peft_model, xla_compiles

pytestmark = pytest.mark.cpu_kernels  # on the CPU device wherever JAX runs (conftest.py)
CFG = TINY
NEW = 8


def peft_tokens(folder, prompt, new=NEW):
    """PEFT's greedy tokens after `prompt` (folder None: Hugging Face's model alone)."""
    model = hf_model(CFG) if folder is None else peft_model(CFG, folder)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             pad_token_id=1, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {"a0": write_adapter(d / "a0", CFG, ALL_TARGETS, rank=8, seed=0, std=0.05),
            "a1": write_adapter(d / "a1", CFG, ("q_proj", "v_proj", "fc2"), rank=4, seed=1, std=0.1),
            "a2": write_adapter(d / "a2", CFG, ("k_proj", "out_proj", "fc1"), rank=8, seed=2, std=0.05)}


@pytest.fixture(scope="module")
def engine(folders):
    """Two adapter slots over the tiny model, three adapters served, the prefix cache on, chunks of 16 tokens,
    four steps a call: every path a prompt can take."""
    params = weights.params_from_hf_state_dict(CFG, hf_model(CFG).state_dict())
    slots = local_slots(CFG, params, num_slots=4, max_seq_len=64, prefix_blocks=16,
                        lora=LoraConfig(2, 8, ALL_TARGETS))
    for name, folder in folders.items():
        slots.loras.add(name, folder)
    eng = Engine(slots, start=False, prefill_chunk=16, decode_steps=4, decode_call_s=3600)
    eng.warmup()
    eng.start()
    yield eng
    eng.close()


def submit(eng, prompt, lora):
    done, out = threading.Event(), {"tokens": [], "cached": None, "error": None}

    def on_output(o):
        out["tokens"] += [t.id for t in o.tokens]
        out["cached"] = o.cached_tokens if out["cached"] is None else out["cached"]
        if o.finish_reason:
            out["error"] = o.error
            done.set()
    eng.submit(prompt, SlotSettings(max_tokens=NEW, lora=lora), on_output)
    return done, out


def finished(job):
    done, out = job
    assert done.wait(300), "the request did not finish"
    assert out["error"] is None, out["error"]
    return out


def test_requests_of_adapters_and_the_base_model_get_pefts_tokens(engine, folders):
    """Short prompts (joining a step), a few at once (one prefill pass), long ones (in chunks), each with a0, a1
    or none, all in flight together: every request's tokens are PEFT's for its own adapter."""
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, CFG.vocab_size, n).tolist() for n in (4, 11, 30, 45)]
    jobs = [(p, name) for p in prompts for name in ("a0", None, "a1")]
    running = [submit(engine, p, name) for p, name in jobs]
    for (p, name), job in zip(jobs, running):
        assert finished(job)["tokens"] == peft_tokens(None if name is None else folders[name], p), (len(p), name)


def test_the_prefix_cache_never_serves_one_adapters_prefix_to_another(engine, folders):
    """One 40-token prompt, a0 twice, then a1 and the base model: the second a0 request reuses its cached blocks,
    the others compute theirs, and each gets PEFT's tokens for its own adapter."""
    prompt = np.random.RandomState(1).randint(3, CFG.vocab_size, 40).tolist()
    first = finished(submit(engine, prompt, "a0"))
    again = finished(submit(engine, prompt, "a0"))
    other = finished(submit(engine, prompt, "a1"))
    base = finished(submit(engine, prompt, None))
    assert first["cached"] == 0 and again["cached"] == 32 and other["cached"] == 0 and base["cached"] == 0
    for out, name in ((first, "a0"), (again, "a0"), (other, "a1"), (base, None)):
        assert out["tokens"] == peft_tokens(None if name is None else folders[name], prompt), name


def test_an_adapter_added_after_warm_up_compiles_nothing(engine, folders, tmp_path):
    """A third adapter into the least recently used slot, then unloaded: the steps' programs are the ones warm-up
    compiled (the write into a slot included), so running streams never wait for a compile."""
    prompt = [5, 9, 13, 17, 21]
    with xla_compiles() as asked:
        assert finished(submit(engine, prompt, "a2"))["tokens"] == peft_tokens(folders["a2"], prompt)
    assert asked == []
    engine.model.loras.add("late", write_adapter(tmp_path, CFG, ("fc1",), rank=2, seed=5))
    engine.model.loras.remove("late")
    with pytest.raises(NotFound):
        engine.model.loras.acquire("late")


def test_adapter_slots_are_reused_least_recently_used_first_never_while_held(folders):
    """The registry alone (no stages): two slots, three adapters."""
    layout = LoraConfig(2, 8, ALL_TARGETS).layout(0, CFG.num_hidden_layers, True, "float32")
    reg = Adapters(CFG, [layout])
    for name, folder in folders.items():
        reg.add(name, folder)
    with pytest.raises(ValueError, match="has already been loaded"):
        reg.add("a0", folders["a0"])
    s0, write0 = reg.acquire("a0")
    s1, write1 = reg.acquire("a1")
    assert {s0, s1} == {0, 1} and write0 is not None and write1 is not None
    assert reg.acquire("a0") == (s0, None)  # there already: nothing to write
    assert not reg.can_acquire("a2")
    with pytest.raises(Overloaded, match="all 2 LoRA adapter slots"):
        reg.acquire("a2")
    reg.release(s1)
    slot, write = reg.acquire("a2")  # a1's slot, the only one free
    assert slot == s1 and write is not None and reg.resident() == {"a0": s0, "a2": s1}
    reg.release(s0), reg.release(s0), reg.release(slot)
    assert reg.acquire("a1")[0] == s0  # a0's slot: used less recently than a2's
    reg.remove("a2")
    with pytest.raises(NotFound, match="does not exist"):
        reg.acquire("a2")
    assert reg.salt("a0") != reg.salt("a1") and reg.salt(None) == b""


def test_a_request_whose_adapter_finds_every_slot_held_is_refused_until_one_frees(folders):
    """One slot: a prefilled a0 request holds it; an a1 request is refused (Overloaded: HTTP 429) and does not
    join a step; once a0's request is freed, a1 takes the slot and gets PEFT's tokens."""
    params = weights.params_from_hf_state_dict(CFG, hf_model(CFG).state_dict())
    slots = local_slots(CFG, params, num_slots=2, max_seq_len=32, lora=LoraConfig(1, 8, ALL_TARGETS))
    slots.loras.add("a0", folders["a0"])
    slots.loras.add("a1", folders["a1"])
    prompt = [4, 8, 15, 16, 23, 42]
    held = slots.prefill(prompt, SlotSettings(lora="a0"))
    slots.insert(held, 0)
    assert not slots.joinable(prompt, SlotSettings(lora="a1"))
    with pytest.raises(Overloaded):
        slots.prefill(prompt, SlotSettings(lora="a1"))
    slots.free(0)
    prefix = slots.prefill(prompt, SlotSettings(lora="a1"))
    slots.insert(prefix, 1)
    tokens = [prefix.first.id] + [int(slots.step().tokens[1]) for _ in range(NEW - 1)]
    assert tokens == peft_tokens(folders["a1"], prompt)


@pytest.mark.parametrize("merge", [False, True], ids=["beside", "merged"])
def test_get_model_with_an_adapter_generates_pefts_tokens(tmp_path, folders, merge):
    """The notebook's model: greedy generate() and its full-sequence logits as PEFT's, with the adapter beside the
    base weights or merged into them."""
    hf = hf_model(CFG)
    weights.save_numpy_folder(tmp_path, CFG, weights.params_to_arrays(
        CFG, weights.params_from_hf_state_dict(CFG, hf.state_dict())))
    m = get_model("jax/tiny-finetune", tmp_path, lora=folders["a0"], merge_lora=merge)
    ids = np.random.RandomState(2).randint(3, CFG.vocab_size, (2, 9))
    ref = peft_model(CFG, folders["a0"], hf=hf)
    with torch.no_grad():
        want = ref.generate(input_ids=torch.tensor(ids), max_new_tokens=12, do_sample=False, pad_token_id=1,
                            eos_token_id=None).numpy()
        logits = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_array_equal(np.asarray(m.generate(ids, max_new_tokens=12, eos_token_id=None)), want)
    np.testing.assert_allclose(np.asarray(m(ids)), logits, atol=1e-4)
    beams = np.asarray(m.generate(ids, max_new_tokens=6, num_beams=3, eos_token_id=None))
    with torch.no_grad():
        want_beams = ref.generate(input_ids=torch.tensor(ids), max_new_tokens=6, num_beams=3, do_sample=False,
                                  pad_token_id=1, eos_token_id=None, early_stopping=False).numpy()
    np.testing.assert_array_equal(beams, want_beams)


def test_the_options_serve_their_modules_from_the_start(folders, tmp_path):
    """load_slots with LoraOptions: the modules served, the slots sized from them; an adapter of another model
    fails the load, naming itself."""
    from opt_serving.config import get_config
    from opt_serving.model.peft import AdapterError
    from opt_serving.runner.load import load_slots
    from opt_serving.spec import ModelSpec
    spec = ModelSpec.parse("jax/opt-tiny", dummy=True)
    mine = write_adapter(tmp_path / "x", get_config("opt-tiny"), ("q_proj", "v_proj", "fc2"), rank=4)
    slots = load_slots(spec, "float32", num_slots=2, max_seq_len=32, prefix_caching=False,
                       lora=LoraOptions((("x", str(mine)),)))
    try:
        assert slots.loras.names() == ["x"] and slots.loras.layouts[0].targets == ("q_proj", "v_proj", "fc2")
        assert slots.loras.slots == 1
    finally:
        slots.close()
    with pytest.raises(AdapterError, match="a1/adapter_model.safetensors: layer 0 fc2: .* do not fit"):
        load_slots(spec, "float32", num_slots=2, max_seq_len=32, prefix_caching=False,
                   lora=LoraOptions((("y", str(folders["a1"])),)))

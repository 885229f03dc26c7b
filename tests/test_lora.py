"""LoRA adapters (model/peft.py, model/lora.py): PEFT's files read without torch and refused clearly when they do
not fit, and the model's numbers with an adapter equal PEFT's on Hugging Face's model: every target, ranks 8 and
64, rsLoRA, q/k/v apart or fused, packed CPU products, int8 and bfloat16 base weights within their bounds; a batch
mixing adapters and the base model gives each row its own; merging gives the same numbers."""
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from opt_serving.backend import Backend
from opt_serving.backend.cpu import _lib, head
from opt_serving.model import kv_cache, layout, lora, opt, quantize, steps, weights
from opt_serving.model.lora_config import LoraConfig, LoraOptions, parse_module
from opt_serving.model.peft import AdapterError, read_peft, targets_of
from opt_serving.settings import Settings
from opt_serving.testing.lora import write_adapter, write_safetensors

from conftest import ALL_TARGETS, TINY, TINY_POST_LN, hf_model, on_cpu, peft_model

pytestmark = pytest.mark.cpu_kernels  # on the CPU device wherever JAX runs (conftest.py)
IDS = np.random.RandomState(0).randint(3, TINY.vocab_size, (3, 12)).astype(np.int32)


def reference_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def run(cfg, params, backend, stack, index, ids=IDS):
    """Full-sequence logits of the Flax model, rows using adapters `index` of `stack` (None: no LoRA at all)."""
    @jax.jit
    def f(params, stack, ids, index):
        cache = kv_cache.init_cache(cfg, ids.shape[0], ids.shape[1], kv_cache.cache_dtype(params, backend))
        with lora.applied(None if stack is None else lora.Lora(stack, index)):
            return steps.prefill_step(cfg, params, cache, ids, jnp.ones_like(ids), backend=backend)[0]
    return np.asarray(f(params, stack, jnp.asarray(ids), jnp.asarray(index, jnp.int32)))


def dequantized_hf(cfg, q8):
    """Hugging Face's model holding model/quantize.py's int8 weights dequantized (their numbers as float32)."""
    plain = {}
    for name, node in q8.items():
        plain[name] = jax.tree_util.tree_map(np.asarray, node)
    from opt_serving.backend.tree import dense_paths, fresh_at
    for path in list(dense_paths(plain, "qkernel")):
        if path == ("lm_head",):
            continue
        node = fresh_at(plain, path)
        node["kernel"] = node.pop("qkernel").astype(np.float32) * node.pop("scale")[None, :]
    plain.pop("lm_head")
    hf = hf_model(cfg)
    state = {weights.metaseq_key_to_hf(k): torch.from_numpy(np.array(v, np.float32))
             for k, v in weights.params_to_arrays(cfg, plain).items()}
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    return hf.eval()


def stacked(cfg, params, adapters, slots=None, rank=64, targets=ALL_TARGETS):
    """A stack of `slots` (default: one per adapter) holding the adapters in slots 0.., for `params`' layout."""
    layout_ = LoraConfig(slots or len(adapters), rank, targets).layout(0, cfg.num_hidden_layers, opt.is_fused(params),
                                                                      opt.param_dtype(params))
    stack = lora.stack(cfg, layout_)
    for i, a in enumerate(adapters):
        stack = lora.set_slot(stack, i, lora.slot_part(a, cfg, layout_))
    return stack


# ---- reading PEFT's format ----

def test_an_adapter_peft_saved_reads_as_peft_holds_it(tmp_path):
    """PEFT's own save_pretrained (B made non-zero): A, B and the scale as PEFT's modules hold them, rsLoRA's too."""
    import peft
    for rslora in (False, True):
        hf = hf_model(TINY)
        config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "fc2"], use_rslora=rslora,
                                 lora_dropout=0.0)
        pm = peft.get_peft_model(hf, config)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        pm.save_pretrained(tmp_path / str(rslora))
        a = read_peft(tmp_path / str(rslora), TINY)
        assert a.rank == 4 and a.targets == ("q_proj", "fc2") and sorted(a.layers) == [0, 1]
        module = pm.base_model.model.model.decoder.layers[1].fc2
        scale = 12 / (2.0 if rslora else 4)
        np.testing.assert_allclose(a.layers[1]["fc2"][0], module.lora_A["default"].weight.detach().numpy().T)
        np.testing.assert_allclose(a.layers[1]["fc2"][1],
                                   module.lora_B["default"].weight.detach().numpy().T * scale, rtol=1e-6)
        assert module.scaling["default"] == pytest.approx(scale)
        assert targets_of(tmp_path / str(rslora)) == ("q_proj", "fc2")


def test_a_bfloat16_adapter_reads_as_its_numbers(tmp_path):
    write_adapter(tmp_path, TINY, ("v_proj",), rank=2, dtype=ml_dtypes.bfloat16)
    a = read_peft(tmp_path, TINY)
    tensors = json.loads((tmp_path / "adapter_config.json").read_text())
    assert a.layers[0]["v_proj"][0].dtype == np.float32 and tensors["r"] == 2
    assert np.all(a.layers[0]["v_proj"][0] == a.layers[0]["v_proj"][0].astype(ml_dtypes.bfloat16).astype(np.float32))


def _corrupt(folder, what):
    """Write an adapter, then break it in one way (see test_malformed_adapters_are_refused_naming_the_problem)."""
    cfg = {"other_model": TINY.replace(hidden_size=64, ffn_dim=128)}.get(what, TINY)
    extra = {"dora": {"use_dora": True}, "bias": {"bias": "lora_only"}, "modules_to_save": {"modules_to_save": ["lm_head"]},
             "rank_pattern": {"rank_pattern": {"q_proj": 2}}, "not_lora": {"peft_type": "IA3"}}.get(what, {})
    write_adapter(folder, cfg, ("q_proj", "fc1"), rank=4, **extra)
    weights_file, config_file = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    if what == "no_weights":
        weights_file.unlink()
    elif what == "pickle_only":
        weights_file.rename(folder / "adapter_model.bin")
    elif what == "no_config":
        config_file.unlink()
    elif what == "truncated":
        weights_file.write_bytes(weights_file.read_bytes()[:-10])
    elif what == "rank_mismatch":
        config_file.write_text(config_file.read_text().replace('"r": 4', '"r": 8'))
    elif what in ("embedding_target", "missing_b", "layer_out_of_range"):
        key = {"embedding_target": "base_model.model.model.decoder.embed_tokens.lora_A.weight",
               "layer_out_of_range": "base_model.model.model.decoder.layers.7.fc1.lora_A.weight"}.get(what)
        from opt_serving.model.peft import read_safetensors
        tensors = dict(read_safetensors(weights_file.read_bytes(), weights_file))
        if what == "missing_b":
            del tensors["base_model.model.model.decoder.layers.1.fc1.lora_B.weight"]
        else:
            tensors[key] = np.zeros((4, 32), np.float32)
        write_safetensors(weights_file, tensors)


@pytest.mark.parametrize("what, message", [
    ("no_folder", "no such folder"), ("no_config", "no adapter_config.json"),
    ("no_weights", "no adapter_model.safetensors"), ("pickle_only", "is a pickle, which is not loaded"),
    ("truncated", "truncated"), ("dora", "DoRA"), ("bias", "trained biases"), ("modules_to_save", "modules_to_save"),
    ("rank_pattern", "rank_pattern"), ("not_lora", "only LoRA"), ("rank_mismatch", "says r = 8"),
    ("other_model", "do not fit the model's [32 in, 64 out] layer"), ("embedding_target", "not a LoRA weight of an OPT"),
    ("missing_b", "layer 1 fc1 has lora_B missing"), ("layer_out_of_range", "the model has 2 layers"),
])
def test_malformed_adapters_are_refused_naming_the_problem(tmp_path, what, message):
    folder = tmp_path / "adapter"
    if what != "no_folder":
        _corrupt(folder, what)
    with pytest.raises(AdapterError, match=re.escape(message)) as e:
        read_peft(folder, TINY)
    assert str(folder) in str(e.value)


def test_an_adapter_that_does_not_fit_the_slots_is_refused(tmp_path):
    write_adapter(tmp_path / "big", TINY, ("q_proj", "fc1"), rank=32)
    layout_ = LoraConfig(2, 16, ("q_proj", "v_proj")).layout(0, 2, False, "float32")
    a = read_peft(tmp_path / "big", TINY)
    with pytest.raises(AdapterError, match="rank 32 is above the largest rank the server holds, 16"):
        layout_.check(a)
    with pytest.raises(AdapterError, match="targets fc1, which this server's adapters do not cover"):
        LoraConfig(2, 32, ("q_proj",)).layout(0, 2, False, "float32").check(a)


def test_the_options_size_the_slots_from_the_adapters(tmp_path):
    a = write_adapter(tmp_path / "a", TINY, ("q_proj", "v_proj"))
    b = write_adapter(tmp_path / "b", TINY, ("fc2",))
    assert parse_module(f"x={a}") == ("x", str(a))
    assert parse_module(json.dumps({"name": "y", "path": str(b)})) == ("y", str(b))
    with pytest.raises(ValueError, match="give name=path"):
        parse_module("just-a-path")
    config = LoraOptions((("x", str(a)), ("y", str(b)))).config()
    assert config == LoraConfig(2, 16, ("q_proj", "v_proj", "fc2"))
    assert LoraOptions().config() == LoraConfig(1, 16, ALL_TARGETS)


# ---- the numbers ----

@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("where", ["split", "fused", "packed"])
@pytest.mark.parametrize("cfg", [TINY, TINY_POST_LN], ids=["pre_ln", "post_ln_350m"])
def test_logits_with_an_adapter_equal_pefts(tmp_path, cfg, where, rank):
    """Every target, a rank below the slots' and one filling them; q/k/v apart, fused, and packed for the CPU
    kernels: PEFT's logits within the project's HF parity bound, and clearly not the base model's."""
    folder = write_adapter(tmp_path, cfg, ALL_TARGETS, rank=rank, alpha=2 * rank, std=0.1)
    hf = hf_model(cfg)
    params = weights.params_from_hf_state_dict(cfg, hf.state_dict())
    base_ref = reference_logits(hf)
    want = reference_logits(peft_model(cfg, folder, hf=hf))
    backend = Backend.xla()
    if where == "fused":
        params = layout.fuse_qkv(params)
    elif where == "packed":
        backend, params = layout.runtime_params(on_cpu(params))
        if not backend.products:
            pytest.skip("opt_serving/_cpu_kernels.so not built")
    stack = stacked(cfg, params, [read_peft(folder, cfg)], slots=2)
    got = run(cfg, params, backend, stack, [0, 0, 0])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(want - base_ref).max() > 30 * 1e-4  # the adapter moves the logits well past the bound
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_a_batch_mixing_adapters_gives_each_row_its_own(tmp_path):
    """Rows of two adapters and of the base model in one pass, per row (a few rows: gathered) and per token (many:
    every slot masked): each row's logits are what it gets alone, and the base row the model's without LoRA (to
    float rounding: fc1's ReLU is no longer fused into its product)."""
    cfg = TINY
    folders = [write_adapter(tmp_path / str(i), cfg, ALL_TARGETS, rank=4 + 4 * i, seed=i, std=0.05) for i in range(2)]
    params = layout.fuse_qkv(weights.params_from_hf_state_dict(cfg, hf_model(cfg).state_dict()))
    stack = stacked(cfg, params, [read_peft(f, cfg) for f in folders], slots=3, rank=8)
    backend = Backend.xla()
    ids = np.concatenate([IDS, IDS[:1]])  # four rows, the first and last the same tokens
    index = [1, -1, 0, 0]
    mixed = run(cfg, params, backend, stack, index, ids)
    per_token = run(cfg, params, backend, stack, np.repeat(np.array(index)[:, None], ids.shape[1], 1), ids)
    base = run(cfg, params, backend, None, [0] * 4, ids)
    for row, a in enumerate(index):
        alone = run(cfg, params, backend, stack, [a], ids[row:row + 1])[0]
        np.testing.assert_allclose(mixed[row], alone, atol=1e-5)
        np.testing.assert_allclose(per_token[row], alone, atol=1e-5)
    np.testing.assert_allclose(mixed[1], base[1], atol=1e-6)  # zeros added: the base model's numbers
    assert np.abs(mixed[0] - mixed[3]).max() > 1e-2  # same tokens, other adapters


def test_an_empty_slot_and_a_smaller_target_set_give_the_base_model(tmp_path):
    """A slot nothing was written to, and an adapter on q/v run by a server holding every target: the modules
    an adapter does not target add nothing."""
    cfg = TINY
    folder = write_adapter(tmp_path, cfg, ("q_proj", "v_proj"), rank=4, std=0.05)
    hf = hf_model(cfg)
    params = weights.params_from_hf_state_dict(cfg, hf.state_dict())
    want = reference_logits(peft_model(cfg, folder, hf=hf))
    stack = stacked(cfg, params, [read_peft(folder, cfg)], slots=2, rank=8)
    got = run(cfg, params, Backend.xla(), stack, [0, 1, 0])
    np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], atol=1e-4)
    np.testing.assert_allclose(got[1], run(cfg, params, Backend.xla(), None, [0, 0, 0])[1], atol=1e-6)


@pytest.mark.parametrize("fmt", ["int8-xla", "int8-packed", "bfloat16-params", "bfloat16-products"])
def test_low_precision_base_weights_with_an_adapter_within_their_bounds(tmp_path, fmt):
    """int8 base weights: exactly PEFT's numbers on the dequantized weights (XLA multiplies them as they are), or
    the packed int8 products' own bound; bfloat16: the bounds test_quantize.py and test_opt.py hold the base
    model to, against PEFT in float32."""
    cfg = TINY
    hf = hf_model(cfg)
    with torch.no_grad():  # peaked outputs, as test_quantize.py's: top-1 agreement is meaningful
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    p32 = weights.params_from_hf_state_dict(cfg, hf.state_dict())
    folder = write_adapter(tmp_path, cfg, ALL_TARGETS, rank=8, std=0.1)
    adapter = read_peft(folder, cfg)
    p16 = weights.params_from_hf_state_dict(cfg, hf.state_dict(), dtype="bfloat16")
    want = reference_logits(peft_model(cfg, folder, hf=hf))  # (PEFT wraps `hf` itself)
    if fmt.startswith("int8"):
        q8 = quantize.quantize_params(p32)
        backend, params = layout.runtime_params(q8, Settings(kernels=fmt == "int8-packed"), weights="int8")
        if fmt == "int8-packed" and not backend.products:
            pytest.skip("opt_serving/_cpu_kernels.so not built")
    elif fmt == "bfloat16-params":
        backend, params = Backend.xla(), p16
    else:
        if _lib.load() is None or not head.supported():
            pytest.skip("no native bfloat16 products on this CPU (or no kernels)")
        backend, params = layout.runtime_params(on_cpu(p32), weights="bfloat16")
    stack = stacked(cfg, params, [adapter], slots=1, rank=8)
    got = run(cfg, params, backend, stack, [0, 0, 0])
    if fmt == "int8-xla":  # XLA multiplies by the dequantized weights: PEFT's numbers on those
        deq = peft_model(cfg, folder, hf=dequantized_hf(cfg, q8))
        np.testing.assert_allclose(got, reference_logits(deq), atol=2e-3)
    err, agree = np.abs(got - want).max() / np.abs(want).max(), (got.argmax(-1) == want.argmax(-1)).mean()
    bound = {"int8-xla": (0.06, 0.94), "int8-packed": (0.06, 0.94), "bfloat16-params": (0.05, 0.9),
             "bfloat16-products": (0.03, 0.96)}[fmt]
    assert err < bound[0] and agree >= bound[1], (err, agree)
    base = run(cfg, params, backend, None, [0, 0, 0])
    assert np.abs(base - want).max() / np.abs(want).max() > 2 * err  # the adapter is what brings it within


def test_merging_gives_pefts_numbers(tmp_path):
    """An adapter merged into float32 weights: PEFT's logits; into int8 ones (dequantized, merged, quantized again):
    within int8's bound of them, and the unmerged adapter's numbers on the same int8 base close by."""
    cfg = TINY
    folder = write_adapter(tmp_path, cfg, ALL_TARGETS, rank=8, std=0.1)
    hf = hf_model(cfg)
    p32 = weights.params_from_hf_state_dict(cfg, hf.state_dict())
    adapter = read_peft(folder, cfg)
    want = reference_logits(peft_model(cfg, folder, hf=hf))
    np.testing.assert_allclose(np.asarray(steps.forward(cfg, lora.merge(p32, adapter), IDS)), want, atol=1e-4)
    merged8 = lora.merge(quantize.quantize_params(p32), adapter)
    assert merged8["layers_0"]["fc1"]["qkernel"].dtype == np.int8
    backend, params = layout.runtime_params(merged8, Settings(kernels=False), weights="int8")
    got = np.asarray(steps.forward(cfg, params, IDS, backend=backend))
    assert np.abs(got - want).max() / np.abs(want).max() < 0.06

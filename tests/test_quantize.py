"""int8 weights (model/quantize.py) and bfloat16 products against float32 on the same weights: logits within
their measured bounds on pre-LN and 350m-style models with peaked outputs, greedy tokens equal across
generate(), the engine and the OpenAI route, and the quantized numpy folder's round trip."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from opt_serving.settings import Settings
from opt_serving.backend.cpu import _lib, head, products
from opt_serving.model import kv_cache, layout, quantize, weights
from opt_serving.model.wrapper import OPTModel, get_model
from opt_serving.testing import checkpoints

from conftest import TINY as PRE_LN, TINY_POST_LN as POST_LN, hf_model

pytestmark = pytest.mark.cpu_kernels  # on the CPU device wherever JAX runs (conftest.py)

needs_kernels = pytest.mark.skipif(_lib.load() is None, reason="opt_serving/_cpu_kernels.so not built")


def peaked_params(cfg):
    """HF's random init with every matrix x8: next-token distributions peaked as a trained model's, so the
    argmax is not a near-tie (the bfloat16 comparison in benchmark/README.md does the same)."""
    hf = hf_model(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return weights.params_from_hf_state_dict(cfg, hf.state_dict())


def compare(ref, got):
    """(largest logit error relative to the largest logit, top-1 agreement)."""
    return np.abs(got - ref).max() / np.abs(ref).max(), (got.argmax(-1) == ref.argmax(-1)).mean()


def test_rows_are_quantized_symmetrically_per_output_channel():
    w = np.random.default_rng(0).standard_normal((6, 40)).astype(np.float32)
    w[2] = 0  # an all-zero channel keeps scale 1 and zeros
    q, scale = quantize.quantize_rows(w)
    assert q.dtype == np.int8 and scale.shape == (6,)
    assert np.all(np.abs(q[[0, 1, 3, 4, 5]]).max(1) == 127) and np.all(q[2] == 0) and scale[2] == 1
    assert np.abs(quantize.dequantize_rows(q, scale) - w).max() <= scale.max() / 2 + 1e-7
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize.quantize_rows(np.array([[1.0, np.nan]], np.float32))


def test_rows_in_blocks_on_threads_are_the_whole_matrixs_numbers(monkeypatch):
    """Blocks of rows quantized on the pool's threads: the same numbers as the matrix quantized at once, and a
    bad value in any block (the last one here) named."""
    from opt_serving.model.sources import Drawn, tensor_key
    w = (np.random.default_rng(1).standard_normal((203, 48)) * 0.02).astype(np.float16)
    monkeypatch.setattr(quantize, "_ELEMENTS_PER_BLOCK", 48 * 10)  # 21 blocks of 10 rows, the last of 3
    q, scale = quantize.quantize_rows(w)
    w32 = w.astype(np.float32)
    want_scale = (np.abs(w32).max(1) / np.float32(127.0)).astype(np.float32)
    assert np.array_equal(scale, want_scale)
    assert np.array_equal(q, np.clip(np.rint(w32 / want_scale[:, None]), -127, 127).astype(np.int8))
    drawn = Drawn(tensor_key(3, "w"), (203, 48), 0.02)  # drawn a block at a time, as a stage draws its weights
    assert all(np.array_equal(a, b) for a, b in zip(quantize.quantize_rows(drawn), quantize.quantize_rows(drawn[:])))
    w32[201, 5] = np.inf
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize.quantize_rows(w32)


@pytest.mark.parametrize("cfg", [PRE_LN, POST_LN], ids=["pre_ln", "post_ln_350m"])
@pytest.mark.parametrize("kernels", [True, False], ids=["packed", "xla"])
def test_int8_logits_within_their_measured_bound(cfg, kernels):
    if kernels and _lib.load() is None:
        pytest.skip("opt_serving/_cpu_kernels.so not built")
    p32 = peaked_params(cfg)
    seq = np.random.RandomState(3).randint(3, cfg.vocab_size, (8, 32)).astype(np.int32)
    ref = np.asarray(OPTModel(cfg, p32)(seq))
    backend, params = layout.runtime_params(quantize.quantize_params(p32), Settings(kernels=kernels),
                                            weights="int8")
    assert backend.weights == "int8" and backend.products == kernels
    err, agree = compare(ref, np.asarray(OPTModel(cfg, params, backend=backend)(seq)))
    # measured: 1.8-3.2% and 97-99.6% top-1 (benchmark/README.md has the 125m-shaped figures)
    assert err < 0.06 and agree >= 0.94, (err, agree)


@needs_kernels
@pytest.mark.skipif(not head.supported(), reason="no native bfloat16 products on this CPU")
@pytest.mark.parametrize("cfg", [PRE_LN, POST_LN], ids=["pre_ln", "post_ln_350m"])
def test_bfloat16_products_within_their_measured_bound(cfg):
    p32 = peaked_params(cfg)
    seq = np.random.RandomState(3).randint(3, cfg.vocab_size, (8, 32)).astype(np.int32)
    ref = np.asarray(OPTModel(cfg, p32)(seq))
    m = OPTModel(cfg, p32, weights="bfloat16")
    assert m.backend.products and m.backend.weights == "bfloat16" and m.dtype == np.float32
    err, agree = compare(ref, np.asarray(m(seq)))
    assert err < 0.03 and agree >= 0.96, (err, agree)  # measured: 0.5-1.0%, 98.8-100%


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_decode_steps_read_a_bfloat16_cache_within_the_formats_bound(fmt):
    """bfloat16 and int8 weights keep the KV cache in bfloat16 (as its bits, uint16); teacher-forced decode
    steps read it back. Their logits stay within the format's bound of the float32 model's."""
    if fmt == "bfloat16" and not head.supported():
        pytest.skip("no native bfloat16 products on this CPU")
    cfg = PRE_LN
    p32 = peaked_params(cfg)
    seq = np.random.RandomState(4).randint(3, cfg.vocab_size, (4, 24)).astype(np.int32)
    ref = np.asarray(OPTModel(cfg, p32)(seq))  # [B, S, V]
    if fmt == "int8":
        backend, params = layout.runtime_params(quantize.quantize_params(p32), Settings(), weights="int8")
        m = OPTModel(cfg, params, backend=backend)
    else:
        m = OPTModel(cfg, p32, weights="bfloat16")
    assert m.backend.attention and kv_cache.cache_dtype(m.fused_params, m.backend) == kv_cache.BF16_BITS
    cache = m.init_cache(4, 24)
    assert cache["k"][0].dtype == np.uint16
    first, cache = m.prefill(cache, seq[:, :8], np.ones((4, 8), np.int32))
    steps = [np.asarray(first)[:, -1]]
    for t in range(8, 23):  # each token at its position, read back from the cache by the next
        logits, cache = m.decode(cache, seq[:, t], np.full(4, t, np.int32), np.full(4, t, np.int32))
        steps.append(np.asarray(logits))
    err, agree = compare(ref[:, 7:23], np.stack(steps, 1))
    # the formats' bounds above, cache included; int8 products' 7-bit rows (a CPU without VNNI: 0.9375 measured on
    # this test, one token of 64 more flipped) carry twice the rounding of int8 rows
    bound = (0.03, 0.96) if fmt == "bfloat16" else (0.06, 0.94) if products.int8_row_levels() == 127 else (0.06, 0.92)
    assert err < bound[0] and agree >= bound[1], (err, agree)
    k = kv_cache.from_cache(cache["k"][0], np.float32)  # what was written: bfloat16 numbers, entries 0..22
    assert np.all(np.isfinite(np.asarray(k))) and np.asarray(cache["mask"])[:, :23].all()


@needs_kernels
def test_get_model_bfloat16_on_this_cpu_keeps_float32_activations():
    m = get_model("jax/opt-125m", dummy=True, dtype="bfloat16") if head.supported() else None
    if m is None:
        pytest.skip("no native bfloat16 products on this CPU")
    assert m.backend.weights == "bfloat16" and m.dtype == np.float32


@pytest.fixture(scope="module")
def int8_folders(tmp_path_factory):
    """A random HF OPT converted twice by the CLI: float32, and --quantize int8."""
    d = tmp_path_factory.mktemp("quantized")
    cfg = checkpoints.tiny_config(vocab=200)
    checkpoints.write_hf(d / "hf", checkpoints.random_hf_model(cfg, dtype=torch.float32))
    for out, extra in (("f32", []), ("q8", ["--quantize", "int8"])):
        subprocess.run([sys.executable, "-m", "opt_serving", "convert", "--input", str(d / "hf"), "--output",
                        str(d / out), "--dtype", "float32", "--no-progress", *extra], check=True,
                       capture_output=True)
    return cfg, d


def test_a_quantized_folder_round_trips(int8_folders):
    cfg, d = int8_folders
    assert quantize.folder_quantization(d / "q8") == "int8" and quantize.folder_quantization(d / "f32") is None
    fc1 = d / "q8" / "decoder.layers.0.fc1.weight"
    assert weights.load_array(fc1).dtype == np.int8
    assert fc1.stat().st_size < (d / "f32" / "decoder.layers.0.fc1.weight").stat().st_size / 3
    at_load, from_disk = quantize.load_params(d / "f32", cfg), quantize.load_params(d / "q8", cfg)
    import jax
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_leaves_with_path(at_load),
                                jax.tree_util.tree_leaves_with_path(from_disk)):
        assert pa == pb and a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), pa
    ids = np.array([[5, 9, 17, 33, 60]], np.int32)
    m1, m2 = (get_model("jax/t", d / n, quantize="int8") for n in ("f32", "q8"))
    np.testing.assert_array_equal(np.asarray(m1(ids)), np.asarray(m2(ids)))


def test_a_quantized_folder_says_how_to_load_it(int8_folders):
    _, d = int8_folders
    with pytest.raises(ValueError, match="quantize='int8'"):
        get_model("jax/t", d / "q8")
    (d / "q8" / quantize.MARKER).write_text(json.dumps({"weights": "int4"}))
    try:
        with pytest.raises(ValueError, match="int4"):
            quantize.folder_quantization(d / "q8")
    finally:
        quantize.write_marker(d / "q8")


def test_quantize_choices_are_checked():
    with pytest.raises(ValueError, match="int8"):
        get_model("jax/opt-tiny", dummy=True, quantize="int4")
    with pytest.raises(ValueError, match="jax/ and alpa/"):
        get_model("facebook/opt-tiny", dummy=True, quantize="int8")
    with pytest.raises(ValueError, match="float32 activations"):
        get_model("alpa/opt-tiny", dummy=True, quantize="int8", dtype="bfloat16")


@pytest.mark.slow
def test_int8_greedy_tokens_agree_across_generate_the_engine_and_the_openai_route():
    openai = pytest.importorskip("openai")
    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.text.generator import SamplingParams
    from opt_serving.text.loading import load_generator
    from opt_serving.service.app import create_app
    from opt_serving.service.testserver import serve_in_thread
    path = ensure_embedded_model()
    model = get_model("jax/opt-tiny", path, quantize="int8")
    assert model.backend.weights == "int8"
    g = load_generator("jax/opt-tiny", str(path), max_batch_size=4, max_seq_len=64, quantize="int8")
    try:
        with serve_in_thread(create_app(g)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=120)
            for prompt in ["Hello world", "The quick brown fox jumps"]:
                ids = g.encode(prompt)
                out = model.generate(input_ids=np.asarray([ids], np.int32), max_new_tokens=10,
                                     min_new_tokens=10, do_sample=False)
                offline = np.asarray(out)[0][len(ids):].tolist()
                [engine] = g.complete_many([prompt], SamplingParams(max_tokens=10, temperature=0,
                                                                    ignore_eos=True))[0]
                assert engine.token_ids == offline
                r = client.completions.create(model="jax/opt-tiny", prompt=prompt, max_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True})
                assert r.choices[0].text == g.decode(offline)
    finally:
        g.close()

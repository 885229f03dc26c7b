"""get_model() and generate(): token-identical to Hugging Face generate(), clear errors."""
import importlib.util

import numpy as np
import pytest
import torch
import transformers

from opt_serving.config import get_config
from opt_serving.model import sample, weights, wrapper
from opt_serving.runner.generate import Generation

from conftest import TINY, on_cpu

CFG = TINY
NEW = 10


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    hf = transformers.OPTForCausalLM(transformers.OPTConfig(**CFG.to_hf_dict())).eval()
    with torch.no_grad():  # peaked distributions: greedy choices are far from ties
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    ours = Generation.of(wrapper.OPTModel(CFG, weights.params_from_hf_state_dict(CFG, hf.state_dict())))
    rng = np.random.RandomState(0)
    ids = rng.randint(3, CFG.vocab_size, (3, 7))
    mask = np.ones_like(ids)
    mask[1, :2] = mask[2, :5] = 0  # mixed prompt lengths, left padded
    ids[mask == 0] = CFG.pad_token_id
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    with torch.no_grad():
        plain = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            eos_token_id=None)
    # an EOS the model really emits mid-generation, so finishing and pad filling are exercised
    eos = int(plain[0, 7 + 3])
    # bad words the model would otherwise produce: a single token and a bigram
    bad = [[int(plain[1, 7])], [int(plain[2, 8]), int(plain[2, 9])]]
    return hf, ours, ids, mask, eos, bad


CASES = {
    "greedy": {},
    "beam": dict(num_beams=4, num_return_sequences=2),
    "repetition_penalty": dict(repetition_penalty=1.5),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2),
    "bad_words": dict(bad_words_ids="from the greedy output"),
    "min_new_tokens": dict(min_new_tokens=6),
    "min_length": dict(min_length=14),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_hf(models, case):
    hf, ours, ids, mask, eos, bad = models
    kw = dict(CASES[case], max_new_tokens=NEW, eos_token_id=eos)
    if case == "bad_words":
        kw["bad_words_ids"] = bad
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, **kw)
    out = ours.generate(ids, attention_mask=mask, **kw)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), ref.numpy())
    if case != "greedy":  # the setting changed the output, so the comparison tested it
        with torch.no_grad():
            base = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                               eos_token_id=eos)
        assert base.shape != ref.shape or not torch.equal(base, ref)


def test_a_beam_search_stops_before_the_step_after_should_stop_says_so(models):
    """`should_stop` is asked before every step of the on-device loop (a host callback): the search ends
    with SearchStopped at the first True, however many steps were left; one that never says stop gives
    HF's beams exactly (the callback changes nothing else)."""
    from opt_serving.model.beam_search import SearchStopped
    _, ours, ids, mask, eos, _ = models
    asked = []

    def should_stop():  # says stop from its fourth question on
        asked.append(len(asked) >= 3)
        return asked[-1]
    kw = dict(CASES["beam"], max_new_tokens=NEW, eos_token_id=eos)
    with pytest.raises(SearchStopped):
        ours.generate(ids.numpy(), attention_mask=mask.numpy(), should_stop=should_stop, **kw)
    # asked before steps 1, 2, 3 and 4: the 4th said stop, then once more after the loop; no step ran after it
    assert asked == [False, False, False, True, True] and NEW > 4
    out = ours.generate(ids.numpy(), attention_mask=mask.numpy(), should_stop=lambda: False, **kw)
    np.testing.assert_array_equal(out, ours.generate(ids.numpy(), attention_mask=mask.numpy(), **kw))


def test_eos_finishes_rows_and_fills_pad(models):
    _, ours, ids, mask, eos, _ = models
    out = ours.generate(ids.numpy(), attention_mask=mask.numpy(), max_new_tokens=NEW, eos_token_id=eos)
    assert isinstance(out, np.ndarray)
    gen = out[0, 7:]
    first = int(np.argmax(gen == eos))
    assert gen[first] == eos and (gen[first + 1:] == CFG.pad_token_id).all()


def test_scores_and_return_dict(models):
    hf, ours, ids, mask, eos, _ = models
    kw = dict(max_new_tokens=4, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, repetition_penalty=1.3, **kw)
    out = ours.generate(ids, attention_mask=mask, repetition_penalty=1.3, **kw)
    assert torch.equal(out.sequences, ref.sequences) and len(out.scores) == len(ref.scores) == 4
    for a, b in zip(out.scores, ref.scores):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-4)


def test_seeded_sampling_is_reproducible(models):
    _, ours, ids, mask, _, _ = models
    # the same shapes as greedy: sampling settings are arrays, so this reuses its compiled loop
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0, eos_token_id=None)
    a = ours.generate(ids, seed=7, **kw)
    assert a.shape == (3, 7 + NEW)
    assert torch.equal(a, ours.generate(ids, seed=7, **kw))
    assert not torch.equal(a, ours.generate(ids, seed=8, **kw))


def test_bad_input(models):
    _, ours, ids, mask, _, _ = models
    with pytest.raises(ValueError, match="exceeds the model's limit of 64 positions"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=60)
    with pytest.raises(ValueError, match="input_ids must lie in"):
        ours.generate(np.array([[5, CFG.vocab_size]]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        ours.generate(ids, attention_mask=mask[:, :3])
    with pytest.raises(TypeError, match="unsupported arguments.*typical_p"):
        ours.generate(ids, typical_p=0.5)


def test_get_model_names():
    with pytest.raises(ValueError, match="unknown OPT model 'jax/opt-3b'"):
        wrapper.get_model("jax/opt-3b", dummy=True)
    with pytest.raises(ValueError, match="must start with one of"):
        wrapper.get_model("gpt2/opt-125m", dummy=True)
    with pytest.raises(ValueError, match="give path="):
        wrapper.get_model("jax/opt-125m")
    if importlib.util.find_spec("opt_serving.parallel.backend") is None:
        with pytest.raises(NotImplementedError, match="alpa/ backend"):
            wrapper.get_model("alpa/opt-125m", dummy=True)


def test_dummy_model_has_the_named_shapes():
    # float16 on a CPU: params in the dtype asked for (bfloat16 may run as float32 params with bfloat16
    # products: test_quantize.py)
    model = wrapper.get_model("jax/opt-tiny", dummy=True, dtype="float16")
    assert model.config == get_config("opt-tiny")
    emb = model.params["embed_tokens"]["embedding"]
    assert emb.shape == (model.config.vocab_size, model.config.word_embed_proj_dim)
    assert emb.dtype == np.dtype("float16") and 0.015 < float(np.asarray(emb, np.float32).std()) < 0.025


def test_nearby_lengths_share_one_compiled_loop(models):
    hf, ours, ids, mask, eos, _ = models
    ours.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos)
    compiled = sample.search._cache_size()
    longer, longer_mask = ids[:, 1:], mask[:, 1:]  # 6 tokens: the same 8-wide bucket as 7
    out = ours.generate(longer, attention_mask=longer_mask, max_new_tokens=NEW + 3, eos_token_id=eos)
    assert sample.search._cache_size() == compiled
    with torch.no_grad():
        ref = hf.generate(longer, attention_mask=longer_mask, max_new_tokens=NEW + 3, do_sample=False,
                          eos_token_id=eos)
    np.testing.assert_array_equal(out.numpy(), ref.numpy())


def test_decode_windows():
    assert sample.decode_windows(8, 72) == [16, 32, 64, 72]
    assert sample.decode_windows(16, 24) == [24]          # the prompt's first decode entry is 16
    assert sample.decode_windows(40, 104) == [64, 104]


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "plain_xla"])
def test_long_generation_matches_hf(models, kernels, monkeypatch):
    # 8 prompt positions + 40 new. With the CPU kernels the cache is full-size and attention reads the
    # entries written so far; without them the cache grows 16 -> 32 -> 64 -> 72 during the loop.
    from opt_serving.backend import Backend
    from opt_serving.backend.cpu import _lib, head
    hf, ours, ids, mask, _, _ = models
    if not kernels:
        monkeypatch.setenv("OPT_SERVING_ONEDNN", "0")
        ours = Generation.of(wrapper.OPTModel(CFG, ours.params))
        assert ours.model.backend == Backend.xla() and "kernel" in ours.model.fused_params["layers_0"]["fc1"]
    elif _lib.load() is None:
        pytest.skip("opt_serving/_cpu_kernels.so not built")
    else:  # greedy steps take the screened argmax where this CPU has it, never making the logits
        ours = Generation.of(wrapper.OPTModel(CFG, on_cpu(ours.params)))  # the kernels' device, wherever JAX's is
        backend = ours.model.backend
        assert backend.products and backend.attention and backend.greedy_head == head.supported()
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=None)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None)
    np.testing.assert_array_equal(out.numpy(), ref.numpy())


def test_any_name_works_with_a_folder_that_has_a_config(tmp_path):
    """The folder's config.json wins; the name is only a label (a fine-tune, OPT-IML, ...)."""
    from opt_serving.model import param_tree
    params = param_tree.init_params(CFG, seed=2)
    weights.save_numpy_folder(tmp_path, CFG, weights.params_to_arrays(CFG, params))
    for name in ("jax/my-finetune", "jax/opt-iml-max-1.3b"):
        m = wrapper.get_model(name, path=tmp_path)
        assert m.config == CFG
        ids = np.array([[2, 5, 9]])
        ref = Generation.of(wrapper.OPTModel(CFG, params))
        np.testing.assert_array_equal(np.asarray(m.generate(ids, max_new_tokens=4)),
                                      np.asarray(ref.generate(ids, max_new_tokens=4)))
    with pytest.raises(ValueError, match="any name works with a folder that has a config.json, and .*nowhere has none"):
        wrapper.get_model("jax/my-finetune", path=tmp_path / "nowhere")


def test_a_keyword_the_model_does_not_use_is_refused_naming_it():
    """A misspelt option is not dropped (the model loaded would not be the one asked for): refused before any
    loading, naming each unknown keyword, the option it resembles, and the planner's options as alpa/'s only."""
    with pytest.raises(TypeError) as e:
        wrapper.get_model("jax/opt-tiny", "/nonexistent", tensor_paralel=2, foo=1)
    msg = str(e.value)
    assert "'tensor_paralel' (did you mean 'tensor_parallel'?)" in msg and "'foo'" in msg
    with pytest.raises(TypeError, match="'device_memory'.*the planner's options, for alpa/ models only"):
        wrapper.get_model("jax/opt-tiny", "/nonexistent", device_memory="1GB")
    with pytest.raises(TypeError, match="'batch_sise' \\(did you mean 'batch_size'\\?\\)"):
        wrapper.get_model("alpa/opt-tiny", dummy=True, batch_sise=2)

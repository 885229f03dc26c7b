"""Batched processors and samplers with per-row settings, checked against HF's processors."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as lp

from opt_serving.backend import sampling

V = 40


def _hf(processors, ids, scores):
    out = torch.tensor(scores)
    for p in processors:
        out = p(torch.tensor(ids, dtype=torch.long), out)
    return out.numpy()


def _case(seed=0):
    rng = np.random.RandomState(seed)
    # two rows, left padding on row 1 (pad=1), repeated tokens so n-grams repeat
    ids = np.array([[5, 6, 7, 5, 6, 9, 5, 6],
                    [1, 1, 1, 8, 3, 8, 3, 8]], np.int32)
    mask = (np.arange(8)[None] >= np.array([[0], [3]])).astype(np.int32)
    logits = rng.randn(2, V).astype(np.float32) * 2
    return ids, mask, logits


def _state(ids, mask, generated=0):
    """State as generate() builds it: the last `generated` tokens count as generated."""
    st = sampling.init_state(ids[:, :ids.shape[1] - generated], mask[:, :ids.shape[1] - generated],
                             V, 16)
    for t in range(ids.shape[1] - generated, ids.shape[1]):
        st = sampling.update_state(st, jnp.asarray(ids[:, t]))
    return st


def test_processors_match_hf_per_row():
    ids, mask, logits = _case()
    state = _state(ids, mask, generated=2)
    rows = [dict(repetition_penalty=1.5, no_repeat_ngram_size=2, bad_words_ids=[[9], [3, 8], [6, 7]],
                 min_length=10, eos_token_id=2),
            dict(repetition_penalty=0.7, no_repeat_ngram_size=3, bad_words_ids=[[2]], min_new_tokens=3,
                 eos_token_id=2)]
    # per-row settings in one call (bad words given per row)
    st = sampling.make_settings(
        2, repetition_penalty=[1.5, 0.7], no_repeat_ngram_size=[2, 3], min_length=[10, 0],
        min_new_tokens=[0, 3], eos_token_id=2, bad_words_ids=[rows[0]["bad_words_ids"], rows[1]["bad_words_ids"]])
    ours = np.asarray(sampling.process_logits(jnp.asarray(logits), state, st))
    for r, kw in enumerate(rows):
        procs = [lp.RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"],
                                                     prompt_ignore_length=torch.tensor([int(np.argmax(mask[r]))])),
                 lp.NoRepeatNGramLogitsProcessor(kw["no_repeat_ngram_size"]),
                 lp.NoBadWordsLogitsProcessor(kw["bad_words_ids"], eos_token_id=2)]
        if kw.get("min_length"):
            procs.append(lp.MinLengthLogitsProcessor(kw["min_length"], 2))
        if kw.get("min_new_tokens"):
            procs.append(lp.MinNewTokensLengthLogitsProcessor(6, kw["min_new_tokens"], 2))
        ref = _hf(procs, ids[r:r + 1], logits[r:r + 1])[0]
        np.testing.assert_allclose(ours[r], ref, rtol=1e-6)
    # the case exercises every processor: something was banned and something penalised
    assert np.isinf(ours).sum(1).min() >= 2 and not np.allclose(ours[np.isfinite(ours)], logits[np.isfinite(ours)])


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.8), (1.3, 5, 1.0), (1.0, 10, 0.6)])
def test_warpers_match_hf(temperature, top_k, top_p):
    _, _, logits = _case(1)
    st = sampling.make_settings(2, temperature=temperature, top_k=top_k, top_p=top_p)
    ours = np.asarray(sampling.warp(jnp.asarray(logits), st))
    procs = [lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        procs.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(lp.TopPLogitsWarper(top_p))
    ref = _hf(procs, np.zeros((2, 1), np.int32), logits)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    np.testing.assert_allclose(ours[np.isfinite(ours)], ref[np.isfinite(ref)], rtol=1e-6)
    # greedy rows (temperature 0) are untouched by the warpers
    st0 = sampling.make_settings(2, temperature=[0.0, temperature], top_k=top_k, top_p=top_p)
    mixed = np.asarray(sampling.warp(jnp.asarray(logits), st0))
    np.testing.assert_array_equal(mixed[0], logits[0])
    np.testing.assert_array_equal(mixed[1], ours[1])


@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.05), (0.7, 0.3)])
def test_min_p_matches_hf(temperature, min_p):
    """vLLM's min_p: after temperature, a token stays if its probability is at least min_p times the top
    one's (HF's MinPLogitsWarper); a row with min_p 0 or temperature 0 is left as it was."""
    _, _, logits = _case(1)
    st = sampling.make_settings(2, temperature=temperature, min_p=[min_p, 0.0])
    ours = np.asarray(sampling.warp(jnp.asarray(logits), st))
    ref = _hf([lp.TemperatureLogitsWarper(temperature), lp.MinPLogitsWarper(min_p)],
              np.zeros((1, 1), np.int32), logits[:1])[0]
    np.testing.assert_array_equal(np.isinf(ours[0]), np.isinf(ref))
    assert 0 < np.isinf(ours[0]).sum() < logits.shape[1] - 1  # the case drops some tokens, not all
    np.testing.assert_allclose(ours[0][np.isfinite(ours[0])], ref[np.isfinite(ref)], rtol=1e-6)
    assert not np.isinf(ours[1]).any()
    greedy = sampling.make_settings(2, temperature=0.0, min_p=min_p)
    np.testing.assert_array_equal(np.asarray(sampling.warp(jnp.asarray(logits), greedy)), logits)


def test_openai_penalties():
    ids, mask, logits = _case()
    state = _state(ids, mask, generated=3)  # generated: 8, 3, 8 in row 1; 9, 5, 6 in row 0
    st = sampling.make_settings(2, presence_penalty=[0.5, 0.0], frequency_penalty=[0.0, 0.25])
    out = np.asarray(sampling.process_logits(jnp.asarray(logits), state, st))
    expect = logits.copy()
    expect[0, [9, 5, 6]] -= 0.5
    expect[1, 8] -= 0.5   # generated twice
    expect[1, 3] -= 0.25
    np.testing.assert_allclose(out, expect, rtol=1e-6)


def test_greedy_rows_take_the_argmax():
    _, _, logits = _case(2)
    st = sampling.make_settings(2, temperature=0.0, seed=[1, 2])
    tok, logprobs = sampling.sample(jnp.asarray(logits), _state(*_case(2)[:2]), st)
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    np.testing.assert_allclose(np.exp(np.asarray(logprobs)).sum(-1), 1.0, rtol=1e-5)


def test_seeded_sampling_is_reproducible_and_matches_softmax():
    n, v = 20000, 8
    logits = np.log(np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02], np.float32)) * 2.0
    temperature = 2.0  # undoes the *2: the target distribution is the list above
    batch = jnp.tile(jnp.asarray(logits)[None], (n, 1))
    ids = jnp.ones((n, 1), jnp.int32)
    state = sampling.init_state(ids, ids, v, 4)
    st = sampling.make_settings(n, temperature=temperature, seed=np.arange(n))
    tok, _ = sampling.sample(batch, state, st)
    tok = np.asarray(tok)
    again, _ = sampling.sample(batch, state, st)
    np.testing.assert_array_equal(tok, np.asarray(again))
    other, _ = sampling.sample(batch, state, sampling.make_settings(n, temperature=temperature,
                                                                    seed=np.arange(n) + n))
    assert (np.asarray(other) != tok).mean() > 0.5
    p = np.exp(logits / temperature)
    p /= p.sum()
    counts = np.bincount(tok, minlength=v)
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    print(f"chi-square {chi2:.2f} (7 dof; 0.1% critical value 24.3)")
    assert chi2 < 24.3
    # with top_k=3 nothing outside the 3 likeliest is ever drawn, and those keep their ratios
    st3 = sampling.make_settings(n, temperature=temperature, top_k=3, seed=np.arange(n))
    tok3 = np.asarray(sampling.sample(batch, state, st3)[0])
    assert set(np.unique(tok3)) <= {0, 1, 2}
    p3 = p[:3] / p[:3].sum()
    c3 = np.bincount(tok3, minlength=3)[:3]
    assert ((c3 - n * p3) ** 2 / (n * p3)).sum() < 13.8  # 2 dof, 0.1%


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="no_repeat_ngram_size above"):
        sampling.make_settings(1, no_repeat_ngram_size=sampling.MAX_NGRAM + 1)
    with pytest.raises(ValueError, match="non-empty lists of token ids"):
        sampling.make_settings(1, bad_words_ids=[[]])


def test_logit_bias_is_added_to_its_rows_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    bias = [{7: 5.0, 3: -100.0}, None, {int(logits[2].argmax()): -100.0, 11: 0.5}]
    s = sampling.make_settings(3, logit_bias=bias, bias_width=4)
    assert s.bias_ids.shape == (3, 4)
    want = logits.copy()
    for row, b in enumerate(bias):
        for t, v in (b or {}).items():
            want[row, t] += v
    state = sampling.init_state(jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1), jnp.int32), 50, 8)
    np.testing.assert_allclose(np.asarray(sampling.process_logits(logits, state, s)), want, rtol=1e-6)
    tok, _ = sampling.sample(logits, state, s)
    assert list(np.asarray(tok)) == list(want.argmax(-1))
    assert not bool(sampling.plain_argmax(state, s)) and bool(sampling.plain_argmax(state, sampling.make_settings(3)))


def test_a_token_bitmask_masks_only_its_constrained_rows():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    allowed = rng.random((3, 70)) < 0.2
    words = np.zeros((3, 3), np.uint32)  # bit t % 32 of word t // 32 (llguidance's and xgrammar's layout)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    np.testing.assert_array_equal(np.asarray(sampling.unpack_bitmask(jnp.asarray(words.view(np.int32)), 70)),
                                  allowed)
    constrained = np.array([True, False, True])
    out = np.asarray(sampling.allow_only(jnp.asarray(logits), (jnp.asarray(words.view(np.int32)), constrained)))
    want = np.where(constrained[:, None] & ~allowed, -np.inf, logits)
    np.testing.assert_array_equal(out, want)

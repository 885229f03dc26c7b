"""The request module (opt_serving/text/request.py): every limit refuses with InvalidRequest naming its field, and
the batch runner, the generator and the engine refuse the same request with the same message."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from opt_serving import batch as B
from opt_serving.text import request as R
from opt_serving.engine.scheduler import EngineClosed, QueueFull
from opt_serving.errors import ContextLengthExceeded, InvalidRequest, Overloaded, Unavailable
from opt_serving.text.generator import SamplingParams
from opt_serving.runner.types import SlotSettings
from opt_serving.engine.fake import fake_engine
from opt_serving.text.fake import fake_generator


@pytest.fixture(scope="module")
def gen():
    g = fake_generator(num_slots=2, max_seq_len=64)  # byte tokenizer: 260 ids, 5 top alternatives
    yield g
    g.close()


# ---- each limit names its field ----------------------------------------------------------------

@pytest.mark.parametrize("bad, param", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens="5"), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature="hot"), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed="1"), "seed"), (dict(stop=["a"] * (R.MAX_STOP + 1)), "stop"), (dict(stop=[""]), "stop"),
    (dict(stop=[3]), "stop"), (dict(logprobs=R.MAX_LOGPROBS + 1), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(echo="yes"), "echo"), (dict(score_tokens=1), "score_tokens"),
    (dict(bad_words_ids=[[5]] * (R.MAX_BAD_WORDS + 1)), "bad_words_ids"),
    (dict(bad_words_ids=[[5] * (R.MAX_BAD_WORD_LEN + 1)]), "bad_words_ids"),
    (dict(bad_words_ids=[[]]), "bad_words_ids"), (dict(bad_words_ids=[[-1]]), "bad_words_ids"),
    (dict(no_repeat_ngram_size=R.MAX_NO_REPEAT_NGRAM + 1), "no_repeat_ngram_size"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[1] * (R.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(include_stop_str_in_output="no"), "include_stop_str_in_output"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
])
def test_each_field_limit_raises_invalid_request_naming_the_field(bad, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**bad).validate()
    assert e.value.param == param and str(e.value).startswith(param)
    assert isinstance(e.value, ValueError)  # what callers that predate the typed errors catch


def test_good_params_pass_and_a_stop_string_becomes_a_list():
    p = SamplingParams(stop="\n", logprobs=R.MAX_LOGPROBS, max_tokens=0, echo=True, seed=-(2 ** 63),
                       bad_words_ids=[[1] * R.MAX_BAD_WORD_LEN] * R.MAX_BAD_WORDS, top_k=np.int64(3),
                       temperature=np.float32(0.5))
    p.validate()
    assert p.stop == ["\n"]


def test_a_front_end_may_allow_fewer_logprobs():
    SamplingParams(logprobs=5).validate(max_logprobs=R.LEGACY_MAX_LOGPROBS)
    with pytest.raises(InvalidRequest, match=r"logprobs must be in \[0, 5\], got 6") as e:
        SamplingParams(logprobs=6).validate(max_logprobs=R.LEGACY_MAX_LOGPROBS)
    assert e.value.param == "logprobs"


@pytest.mark.parametrize("bad, param, words", [
    (dict(logprobs=6), "logprobs", "at most 5 alternatives per token with this model"),
    (dict(stop_token_ids=[260]), "stop_token_ids", "260 is outside the vocabulary [0, 260)"),
    (dict(bad_words_ids=[[3, 300]]), "bad_words_ids", "300 is outside the vocabulary"),
    (dict(stop_token_ids=[104], min_tokens=2), "stop_token_ids", "only one stop token"),
])
def test_model_limits_name_the_field(bad, param, words):
    limits = R.ModelLimits(vocab_size=260, max_seq_len=64, max_top_logprobs=5, eos_token_id=2)
    with pytest.raises(InvalidRequest) as e:
        R.check_for_model(SamplingParams(**bad), limits)
    assert e.value.param == param and words in str(e.value)
    R.check_for_model(SamplingParams(stop_token_ids=[104], min_tokens=2, ignore_eos=True), limits)  # one stop


def test_prompt_checks():
    for bad in ["", [], [1, -2], [True, 3], [1.5], None, 7]:
        with pytest.raises(InvalidRequest, match="non-empty string or a non-empty list of token ids") as e:
            R.prompt_form(bad)
        assert e.value.param == "prompt"
    assert R.prompt_form(np.array([2, 5], np.int32)) == [2, 5] and R.prompt_form("x") == "x"
    with pytest.raises(InvalidRequest, match=r"prompt token id 260 is outside the vocabulary \[0, 260\)"):
        R.check_prompt([2, 260], 1, 260, 64)
    with pytest.raises(ContextLengthExceeded) as e:
        R.check_prompt([2] * 60, 5, 260, 64)
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert str(e.value) == ("this model's maximum context length is 64 tokens, but the prompt has 60 tokens and "
                            "max_tokens is 5 (65 in total)")
    R.check_prompt([2] * 60, 4, 260, 64)
    with pytest.raises(ContextLengthExceeded, match="not tokenised"):
        R.refuse_surely_too_long("x" * 241, 16, 64, max_token_chars=5)
    R.refuse_surely_too_long("x" * 240, 16, 64, max_token_chars=5)
    R.refuse_surely_too_long("x" * 10 ** 6, 16, 64, max_token_chars=None)  # no bound known: tokenised


def test_n_and_best_of():
    assert R.check_n(2) == 2 and R.check_n(2, 3) == 3
    for n, best_of, param in [(0, None, "n"), (2, 1, "best_of"), (True, None, "n"), (1, 200, "best_of")]:
        with pytest.raises(InvalidRequest) as e:
            R.check_n(n, best_of, max_n=R.BATCH_MAX_N)
        assert e.value.param == param


# ---- the same request refused the same way everywhere -------------------------------------------

BAD_LINES = [
    {"prompt": "a", "max_tokens": -1},
    {"prompt": "a", "max_tokens": 0},
    {"prompt": "a", "temperature": "hot"},
    {"prompt": "a", "top_p": 0},
    {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": "a", "echo": "yes"},
    {"prompt": ""},
    {"prompt": [2, -1]},
    {"prompt": [2, 999]},                  # needs the model: refused after parsing, before it runs
    {"prompt": "a" * 70, "max_tokens": 2},  # too long for 64 positions
    {"prompt": "x" * 300},                 # refused without tokenising
]


def _generator_error(gen, line: dict) -> InvalidRequest:
    fields = {k: v for k, v in line.items() if k != "prompt"}
    with pytest.raises(InvalidRequest) as e:
        gen.prepare(line["prompt"], SamplingParams(**fields))
    return e.value


@pytest.mark.parametrize("line", BAD_LINES, ids=lambda line: json.dumps(line)[:40])
def test_the_batch_runner_and_the_generator_refuse_a_request_with_the_same_message(tmp_path, gen, line):
    expected = _generator_error(gen, line)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(line) + "\n")
    s = B.run_file(inp, out, gen, progress=False)
    assert (s.done, s.failed) == (0, 1)
    [record] = [json.loads(x) for x in out.read_text().splitlines()]
    assert record["error"]["message"] == f"line 1: {expected}"
    try:
        B.parse_request(1, json.dumps(line))
    except B.RequestError as e:  # refused on reading: with the generator's param too
        assert str(e) == f"line 1: {expected}" and e.param == expected.param
        assert isinstance(e, InvalidRequest)


def test_the_engine_refuses_with_the_request_modules_message(gen):
    engine = fake_engine(max_seq_len=64, start=False)
    try:
        for ids, settings in [([2] * 60, SlotSettings(max_tokens=5)), ([2, 999], SlotSettings(max_tokens=1))]:
            with pytest.raises(InvalidRequest) as e:
                engine.submit(ids, settings, lambda out: None)
            assert str(e.value) == str(_generator_error(gen, {"prompt": ids, "max_tokens": settings.max_tokens}))
        with pytest.raises(InvalidRequest, match="bad_words_ids") as e:
            engine.submit([2, 5], SlotSettings(bad_words_ids=((5,),) * 9), lambda out: None)
        assert e.value.param == "bad_words_ids"
    finally:
        engine.close()


def test_engine_refusals_are_the_typed_errors():
    engine = fake_engine(max_queue=1, start=False)
    engine.submit([2, 5], SlotSettings(max_tokens=1), lambda out: None)
    with pytest.raises(Overloaded) as full:
        engine.submit([2, 5], SlotSettings(max_tokens=1), lambda out: None)
    assert isinstance(full.value, QueueFull) and full.value.code == "queue_full"
    engine.close()
    with pytest.raises(Unavailable) as closed:
        engine.submit([2, 5], SlotSettings(max_tokens=1), lambda out: None)
    assert isinstance(closed.value, EngineClosed) and closed.value.code == "shutting_down"


# ---- scoring is decided from what the request asks for ------------------------------------------

def test_tokens_are_scored_only_where_the_request_needs_it(gen):
    assert not gen._settings(SamplingParams()).logprob                  # nothing shows the scores
    assert not gen._settings(SamplingParams(score_tokens=False)).logprob
    assert gen._settings(SamplingParams(logprobs=0)).logprob            # logprobs shows them
    assert gen._settings(SamplingParams(score_tokens=True)).logprob     # a caller whose answer always does
    ranked = gen.choice_params(SamplingParams(), 3, n=1)                 # best_of ranks by them
    assert all(gen._settings(p).logprob for p in ranked)
    assert not any(gen._settings(p).logprob for p in gen.choice_params(SamplingParams(), 3, n=3))
    assert B.parse_request(1, '{"prompt": "a"}').sampling.scored        # the batch output always shows them


# ---- one loader ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(model=None, dummy=True), "needs a model name"),
    (dict(model="jax/opt-tiny", dummy=True, path="w"), "not both"),
    (dict(model="jax/opt-125m"), "give path"),
    (dict(model=None, tokenizer="t"), "tokenizer (--tokenizer) goes with path or dummy"),
    (dict(model=None, path="w"), "give model"),
])
def test_the_loader_refuses_arguments_that_do_not_go_together(kw, words):
    from opt_serving.text.loading import load_generator
    with pytest.raises(ValueError) as e:
        load_generator(**kw)
    assert words in str(e.value)


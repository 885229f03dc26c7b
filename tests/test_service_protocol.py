"""protocol.py: the request models accept what the three APIs send and reject the rest with a reason."""
import json

import pytest
from pydantic import ValidationError

from opt_serving.service import protocol as P


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([2, 5, 7], [[2, 5, 7]]),
    ([[2, 5], [2, 9, 9]], [[2, 5], [2, 9, 9]]),
])
def test_four_prompt_forms_normalise_to_a_list(prompt, expected):
    req = P.CompletionRequest(prompt=prompt)
    assert P.normalize_prompt(req.prompt) == expected


@pytest.mark.parametrize("prompt, fragment", [
    ("", "empty"), ([], "empty"), (["a", ""], "prompt 1 is empty"), ([[]], "empty"),
    (["x"] * (P.MAX_PROMPTS + 1), "at most"),
])
def test_empty_or_too_many_prompts_are_rejected(prompt, fragment):
    with pytest.raises(ValidationError, match=fragment):
        P.CompletionRequest(prompt=prompt)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"), ("max_tokens", -1), ("max_tokens", 10**9), ("max_tokens", 1.5),
    ("temperature", "hot"), ("temperature", -0.1), ("top_p", 1.5), ("n", 0), ("logprobs", 21),
    ("stream", "yes"), ("echo", 1), ("stop", ["a", "b", "c", "d", "e"]), ("stop", ""), ("prompt", 5),
    ("prompt", [1, "a"]), ("prompt", [-1]), ("presence_penalty", 3.0), ("seed", "1"),
    # vLLM's extensions, checked as vLLM's SamplingParams checks them
    ("top_k", -2), ("top_k", 1.5), ("min_p", 1.5), ("min_p", -0.1), ("min_tokens", -1), ("min_tokens", 17),
    ("repetition_penalty", 0.0), ("stop_token_ids", [-1]), ("stop_token_ids", 2), ("ignore_eos", "yes"),
    ("include_stop_str_in_output", 1), ("skip_special_tokens", "no"),
])
def test_wrong_types_and_out_of_range_values_are_rejected(field, value):
    body = {"prompt": "hi", field: value}
    with pytest.raises(ValidationError):
        P.CompletionRequest(**body)


def test_best_of_below_n_names_both():
    with pytest.raises(ValidationError, match=r"best_of \(1\) must be greater than or equal to n \(2\)"):
        P.CompletionRequest(prompt="hi", n=2, best_of=1)
    with pytest.raises(ValidationError, match="stream"):
        P.CompletionRequest(prompt="hi", n=1, best_of=2, stream=True)
    assert P.CompletionRequest(prompt="hi", n=2, best_of=3).best_of == 3


def test_nullable_fields_mean_the_default_and_integers_are_accepted_as_floats():
    req = P.CompletionRequest(prompt="hi", max_tokens=None, temperature=None, top_p=1, n=None, stop=None)
    assert req.temperature is None and req.top_p == 1.0 and req.stops == []
    assert P.CompletionRequest(prompt="hi", stop="\n").stops == ["\n"]


def test_unsupported_openai_options_are_refused_not_ignored():
    with pytest.raises(ValidationError, match="suffix"):
        P.CompletionRequest(prompt="hi", suffix="!")
    with pytest.raises(ValidationError, match="structural_tag is not supported"):
        P.CompletionRequest(prompt="hi", structured_outputs={"structural_tag": "{}"})


def test_logit_bias_takes_token_ids_with_biases_in_openais_range():
    assert P.CompletionRequest(prompt="hi", logit_bias={"50256": -100, "7": 2.5}).extensions()["logit_bias"] == {
        50256: -100, 7: 2.5}
    for bad, match in (({"abc": 1}, "invalid key 'abc'"), ({"-1": 1}, "invalid key '-1'"),
                       ({"5": 100.5}, r"token 5 must be a number in \[-100, 100\]"),
                       ({"5": -101}, r"\[-100, 100\]"), ({str(i): 1 for i in range(301)}, "at most 300")):
        with pytest.raises(ValidationError, match=match):
            P.CompletionRequest(prompt="hi", logit_bias=bad)


def test_stream_options_only_with_stream():
    assert P.CompletionRequest(prompt="hi", stream=True, stream_options={"include_usage": True}).stream_options
    with pytest.raises(ValidationError, match="stream_options can only be set when stream is true"):
        P.CompletionRequest(prompt="hi", stream=False, stream_options={"include_usage": True})
    with pytest.raises(ValidationError, match="prompt_logprobs are not available when stream"):
        P.CompletionRequest(prompt="hi", stream=True, prompt_logprobs=1)


def test_structured_output_fields_map_to_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forms = [  # (request fields, kind, the field errors name)
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, "json",
         "response_format"),
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        ({"structured_outputs": {"json": json.dumps(schema)}}, "json", "structured_outputs"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "structured_outputs"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", "structured_outputs"),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar", "structured_outputs"),
        ({"guided_json": schema}, "json", "guided_json"), ({"guided_regex": "a+"}, "regex", "guided_regex"),
        ({"guided_choice": ["a"]}, "choice", "guided_choice"), ({"guided_grammar": 'start: "a"'}, "grammar",
                                                                 "guided_grammar")]
    for fields, kind, param in forms:
        for cls in (P.CompletionRequest, P.MetaseqRequest):
            so = cls(prompt="hi", **fields).structured()
            assert (so.kind, so.param) == (kind, param)
            if kind == "json":
                assert json.loads(so.spec) == schema
    assert P.GenerateRequest(guided_regex="a+").structured().kind == "regex"
    assert P.CompletionRequest(prompt="hi", response_format={"type": "text"}).structured() is None
    with pytest.raises(ValidationError, match="only one kind of structured output"):
        P.CompletionRequest(prompt="hi", guided_regex="a", structured_outputs={"choice": ["a"]})
    with pytest.raises(ValidationError, match="json_schema needs json_schema.schema"):
        P.CompletionRequest(prompt="hi", response_format={"type": "json_schema"})
    with pytest.raises(ValidationError, match="not valid JSON"):
        P.CompletionRequest(prompt="hi", guided_json="{oops")
    with pytest.raises(ValidationError, match="non-empty list"):
        P.CompletionRequest(prompt="hi", guided_choice=[])


def test_metaseq_defaults_and_token_prompts():
    req = P.MetaseqRequest(prompt=[[2, 10], [2, 11]])
    assert (req.max_tokens, req.temperature, req.top_p, req.n, req.echo) == (32, 1.0, 1.0, 1, False)
    assert P.normalize_prompt(req.prompt) == [[2, 10], [2, 11]]
    with pytest.raises(ValidationError):
        P.MetaseqRequest(prompt="x", best_of=1, n=3)


def test_gptj_post_data_defaults_match_the_seed():
    req = P.GenerateRequest()
    assert req.prompt == ["Hello world"] and req.top_k == 50 and req.min_length == 10 and req.max_length == 50
    assert req.do_sample is True and req.num_beams == 0 and req.seed == -1 and req.end_sequence == ""
    assert P.GenerateRequest(top_k=40.0).top_k == 40.0


@pytest.mark.parametrize("body, fragment", [
    ({"num_beams": 4}, "beam search"), ({"penalty_alpha": 0.6}, "contrastive"),
    ({"min_length": 60, "max_length": 50}, "min_length"), ({"top_k": 2.5}, "whole number"),
    ({"prompt": []}, "at least 1"), ({"prompt": "not a list"}, "list"),
])
def test_gptj_requests_we_cannot_honour_say_why(body, fragment):
    with pytest.raises(ValidationError, match=fragment):
        P.GenerateRequest(**body)


def test_error_json_has_openais_shape():
    assert P.error_json("bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}

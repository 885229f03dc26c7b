"""structured.py and the masks behind it (runner/grammar.py, the sampler): requests constrained by a JSON schema, a
regex, a choice or a grammar produce conforming text with the real OPT tokenizer on random weights, through the
service and the official `openai` client; what llguidance cannot follow is a 400 naming the problem."""
import json
import re

import pytest

from opt_serving.errors import InvalidRequest
from opt_serving.text.generator import SamplingParams
from opt_serving.text.structured import StructuredOutput, check_grammar, grammar_of

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
# every field bounded (on random weights an unbounded number or string can run to max_tokens: "855855855...")
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -999, "maximum": 999},
                                          "y": {"enum": [0.5, 1.5, "far"]}},
         "required": ["x", "y"], "additionalProperties": False}
PROMPTS = ["Hello, my name is", "The capital of France is", "{", "Answer in JSON:"]


@pytest.fixture(scope="module")
def ll_tok(opt_vocab_server):
    g = opt_vocab_server[0]
    return g.grammar_tokenizer(StructuredOutput("json_object"))


def matcher(tok, so: StructuredOutput):
    import llguidance
    return llguidance.LLMatcher(tok, grammar_of(so), log_level=0)


# ---- the grammar of a request ----
@pytest.mark.parametrize("so, problem", [
    (StructuredOutput.of("json", {"type": "foo"}, "response_format"), "response_format: .*Invalid type: foo"),
    (StructuredOutput.of("json", {"type": "string", "format": "no-such-format"}, "guided_json"),
     "guided_json: .*Unknown format: no-such-format"),
    (StructuredOutput.of("regex", "(ab", "structured_outputs"), "structured_outputs: .*unclosed group"),
    (StructuredOutput.of("grammar", "start: rule_never_defined", "guided_grammar"), "unknown name"),
])
def test_what_llguidance_cannot_follow_is_an_invalid_request_naming_the_problem(ll_tok, so, problem):
    with pytest.raises(InvalidRequest, match=problem) as e:
        check_grammar(so, ll_tok)
    assert e.value.param == so.param


def test_json_allows_no_free_whitespace_unless_a_pattern_asks(ll_tok, opt_tokenizer):
    """vLLM's JSON on random weights was `{` and whitespace until max_tokens: here no whitespace is free."""
    def accepts(so, text):
        ids = opt_tokenizer(text, add_special_tokens=False)["input_ids"]
        return matcher(ll_tok, so).try_consume_tokens(ids) == len(ids)
    compact = StructuredOutput.of("json", POINT, "response_format")
    assert accepts(compact, '{"x":1,"y":1.5}')
    for spaced in ('{ "x":1', '{"x": 1', '{"x":1 ,', '{\n"x"'):
        assert not accepts(compact, spaced), spaced
    one_space = StructuredOutput.of("json", POINT, "structured_outputs", whitespace_pattern="[ ]?")
    assert accepts(one_space, '{ "x": 1, "y": "far"}') and not accepts(one_space, '{  "x"')


def test_disable_additional_properties_closes_every_object(ll_tok, opt_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = '{"a":1,"b":2}'
    ids = opt_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert matcher(ll_tok, StructuredOutput.of("json", schema, "x")).try_consume_tokens(ids) == len(ids)
    closed = StructuredOutput.of("json", schema, "x", disable_additional_properties=True)
    assert matcher(ll_tok, closed).try_consume_tokens(ids) < len(ids)


# ---- through the service: conforming text on random weights ----
def _create(client, prompt, **kw):
    return client.completions.create(model="opt-small", prompt=prompt, max_tokens=kw.pop("max_tokens", 60), **kw)


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json"])
def test_json_schema_requests_produce_objects_that_match(opt_vocab_server, field):
    _, _, client, _ = opt_vocab_server
    for schema in (PERSON, POINT):
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                "structured_outputs": {"json": schema}, "guided_json": schema}[field]
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 2}):
            r = _create(client, PROMPTS, extra_body={field: body}, **sampling)
            assert len(r.choices) == len(PROMPTS) * sampling.get("n", 1)
            for c in r.choices:
                assert c.finish_reason == "stop", c.text
                jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_grammar_and_json_object_requests_conform(opt_vocab_server):
    _, _, client, _ = opt_vocab_server
    regex = r"[0-9]{3}-[a-z]{2,5}( ok)?"
    choices = ["yes", "no", "maybe later"]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3}):
        for c in _create(client, PROMPTS, extra_body={"structured_outputs": {"regex": regex}}, **sampling).choices:
            assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", c.text
        for c in _create(client, PROMPTS, extra_body={"guided_choice": choices}, **sampling).choices:
            assert c.text in choices and c.finish_reason == "stop"
        lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
        for c in _create(client, PROMPTS, extra_body={"guided_grammar": lark}, **sampling).choices:
            assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", c.text) or c.finish_reason == "length", c.text
        for c in _create(client, PROMPTS, max_tokens=120, extra_body={"response_format": {"type": "json_object"}},
                         **sampling).choices:
            if c.finish_reason == "stop":  # any object: its strings may run to max_tokens
                assert isinstance(json.loads(c.text), dict)


def test_a_model_that_favours_whitespace_still_finishes_a_small_object(opt_vocab_server, opt_tokenizer):
    _, _, client, _ = opt_vocab_server
    spaces = {opt_tokenizer.convert_tokens_to_ids(t) for t in ("Ġ", "Ċ", "ĠĠ", "ĉ", "ĊĊ", "ĠĠĠ")}
    bias = {str(t): 100 for t in spaces}
    free = _create(client, "{", max_tokens=8, temperature=0, logit_bias=bias)
    assert free.choices[0].text.strip() == ""  # unconstrained, it writes nothing but whitespace
    r = _create(client, PROMPTS, max_tokens=40, temperature=0, logit_bias=bias,
                extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    for c in r.choices:
        assert c.finish_reason == "stop" and json.loads(c.text) == json.loads(c.text.strip())
        jsonschema.validate(json.loads(c.text), PERSON)
    assert r.usage.completion_tokens <= 40 * len(PROMPTS)


def test_constrained_rows_leave_the_unconstrained_ones_beside_them_as_they_were(opt_vocab_server):
    g = opt_vocab_server[0]
    plain = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.8, seed=5)]
    alone = [c.text for [c] in g.complete_many(PROMPTS[:2], plain)]
    person = StructuredOutput.of("json", PERSON, "response_format")
    mixed = plain + [SamplingParams(max_tokens=60, temperature=t, seed=1, structured=person) for t in (0, 1.0)]
    got = g.complete_many(PROMPTS[:2] * 2, mixed)
    assert [c.text for [c] in got[:2]] == alone
    for [c] in got[2:]:
        jsonschema.validate(json.loads(c.text), PERSON)


def test_constrained_steps_in_one_call_equal_single_steps(opt_vocab_server):
    """The server's engine takes four steps a call (a constrained group's one at a time, each with its masks); an
    engine over the same weights taking one step a call gives the same tokens, and so does one sending its calls
    ahead (a constrained group's calls are read at once, still four steps each). Prompts longer than a decode
    step's block are prefilled, the others join a step: both start their matchers."""
    from opt_serving.engine.scheduler import Engine
    from opt_serving.text.generator import Generator
    from opt_serving.runner.load import local_slots
    g = opt_vocab_server[0]
    stage = g.engine.model.stages.stages[0]

    def generator(**engine_args):
        slots = local_slots(stage.cfg, stage.params, 8, 256, backend=stage.backend)
        return Generator(Engine(slots, **engine_args), g.tokenizer)
    single, ahead = generator(decode_steps=1), generator(decode_steps=g.engine.decode_steps, ahead=True)
    long_prompt = "Write the record of a person, in JSON, with a name, an age and some tags. " * 3
    prompts = PROMPTS + [long_prompt]
    params = [SamplingParams(max_tokens=60, temperature=t, seed=11,
                             structured=StructuredOutput.of("json", PERSON, "guided_json")) for t in (0, 1.0)]
    try:
        want = [[c.text for [c] in single.complete_many(prompts, p)] for p in params]
        for many in (g, ahead):
            before = many.engine.stats()
            assert [[c.text for [c] in many.complete_many(prompts, p)] for p in params] == want
            after = many.engine.stats()
            assert after.steps - before.steps > after.step_calls - before.step_calls  # several steps a call
    finally:
        single.close()
        ahead.close()
    for texts in want:
        for t in texts:
            jsonschema.validate(json.loads(t), PERSON)


def test_metaseq_and_gpt_api_routes_take_the_same_fields(opt_vocab_server):
    import requests
    _, url, _, _ = opt_vocab_server
    r = requests.post(url + "/completions", json={"prompt": PROMPTS, "max_tokens": 60, "temperature": 0,
                                                   "structured_outputs": {"json": PERSON}}, timeout=120)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        jsonschema.validate(json.loads(c["text"]), PERSON)
    r = requests.post(url + "/generate", json={"prompt": PROMPTS, "max_length": 12, "min_length": 0,
                                                "guided_choice": ["left", "right"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert [t[len(p):] in ("left", "right") for p, t in zip(PROMPTS, r.json()["gen_text"])] == [True] * len(PROMPTS)
    beams = requests.post(url + "/generate", json={"prompt": ["a"], "do_sample": False, "num_beams": 2,
                                                    "guided_regex": "b+"}, timeout=120)
    assert beams.status_code == 400 and "not available with beam search" in beams.json()["error"]["message"]


def test_a_schema_llguidance_cannot_follow_is_a_400_naming_the_problem(opt_vocab_server):
    _, _, client, _ = opt_vocab_server
    with pytest.raises(openai.BadRequestError, match="Invalid type: foo") as e:
        _create(client, "hi", extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        _create(client, "hi", extra_body={"structured_outputs": {"regex": "(a"}})


def test_an_engine_that_cannot_mask_refuses_structured_output():
    from opt_serving.text.fake import fake_generator
    g = fake_generator()
    try:
        with pytest.raises(InvalidRequest, match="structured output is not available with opt-fake"):
            g.prepare("a", SamplingParams(structured=StructuredOutput.of("regex", "b+", "guided_regex")))
    finally:
        g.close()

"""app.py over the fake engine (engine/fake.py): every expected output is worked out by hand.

The fake model continues greedily with the next byte ("a" -> "bcdef..."), every chosen greedy token has
logprob -ln2 and the k-th alternative -k ln2; a sampled token is `last + 1 + (seed + k) % 3`. Prompt "a" is
ids [2, 101] (</s> then byte 97 + 4); </s> (id 2) is EOS.
"""
import json
import math
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from opt_serving.engine.scheduler import SlotSettings
from opt_serving.text.generator import SamplingParams
from opt_serving.service.app import create_app
from opt_serving.service.testserver import serve_in_thread
from opt_serving.text.fake import fake_generator

LN2 = math.log(2)


@pytest.fixture
def gen():
    g = fake_generator(num_slots=4, max_seq_len=64, max_queue=16)
    yield g
    g.close()


@pytest.fixture
def client(gen):
    with TestClient(create_app(gen)) as c:
        yield c


def post(client, body, path="/v1/completions", **kw):
    return client.post(path, json=body, **kw)


def sse_chunks(text: str) -> list:
    import json
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


# ---------------------------------------------------------------- OpenAI completions
def test_greedy_completion_text_usage_and_finish(client):
    r = post(client, {"prompt": "a", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "opt-fake"
    assert body["choices"] == [{"text": "bcdef", "index": 0, "logprobs": None, "finish_reason": "length",
                                "prompt_logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # the fake engine caches nothing


def test_logprobs_tokens_offsets_and_top_alternatives(client):
    r = post(client, {"prompt": "a", "max_tokens": 3, "temperature": 0, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["b", "c", "d"]
    assert lp["token_logprobs"] == pytest.approx([-LN2] * 3)
    assert lp["text_offset"] == [1, 2, 3]  # counted from the start of the prompt text "a"
    assert [sorted(t) for t in lp["top_logprobs"]] == [["b", "c"], ["c", "d"], ["d", "e"]]
    assert lp["top_logprobs"][0]["c"] == pytest.approx(-2 * LN2)


def test_echo_lists_every_prompt_token_the_model_read(client):
    r = post(client, {"prompt": "a", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0})
    choice = r.json()["choices"][0]
    assert choice["text"] == "abc"
    # as OpenAI and vLLM: the tokenizer's </s> first with a null logprob (nothing before it), but no part of the
    # text, which is the prompt as sent; "a" is scored after it
    assert choice["logprobs"]["tokens"] == ["</s>", "a", "b", "c"]
    assert choice["logprobs"]["text_offset"] == [0, 0, 1, 2]
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([math.log(2 ** -5 / 255), -LN2, -LN2])
    # a token prompt is echoed id for id, its explicit </s> (nothing before it: null logprob) included
    r = post(client, {"prompt": [2, 101], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert (lp["tokens"], lp["token_logprobs"][0], lp["text_offset"]) == (["</s>", "a", "b"], None, [0, 0, 1])


def test_stop_string_cuts_the_text(client):
    r = post(client, {"prompt": "a", "max_tokens": 10, "temperature": 0, "stop": ["x", "de"]})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("bc", "stop")


def test_streaming_never_leaks_part_of_a_stop_string(client):
    r = post(client, {"prompt": "a", "max_tokens": 10, "temperature": 0, "stop": "cde", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "b"
    assert not any("c" in t for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_streaming_usage_chunk_when_asked(client):
    r = post(client, {"prompt": "a", "max_tokens": 4, "temperature": 0, "stream": True,
                      "stream_options": {"include_usage": True}})
    chunks = sse_chunks(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "bcde"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}


def test_streaming_several_prompts_keeps_choices_apart(client):
    r = post(client, {"prompt": ["a", "k"], "max_tokens": 3, "temperature": 0, "stream": True})
    by_index = {0: "", 1: ""}
    for c in sse_chunks(r.text):
        ch = c["choices"][0]
        by_index[ch["index"]] += ch["text"]
    assert by_index == {0: "bcd", 1: "lmn"}


def test_token_prompts_and_list_prompts_give_one_choice_each(client):
    r = post(client, {"prompt": [[2, 101], [2, 104]], "max_tokens": 2, "temperature": 0})
    assert [c["text"] for c in r.json()["choices"]] == ["bc", "ef"]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = post(client, {"prompt": [2, 101], "max_tokens": 2, "temperature": 0})
    assert [c["text"] for c in r.json()["choices"]] == ["bc"]


def _fake_sample(seed: int, last: int, k: int) -> tuple[str, float]:
    """Text and cumulative logprob of a fake sampled completion (module docstring of engine/fake.py)."""
    text, cum = "", 0.0
    for i in range(k):
        j = 1 + (seed + i) % 3
        last += j
        text += chr(last - 4)
        cum += -j * LN2
    return text, cum


def test_n_and_best_of_keep_the_most_likely_samples(client, gen):
    seeds = [p.seed for p in gen.choice_params(SamplingParams(seed=7), 4)]
    cands = [_fake_sample(s, 101, 3) for s in seeds]
    expected = [t for t, _ in sorted(cands, key=lambda c: -c[1])[:2]]
    r = post(client, {"prompt": "a", "max_tokens": 3, "temperature": 1.0, "n": 2, "best_of": 4, "seed": 7})
    assert [c["text"] for c in r.json()["choices"]] == expected
    assert r.json()["usage"]["completion_tokens"] == 12  # every sampled candidate is counted
    # n without best_of: the samples in seed order, reproducible
    r2 = post(client, {"prompt": "a", "max_tokens": 3, "temperature": 1.0, "n": 2, "seed": 7})
    assert [c["text"] for c in r2.json()["choices"]] == [c[0] for c in cands[:2]]


def test_eos_finishes_with_stop_and_is_counted(client):
    # after id 257 come 258, 259, 0, 1 and then 2 = </s>
    r = post(client, {"prompt": [2, 257], "max_tokens": 10, "temperature": 0})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5


# ---------------------------------------------------------------- metaseq / Alpa
def test_metaseq_completions_shape(client):
    r = post(client, {"prompt": [[2, 101], [2, 102]], "max_tokens": 2, "temperature": 0}, "/completions")
    assert r.status_code == 200
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["bc", "cd"]
    c0 = body["choices"][0]
    assert c0["logprobs"]["tokens"] == ["b", "c"] and c0["logprobs"]["finish_reason"] == "length"
    assert c0["logprobs"]["token_logprobs"] == pytest.approx([-LN2, -LN2])


def test_metaseq_min_tokens_holds_off_eos(client):
    r = post(client, {"prompt": [2, 257], "max_tokens": 6, "min_tokens": 6, "temperature": 0}, "/completions")
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_tokens_are_scored_only_where_the_answer_uses_the_scores(client, gen):
    """Unscored requests let an all-greedy engine step skip the logits (OPTSlots' screened head)."""
    seen = gen.engine.model.inserted_settings
    cases = [({"prompt": "a", "max_tokens": 2, "temperature": 0}, "/v1/completions", [False]),
             ({"prompt": "a", "max_tokens": 2, "temperature": 0, "logprobs": 0}, "/v1/completions", [True]),
             ({"prompt": "a", "max_tokens": 2, "n": 1, "best_of": 2}, "/v1/completions", [True, True]),  # ranked
             ({"prompt": "a", "max_tokens": 2, "n": 2}, "/v1/completions", [False, False]),
             ({"prompt": "a", "max_tokens": 2, "temperature": 0}, "/completions", [True]),  # metaseq: always
             ({"prompt": ["a"], "max_length": 2, "min_length": 0, "do_sample": False}, "/generate", [False])]
    for body, path, scored in cases:
        before = len(seen)
        r = post(client, body, path)
        assert r.status_code == 200, r.text
        assert [s.logprob for s in seen[before:]] == scored, (path, body)
    assert "logprobs" not in r.json() and r.json()["gen_text"] == ["abc"]


# ---------------------------------------------------------------- GPT-J REST API
def test_gptj_generate_returns_prompt_plus_text(client):
    r = post(client, {"prompt": ["a", "k"], "max_length": 3, "min_length": 0, "do_sample": False}, "/generate")
    assert r.json() == {"gen_text": ["abcd", "klmn"]}


def test_gptj_end_sequence_and_return_prompt(client):
    r = post(client, {"prompt": ["a"], "max_length": 5, "min_length": 0, "do_sample": False,
                      "end_sequence": "d"}, "/generate")
    assert r.json() == {"gen_text": ["abc"]}
    r = post(client, {"prompt": ["a"], "max_length": 3, "min_length": 0, "do_sample": False,
                      "return_prompt": "b"}, "/generate")
    assert r.json() == {"gen_text": ["bcd"]}


def test_gptj_beam_search_without_sampling(client):
    # the fake's most likely sequence is the greedy one (tests/test_generator.py); the beam path runs
    # FakeBeamModel.generate, not the decode slots
    beam = client.app.state.service.g._model
    calls = beam.calls
    r = post(client, {"prompt": ["a", "k"], "max_length": 3, "min_length": 0, "do_sample": False, "num_beams": 4,
                      "end_sequence": "n"}, "/generate")
    assert r.json() == {"gen_text": ["abcd", "klm"]}
    assert beam.calls == calls + 2
    r = post(client, {"prompt": ["a"], "max_length": 63, "min_length": 0, "do_sample": False, "num_beams": 4},
             "/generate")
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = post(client, {"prompt": ["a"], "max_length": 3, "min_length": 0, "do_sample": True, "num_beams": 4},
             "/generate")
    assert r.status_code == 400 and "do_sample=false" in r.json()["error"]["message"]


def test_gptj_beam_search_larger_than_the_beam_budget_is_a_400_naming_it(client):
    # 64 prompts x 64 beams x (2 + 16) tokens against the fake's 4 slots x 64 tokens = 256
    r = post(client, {"prompt": ["a"] * 64, "max_length": 16, "min_length": 0, "do_sample": False,
                      "num_beams": 64}, "/generate")
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("num_beams", "beam_budget_exceeded")
    assert "73728 beam tokens" in err["message"] and "budget of 256" in err["message"]


def _post_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def go():
        try:
            out["r"] = httpx.post(url + "/generate", json=body, timeout=60)
        except httpx.HTTPError as e:
            out["r"] = e
    t = threading.Thread(target=go)
    t.start()
    return t


def test_gptj_beam_search_while_others_hold_the_budget_is_a_429_with_retry_after(gen):
    model = gen._model.hold(1)
    beams = {"prompt": ["a"], "max_length": 50, "min_length": 0, "do_sample": False, "num_beams": 4}
    with serve_in_thread(create_app(gen)) as url:
        first, second = {}, {}
        threads = [_post_in_thread(url, beams, first)]  # 4 x (2 + 50) = 208 beam tokens
        try:
            assert model.reached.wait(30)  # running, holding 208 of the 256
            r = httpx.post(url + "/generate", json={**beams, "max_length": 11}, timeout=30)  # 52 more
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "budget of 256" in r.json()["error"]["message"]
            threads.append(_post_in_thread(url, {**beams, "max_length": 10}, second))  # 48: fits, waits
        finally:
            model.go.set()
            for t in threads:
                t.join(60)
        assert first["r"].status_code == 200 and second["r"].status_code == 200


def test_a_client_leaving_stops_its_running_beam_search_before_the_next_step(gen):
    model = gen._model.hold(2)
    body = json.dumps({"prompt": ["a"], "max_length": 60, "min_length": 0, "do_sample": False,
                       "num_beams": 2}).encode()
    with serve_in_thread(create_app(gen)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert model.reached.wait(30)  # the search is running, inside step 2
        # the client is gone; the server notes it (a 499 in its metrics) once it has cancelled the search
        deadline = time.monotonic() + 30
        while 'endpoint="generate",status="499"} 1.0' not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline, "the server did not notice the client leaving"
            time.sleep(0.05)
        model.go.set()
        r = httpx.post(url + "/generate", json={"prompt": ["k"], "max_length": 2, "min_length": 0,
                                                "do_sample": False, "num_beams": 2}, timeout=30)
        assert r.json() == {"gen_text": ["klm"]}  # the worker is free: the search stopped
    assert model.stopped_at == 3  # of 60 steps: the one after the client left did not run


def test_gptj_bad_words_become_token_ids_with_and_without_a_leading_space(client):
    # (the fake engine has no logits to mask; banning itself is the engine's, tested there)
    from opt_serving.service.routes_gptj import bad_words_ids
    ids = bad_words_ids(client.app.state.service.g, ["b"])
    assert ids == [[4 + ord("b")], [4 + ord(" "), 4 + ord("b")]]


# ---------------------------------------------------------------- errors: always 4xx JSON in OpenAI's shape
@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "max_tokens": "five"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": 3}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "a", "n": 3, "best_of": 2}, None),
    ({"prompt": "a", "stream": "yes"}, "stream"),
])
def test_malformed_requests_are_400_with_an_error_object(client, body, param):
    r = post(client, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", ""]])
def test_empty_prompt_is_400(client, prompt):
    r = post(client, {"prompt": prompt})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]


def test_bad_json_and_non_object_bodies_are_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "error" in r.json()


def test_prompt_plus_max_tokens_over_the_model_length_names_the_limit(client):
    r = post(client, {"prompt": "a", "max_tokens": 63})  # 2 + 63 > 64
    assert r.status_code == 400
    err = r.json()["error"]
    assert "64" in err["message"] and err["code"] == "context_length_exceeded"
    assert post(client, {"prompt": "a", "max_tokens": 62, "temperature": 0}).status_code == 200


def test_token_id_outside_the_vocabulary_is_400(client):
    r = post(client, {"prompt": [2, 100000]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_unknown_route_and_wrong_method_keep_the_error_shape(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_full_queue_is_429_with_retry_after():
    g = fake_generator(num_slots=1, max_queue=1, start=False)  # the engine does not run: the queue stays full
    try:
        g.engine.submit([2, 101], SlotSettings(max_tokens=1), lambda out: None)
        with TestClient(create_app(g)) as c:
            r = post(c, {"prompt": "a", "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            r = post(c, {"prompt": "a", "max_tokens": 2, "stream": True})
            assert r.status_code == 429
    finally:
        g.close()


def test_request_timeout_is_504_and_frees_the_request():
    g = fake_generator(num_slots=1, max_queue=4, start=False)
    try:
        with TestClient(create_app(g, request_timeout=0.2)) as c:
            r = post(c, {"prompt": "a", "max_tokens": 2})
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert g.stats()["queue_length"] == 0  # the timed-out request left the queue
    finally:
        g.close()


# ---------------------------------------------------------------- API keys, probes, page
def test_api_keys_guard_the_api_but_not_the_probes(gen):
    with TestClient(create_app(gen, api_keys=["k1", "k2"])) as c:
        assert post(c, {"prompt": "a"}).status_code == 401
        r = post(c, {"prompt": "a"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = post(c, {"prompt": "a", "max_tokens": 1}, headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200 and c.get("/").status_code == 200


def test_models_health_and_page(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "opt-fake" and models["data"][0]["max_model_len"] == 64
    assert client.get("/health").json()["status"] == "ok"
    page = client.get("/").text
    for element in ('id="prompt"', 'id="max_tokens"', 'id="temperature"', 'id="top_p"', 'id="output"'):
        assert element in page


def test_openapi_schema_lists_the_three_apis(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/completions", "/generate", "/v1/models", "/health"} <= set(paths)


# ---------------------------------------------------------------- Ray Serve builder and config (no Ray started)
def test_serve_args_from_command_line_strings():
    from opt_serving.service.deployment import ServeArgs
    a = ServeArgs(**{"model": "facebook/opt-125m", "path": "/w", "max_batch_size": "8", "api_keys": "k1, k2,"})
    assert a.max_batch_size == 8 and a.key_list() == ["k1", "k2"]
    assert ServeArgs(api_keys=["x"]).key_list() == ["x"]
    # vLLM's --served-model-name: the model's own name unless given (builder argument: comma separated)
    assert a.model_names() == ["facebook/opt-125m"] and ServeArgs().model_names() == []
    assert ServeArgs(model="jax/opt-125m", served_model_name="opt, my-opt ").model_names() == ["opt", "my-opt"]


def test_served_model_names_from_the_command_line():
    import argparse

    from opt_serving.service import cli_args
    parser = argparse.ArgumentParser()
    cli_args.add_arguments(parser)
    args = parser.parse_args(["--model", "jax/opt-125m", "--served-model-name", "opt", "facebook/opt-125m"])
    assert cli_args.serve_args_from(args).model_names() == ["opt", "facebook/opt-125m"]
    assert cli_args.serve_args_from(parser.parse_args(["--model", "jax/opt-125m"])).model_names() == ["jax/opt-125m"]


def test_builder_makes_a_deployment_sized_for_the_engine_queue():
    pytest.importorskip("ray.serve")
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from opt_serving.service import app as builder
    # what `serve run opt_serving.service:app engine=fake max_queue=100 max_batch_size=4` does with the args
    application = call_user_app_builder_with_args_if_necessary(
        builder, {"engine": "fake", "max_queue": "100", "max_batch_size": "4"})
    deployment = application._bound_deployment
    assert deployment.name == "OPTServer"
    assert deployment.max_ongoing_requests == 104
    assert deployment.ray_actor_options["num_cpus"] == 1.0


def test_serve_config_yaml_is_a_valid_serve_config():
    pytest.importorskip("ray.serve")
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    [app] = schema.applications
    assert app.import_path == "opt_serving.service:app" and app.args["max_queue"] == 256
    from opt_serving.service.deployment import ServeArgs
    ServeArgs(**app.args)  # the builder accepts every argument the example gives


@pytest.mark.parametrize("extra", [{}, {"n": 2}])  # one stream read directly; two merged
def test_stream_that_times_out_ends_with_an_error_event_and_done(extra):
    import json
    g = fake_generator(num_slots=1, max_queue=4, start=False)  # queued forever: no token ever comes
    try:
        with TestClient(create_app(g, request_timeout=0.2)) as c:
            r = post(c, {"prompt": "a", "max_tokens": 2, "stream": True, **extra})
            assert r.status_code == 200
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "timeout"
        assert g.stats()["queue_length"] == 0
    finally:
        g.close()


def test_echo_with_zero_max_tokens_scores_the_prompt(client):
    r = post(client, {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == "ab"
    assert choice["logprobs"]["tokens"] == ["</s>", "a", "b"]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([math.log(2 ** -5 / 255), -LN2])
    assert post(client, {"prompt": "ab", "max_tokens": 0}).status_code == 400  # nothing to return


def test_streamed_samples_match_the_plain_answer_for_the_same_seed(client):
    body = {"prompt": ["a", "k"], "max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 3}
    plain = [c["text"] for c in post(client, body).json()["choices"]]
    streamed = ["", "", "", ""]
    for c in sse_chunks(post(client, {**body, "stream": True}).text):
        ch = c["choices"][0]
        streamed[ch["index"]] += ch["text"]
    assert streamed == plain and len(set(plain)) > 1


def test_serve_cli_binds_localhost_by_default():
    import argparse

    from opt_serving.service import cli
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.model is None and args.path is None


def test_alpa_deployment_reserves_the_plans_gpus_on_one_node(monkeypatch):
    """With GPUs in the cluster, an alpa/ replica's bundle holds the tensor-parallel GPUs of its plan."""
    import ray

    from opt_serving.parallel import cluster
    from opt_serving.service.deployment import ServeArgs, placement
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    monkeypatch.setattr(cluster, "cluster_from_ray", lambda *a, **k: cluster.parse_cluster("1x8x16GB"))
    opts = placement(ServeArgs(model="alpa/opt-13b", dtype="float16", max_batch_size=4, max_seq_len=512,
                               num_cpus=2))
    tp = opts["ray_actor_options"]["num_gpus"]
    # 13b in fp16 (~26 GB) cannot fit one 16 GB GPU, so the plan must split it, within the node
    assert tp in (2, 4, 8)
    assert opts["placement_group_bundles"] == [{"CPU": 2, "GPU": float(tp)}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    # a jax/ model reserves one of the cluster's GPUs and the planner's share of it (tests/test_jax_env.py)
    assert placement(ServeArgs(model="jax/opt-125m", num_cpus=2)) == {"ray_actor_options": {
        "num_cpus": 2, "num_gpus": 1.0, "runtime_env": {"env_vars": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.900"}}}}


def test_a_pipelined_deployment_holds_a_bundle_per_stage(monkeypatch):
    """OPT-175B on Alpa's 4 x 8 x 16 GB cluster: pp stages of tp GPUs each, the replica in stage 0's bundle,
    and the plan's degrees handed to the replica."""
    import ray

    from opt_serving.parallel import cluster
    from opt_serving.service.deployment import ServeArgs, placement
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 128.0, "GPU": 32.0})
    monkeypatch.setattr(cluster, "cluster_from_ray", lambda *a, **k: cluster.parse_cluster("4x8x16GB"))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 32.0, "GPU": 8.0}}] * 4)
    args = ServeArgs(model="alpa/opt-175b", max_batch_size=8, max_seq_len=1024, num_cpus=2)
    opts = placement(args)
    assert args.dtype == "float16"  # "auto" on a GPU cluster
    assert args.pipeline_parallel > 1 and args.pipeline_parallel * args.tensor_parallel <= 32
    bundles = opts["placement_group_bundles"]
    assert len(bundles) == args.pipeline_parallel and opts["placement_group_strategy"] == "PACK"
    assert bundles[0] == {"CPU": 3.0, "GPU": float(args.tensor_parallel)}
    assert bundles[1:] == [{"CPU": 1.0, "GPU": float(args.tensor_parallel)}] * (len(bundles) - 1)
    # the replica drives the stages, which hold the GPUs: it sees none
    assert opts["ray_actor_options"] == {"num_cpus": 2, "runtime_env": {"env_vars": {"JAX_PLATFORMS": "cpu"}}}
    # the same plan where only one of the four nodes is alive: refused when it is made, not left to Serve's wait
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 32.0, "GPU": 8.0}}] +
                        [{"Alive": False, "Resources": {"CPU": 32.0, "GPU": 8.0}}] * 3)
    with pytest.raises(ValueError, match=r"cannot be placed: .*GPU 32.*CPU 32, GPU 8"):
        placement(ServeArgs(model="alpa/opt-175b", max_batch_size=8, max_seq_len=1024, num_cpus=2))


def test_gptj_generate_with_a_negative_seed_is_answered():
    """The schemathesis case that once gave a 500: seed -2 (only -1 means 'random' in GPT-API)."""
    gen = fake_generator(num_slots=2, max_seq_len=64)
    try:
        client = TestClient(create_app(gen))
        r = client.post("/generate", json={"prompt": ["a"], "bad_words": [], "do_sample": True,
                                           "max_length": 3, "min_length": 0, "seed": -2})
        assert r.status_code == 200, r.text
        again = client.post("/generate", json={"prompt": ["a"], "bad_words": [], "do_sample": True,
                                               "max_length": 3, "min_length": 0, "seed": -2})
        assert r.json()["gen_text"] == again.json()["gen_text"]
    finally:
        gen.close()


# ---------------------------------------------------------------- vLLM's extensions on /v1/completions
# The fake continues "a" (ids 2, 101) greedily with b, c, d, ... ("d" is id 104); after id 257 come 258, 259,
# 0, 1 and then 2 = </s> (EOS).
def test_stop_token_ids_end_the_completion_and_include_stop_str_in_output_keeps_them(client):
    r = post(client, {"prompt": "a", "max_tokens": 10, "temperature": 0, "stop_token_ids": [104]})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("bc", "stop", 3)
    r = post(client, {"prompt": "a", "max_tokens": 10, "temperature": 0, "stop_token_ids": [104],
                      "include_stop_str_in_output": True, "logprobs": 0})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["logprobs"]["tokens"]) == ("bcd", ["b", "c", "d"])
    r = post(client, {"prompt": "a", "max_tokens": 10, "temperature": 0, "stop": ["x", "de"],
                      "include_stop_str_in_output": True})
    assert r.json()["choices"][0]["text"] == "bcde"  # the stop string that ended it, kept


def test_ignore_eos_and_min_tokens_fix_the_output_length(client):
    eos_at_5 = {"prompt": [2, 257], "max_tokens": 10, "temperature": 0}
    r = post(client, eos_at_5)
    assert (r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("stop", 5)
    for extra in ({"ignore_eos": True}, {"min_tokens": 5}):
        r = post(client, {**eos_at_5, **extra})
        assert (r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("length", 10)


def test_skip_special_tokens_false_writes_them_into_the_text(client):
    body = {"prompt": [2, 259], "max_tokens": 3, "temperature": 0, "ignore_eos": True}  # then ids 0, 1, 2
    assert post(client, body).json()["choices"][0]["text"] == ""
    r = post(client, {**body, "skip_special_tokens": False})
    assert r.json()["choices"][0]["text"] == "<s><pad></s>"


def test_top_k_and_repetition_penalty_reach_the_engine(client, gen):
    """What they do to the tokens is checked on the real tiny model (test_service_tiny.py)."""
    seen = gen.engine.model.inserted_settings
    r = post(client, {"prompt": "a", "max_tokens": 2, "top_k": 7, "repetition_penalty": 1.3, "seed": 1, "min_p": 0.2})
    assert r.status_code == 200 and (seen[-1].top_k, seen[-1].repetition_penalty) == (7, pytest.approx(1.3))
    assert seen[-1].min_p == pytest.approx(0.2)
    post(client, {"prompt": "a", "max_tokens": 2, "top_k": -1})  # vLLM's "off"
    assert seen[-1].top_k == 0


@pytest.mark.parametrize("body, param, fragment", [
    ({"logprobs": 6}, "logprobs", "at most 5"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"top_k": -2}, "top_k", ""),
    ({"repetition_penalty": 0}, "repetition_penalty", ""),
    ({"min_tokens": 17}, "min_tokens", "max_tokens"),
    ({"stop_token_ids": [5000]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": [104], "min_tokens": 2}, "stop_token_ids", "only one stop token"),
])
def test_extensions_that_cannot_be_honoured_are_400_naming_the_field(client, body, param, fragment):
    r = post(client, {"prompt": "a", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"]


def test_unknown_fields_stay_ignored_and_known_defaults_are_accepted(client):
    r = post(client, {"prompt": "a", "max_tokens": 2, "temperature": 0, "min_p": 0.0, "top_k": 0,
                      "no_such_field": {"x": 1}, "use_beam_search": False})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "bc"

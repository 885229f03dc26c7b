"""service/errors.py: each typed error's HTTP status, error type, code, param and Retry-After, by type alone
(never by its message), directly and through the app."""
import asyncio

import pytest
from fastapi.testclient import TestClient

from opt_serving.engine.scheduler import EngineClosed, QueueFull
from opt_serving.errors import ContextLengthExceeded, InvalidRequest, Overloaded, Unavailable
from opt_serving.runner.types import StageDied
from opt_serving.service.app import create_app
from opt_serving.service.errors import as_http_errors, to_api_error
from opt_serving.text.fake import fake_generator

# (exception, status, type, code, param, Retry-After)
CASES = [
    (InvalidRequest("top_k must be >= 0", param="top_k"), 400, "invalid_request_error", None, "top_k", False),
    (InvalidRequest("no", param="stop", code="bad_stop"), 400, "invalid_request_error", "bad_stop", "stop", False),
    (InvalidRequest("the request as a whole"), 400, "invalid_request_error", None, None, False),
    (ContextLengthExceeded("maximum context length is 64 tokens"), 400, "invalid_request_error",
     "context_length_exceeded", "prompt", False),
    (ContextLengthExceeded("too long", param="max_tokens"), 400, "invalid_request_error",
     "context_length_exceeded", "max_tokens", False),
    # a plain ValueError is still the client's fault, but nothing is guessed from its text
    (ValueError("prompt: max_tokens context length"), 400, "invalid_request_error", None, None, False),
    (Overloaded("queue is full"), 429, "rate_limit_error", "queue_full", None, True),
    (QueueFull("queue is full"), 429, "rate_limit_error", "queue_full", None, True),
    (Unavailable("no model"), 503, "server_error", "unavailable", None, True),
    (EngineClosed("closed"), 503, "server_error", "shutting_down", None, False),
    (StageDied("stage 1 is gone"), 503, "server_error", "stage_died", None, True),
    (TimeoutError(), 504, "timeout_error", "timeout", None, False),
    (asyncio.TimeoutError(), 504, "timeout_error", "timeout", None, False),
]
IDS = [f"{type(c[0]).__name__}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize("exc, status, kind, code, param, retry", CASES, ids=IDS)
def test_each_error_type_maps_to_its_status(exc, status, kind, code, param, retry):
    e = to_api_error(exc)
    assert (e.status, e.type, e.code, e.param) == (status, kind, code, param)
    assert ("Retry-After" in e.headers) == retry
    assert e.json()["error"]["message"]


def test_subclasses_of_the_typed_errors_map_like_their_base():
    class Mine(Unavailable):
        code = "warming_up"

    class Full(Overloaded):
        pass
    assert (to_api_error(Mine("x")).status, to_api_error(Mine("x")).code) == (503, "warming_up")
    assert to_api_error(Full("x")).status == 429


def test_anything_else_is_not_mapped_and_stays_a_bug():
    assert to_api_error(RuntimeError("context length prompt")) is None
    assert to_api_error(KeyError("prompt")) is None
    with pytest.raises(RuntimeError):
        with as_http_errors():
            raise RuntimeError("boom")


def test_an_error_inside_an_exception_group_is_mapped():
    with pytest.raises(Exception) as info:
        with as_http_errors():
            raise ExceptionGroup("tasks", [QueueFull("full")])
    assert info.value.status == 429


@pytest.fixture
def gen():
    g = fake_generator(num_slots=2, max_seq_len=64, max_queue=4)
    yield g
    g.close()


@pytest.mark.parametrize("exc, status, kind, code, param, retry", CASES, ids=IDS)
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
    ("/completions", {"prompt": "a", "max_tokens": 2}),
    ("/generate", {"prompt": ["a"], "max_length": 2, "min_length": 0}),
])
def test_a_refusal_from_the_generator_is_answered_the_same_by_every_api(gen, monkeypatch, path, body, exc, status,
                                                                        kind, code, param, retry):
    def refuse(prompt, params):
        raise exc
    monkeypatch.setattr(gen, "prepare", refuse)
    with TestClient(create_app(gen)) as client:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": kind, "param": param,
                                 "code": code}
    assert ("retry-after" in r.headers) == retry


def test_a_bug_is_a_500_that_names_only_the_exception_type(gen, monkeypatch):
    def broken(prompt, params):
        raise KeyError("secret detail")
    monkeypatch.setattr(gen, "prepare", broken)
    with TestClient(create_app(gen), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "secret" not in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/completions", {"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format"),
    ("/generate", {"prompt": ["a"], "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", ""]}, "stop"),
    ("/completions", {"prompt": "a", "n": 3, "best_of": 2}, "best_of"),
    ("/generate", {"prompt": ["a"], "min_length": 9, "max_length": 3}, "min_length"),
    ("/generate", {"prompt": ["a"], "penalty_alpha": 0.5}, "penalty_alpha"),
])
def test_a_request_models_own_checks_name_their_field(gen, path, body, param):
    with TestClient(create_app(gen)) as client:
        r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

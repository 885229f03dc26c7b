"""Oversized input is refused before it costs anything: a body over the limit is a 413 without being read, a
prompt text longer than any tokenisation of it could fit is a 400 without being tokenised, and tokenising runs
off the event loop, so a request being tokenised never holds up another one."""
import asyncio
import json
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from opt_serving.service.app import create_app
from opt_serving.service.testserver import serve_in_thread
from opt_serving.testing.fake_engine import fake_generator


@pytest.fixture
def gen():
    g = fake_generator(num_slots=4, max_seq_len=64, max_queue=16)
    yield g
    g.close()


def asgi_call(app, body: bytes, headers: list) -> tuple[int, dict]:
    """One POST straight into the ASGI app; the body may be read only through `receive`."""
    reads, sent = [], []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    return status, {"reads": len(reads), **payload}


def test_a_body_over_the_limit_is_413_without_being_read(gen):
    app = create_app(gen, max_body_bytes=1000)
    body = json.dumps({"prompt": "x" * 2000}).encode()
    status, answer = asgi_call(app, body, [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode())])
    assert status == 413 and answer["reads"] == 0
    assert "limit of 1000 bytes (max_body_bytes)" in answer["error"]["message"]


def test_a_chunked_body_is_counted_as_it_arrives(gen):
    with TestClient(create_app(gen, max_body_bytes=1000)) as client:
        chunks = [b'{"prompt": "', b"x" * 600, b"x" * 600, b'"}']
        r = client.post("/v1/completions", content=iter(chunks), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "bc"  # under the limit: served


def test_a_prompt_too_long_for_any_tokenisation_is_refused_without_tokenising(gen, monkeypatch):
    # the byte tokenizer's longest token spells 5 characters ("<pad>"): with 64 - 16 = 48 tokens of room,
    # more than 240 characters cannot fit whatever they tokenise to
    assert gen.max_token_chars == 5

    def no_tokenising(text):
        raise AssertionError("tokenised")
    with TestClient(create_app(gen)) as client:
        monkeypatch.setattr(gen, "encode", no_tokenising)
        r = client.post("/v1/completions", json={"prompt": "x" * 241})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
        assert "241 characters" in err["message"] and "not tokenised" in err["message"]
        monkeypatch.undo()
        r = client.post("/v1/completions", json={"prompt": "x" * 240})  # could fit: tokenised, then refused
        assert r.status_code == 400 and "has 241 tokens" in r.json()["error"]["message"]


def test_tokenising_a_prompt_does_not_hold_up_other_requests(gen):
    """A prompt whose tokenising blocks (as megabytes of text would) while another request is answered."""
    inside, release = threading.Event(), threading.Event()
    encode = gen.encode

    def slow_encode(text):
        if text.startswith("SLOW"):
            inside.set()
            assert release.wait(30)
        return encode(text)
    gen.encode = slow_encode
    with serve_in_thread(create_app(gen)) as url:
        slow = {}
        t = threading.Thread(target=lambda: slow.update(r=httpx.post(
            url + "/v1/completions", json={"prompt": "SLOW", "max_tokens": 1, "temperature": 0}, timeout=30)))
        t.start()
        try:
            assert inside.wait(10)
            r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 0},
                           timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "bc"
            assert not slow  # still being tokenised all along
        finally:
            release.set()
            t.join(30)
    assert slow["r"].status_code == 200

"""Oversized input is refused before it costs anything: a body over the limit is a 413 sent before the body is
read (which is then discarded unparsed, so every client reads the status), a prompt text longer than any
tokenisation of it could fit is a 400 without being tokenised, and tokenising runs off the event loop, so a
request being tokenised never holds up another one."""
import asyncio
import http.client
import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request

import httpx
import pytest
from fastapi.testclient import TestClient

from opt_serving.service.app import create_app
from opt_serving.service.limits import DrainUnreadBody
from opt_serving.service.testserver import serve_in_thread
from opt_serving.text.fake import fake_generator


@pytest.fixture
def gen():
    g = fake_generator(num_slots=4, max_seq_len=64, max_queue=16)
    yield g
    g.close()


def asgi_call(app, body: bytes, headers: list) -> tuple[int, dict]:
    """One POST straight into the ASGI app; the body may be read only through `receive`, in one message.
    Returns the status and the answer, with `events`: what happened in order ("read", "start", "body",
    "end": the last body message)."""
    events, sent = [], []

    async def receive():
        events.append("read")
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)
        last = message["type"] == "http.response.body" and not message.get("more_body", False)
        events.append("end" if last else message["type"].split(".")[-1])
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    return status, {"events": events, **payload}


def test_a_body_over_the_limit_is_answered_413_before_it_is_read_then_discarded(gen):
    app = create_app(gen, max_body_bytes=1000)
    body = json.dumps({"prompt": "x" * 2000}).encode()
    status, answer = asgi_call(app, body, [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode())])
    assert status == 413 and "limit of 1000 bytes (max_body_bytes)" in answer["error"]["message"]
    # the whole answer first, then the body read (and dropped), then the response finished
    assert answer["events"] == ["start", "body", "read", "end"]


def test_a_client_waiting_for_100_continue_is_refused_without_reading(gen):
    """It sends no body after a refusal; reading would make uvicorn send "100 Continue" after the 413."""
    body = json.dumps({"prompt": "x" * 2000}).encode()
    status, answer = asgi_call(create_app(gen, max_body_bytes=1000), body,
                               [(b"content-length", str(len(body)).encode()), (b"expect", b"100-continue")])
    assert status == 413 and answer["events"] == ["start", "end"]


async def _answer_early(scope, receive, send):
    """An app that answers without reading the body."""
    await send({"type": "http.response.start", "status": 401, "headers": []})
    await send({"type": "http.response.body", "body": b"no", "more_body": False})


@pytest.mark.parametrize("endless", ["bytes", "silence"])
def test_draining_an_unread_body_is_bounded(endless):
    """A client that never stops sending, or stops without ending its body: the drain gives up at its byte
    or idle bound and the response is finished all the same (the server then closes the connection)."""
    reads, sent = [], []

    async def receive():
        reads.append(1)
        if endless == "silence" and len(reads) > 1:
            await asyncio.Event().wait()
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "headers": [(b"transfer-encoding", b"chunked")]}
    asyncio.run(asyncio.wait_for(DrainUnreadBody(_answer_early, max_bytes=10_000, idle_s=0.05)(scope, receive, send),
                                 10))
    assert len(reads) == (11 if endless == "bytes" else 2)  # 11: past the 10 000 bytes, then no more
    assert [m.get("more_body", False) for m in sent[1:]] == [True, False] and sent[1]["body"] == b"no"


def test_a_read_that_fails_mid_stream_is_a_disconnect_not_a_500():
    """Behind Serve's proxy, receive() calls the proxy actor; when the proxy dies it raises. The streaming
    response's disconnect watch then failed with a 500 and a traceback; now the stream is cancelled as for a
    client that left, and its engine request with it. (The engine is not running: the request waits in its
    queue, so nothing but the cancellation can end the stream.)"""
    g = fake_generator(num_slots=1, max_seq_len=64, max_queue=4, start=False)
    body = json.dumps({"prompt": "a", "max_tokens": 8, "stream": True}).encode()
    sent, reads = [], []

    async def receive():
        reads.append(1)
        if len(reads) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        raise RuntimeError("ActorDiedError: the proxy died")

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    try:
        asyncio.run(asyncio.wait_for(create_app(g)(scope, receive, send), 30))
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]  # no 500 after it
        assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)  # cut short, not finished
        assert g.stats()["queue_length"] == 0  # its engine request was cancelled
    finally:
        g.close()


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


# Early refusals through every client a user might have. urllib and http.client send the whole body before they
# read: when the server closed with the body unread they saw "Connection reset by peer", not the status.
BIG = 20_000_000  # 20 MB of JSON: far past what the kernel's socket buffers hold (a few MB on loopback)


def _urllib(url: str, body: bytes, headers: dict) -> int:
    try:
        return urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=60).status
    except urllib.error.HTTPError as e:
        return e.code


def _http_client(url: str, body: bytes, headers: dict) -> int:
    host, path = url.removeprefix("http://").split("/", 1)
    conn = http.client.HTTPConnection(host, timeout=60)
    try:
        conn.request("POST", "/" + path, body=body, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def _requests(url: str, body: bytes, headers: dict) -> int:
    import requests
    return requests.post(url, data=body, headers=headers, timeout=60).status_code


def _httpx(url: str, body: bytes, headers: dict) -> int:
    return httpx.post(url, content=body, headers=headers, timeout=60).status_code


def _curl(url: str, body: bytes, headers: dict) -> int:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    args = [a for k, v in headers.items() for a in ("-H", f"{k}: {v}")]
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *args, "--data-binary", "@-", url],
                         input=body, capture_output=True, timeout=60)
    return int(out.stdout)


def _openai(url: str, body: bytes, headers: dict) -> int:
    openai = pytest.importorskip("openai")
    base, route = url.rsplit("/v1/", 1)
    assert route == "completions"
    client = openai.OpenAI(base_url=base + "/v1", api_key=headers["authorization"].split()[-1], max_retries=0)
    fields = json.loads(body)
    try:
        client.completions.create(model=fields.pop("model"), prompt=fields.pop("prompt"), extra_body=fields)
    except openai.APIStatusError as e:
        return e.status_code
    return 200


CLIENTS = {"urllib": _urllib, "http.client": _http_client, "requests": _requests, "httpx": _httpx,
           "curl": _curl, "openai": _openai}


@pytest.fixture(scope="module")
def refusing_server():
    """The app behind uvicorn (as Serve runs it) with an API key and a 10 MB body limit, over an engine that is
    not running, its queue of one already full: every kind of early answer can be had."""
    from opt_serving.engine.scheduler import SlotSettings
    g = fake_generator(num_slots=1, max_seq_len=64, max_queue=1, start=False)
    g.engine.submit([1, 2, 3], SlotSettings(max_tokens=2), lambda out: None)  # never served: the queue is full
    with serve_in_thread(create_app(g, api_keys=["key"], max_body_bytes=10_000_000)) as url:
        yield url
    g.close()


def _refusal(kind: str, url: str) -> tuple[str, bytes, dict, int]:
    """(url, body, headers, expected status) of one kind of refusal, each with a body of 8 MB or more."""
    headers = {"content-type": "application/json", "authorization": "Bearer key"}
    if kind == "413":  # over the limit: answered from Content-Length, the body unread
        big = {"model": "opt-fake", "prompt": "x" * BIG, "max_tokens": 2}
        return url + "/v1/completions", json.dumps(big).encode(), headers, 413
    under = json.dumps({"model": "opt-fake", "prompt": "y" * 8_000_000, "max_tokens": 2}).encode()
    if kind == "401":
        return url + "/v1/completions", under, {**headers, "authorization": "Bearer wrong"}, 401
    if kind == "405":  # a route that takes no body: nothing reads it
        return url + "/v1/models", under, headers, 405
    assert kind == "429"  # a prompt that fits, a long `user` field to make the body large
    full = {"model": "opt-fake", "prompt": "a" * 10, "max_tokens": 2, "user": "z" * 8_000_000}
    return url + "/v1/completions", json.dumps(full).encode(), headers, 429


@pytest.mark.parametrize("kind", ["413", "401", "405", "429"])
@pytest.mark.parametrize("client", list(CLIENTS))
def test_every_client_reads_an_early_refusal_as_its_status(refusing_server, client, kind):
    if client == "openai" and kind == "405":
        pytest.skip("the openai client chooses its routes itself")
    target, body, headers, expected = _refusal(kind, refusing_server)
    assert CLIENTS[client](target, body, headers) == expected

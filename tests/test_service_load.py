"""Load and faults over a real HTTP server (uvicorn on 127.0.0.1 in a thread) and the fake engine: 64 concurrent
streaming clients share decode steps; a client that disconnects frees its slot within a step. The same load on
the real tiny model is in tests/test_service_tiny.py."""
import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest

from opt_serving.engine.scheduler import Engine
from opt_serving.text.generator import Generator
from opt_serving.service.app import create_app
from opt_serving.service.testserver import serve_in_thread
from opt_serving.engine.fake import GatedSlots
from opt_serving.text.fake import byte_tokenizer, fake_generator


def wait_for(cond, what: str, timeout: float = 20.0):
    """Poll a condition another thread will make true (with a deadline so a bug fails instead of hanging)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str]:
    text, finish = "", None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def test_64_concurrent_streaming_clients_share_decode_steps():
    # The engine starts only once all 64 requests wait in its queue, so batching is certain, not a race.
    g = fake_generator(num_slots=16, max_seq_len=64, max_queue=64, start=False)
    prompts = [f"q{i:02d}" for i in range(64)]
    lengths = [8 + i % 5 for i in range(64)]   # requests leave at different steps and others take their slots
    expected = ["".join(chr(ord(p[-1]) + k) for k in range(1, n + 1)) for p, n in zip(prompts, lengths)]
    try:
        with serve_in_thread(create_app(g)) as url:
            async def main():
                limits = httpx.Limits(max_connections=100)
                async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                    tasks = [asyncio.create_task(stream_one(client, p, n)) for p, n in zip(prompts, lengths)]
                    while g.stats()["queue_length"] < 64:  # condition poll, bounded by the tasks' own timeout
                        done = [t for t in tasks if t.done()]
                        if done:
                            done[0].result()
                        await asyncio.sleep(0.01)
                    g.engine.start()
                    results = await asyncio.gather(*tasks)
                    metrics = (await client.get("/metrics")).text
                return results, metrics

            results, metrics = asyncio.run(main())
        assert [t for t, _ in results] == expected
        assert all(f == "length" for _, f in results)
        steps = metric(metrics, "opt_serving_decode_steps_total")
        assert metric(metrics, "opt_serving_mean_requests_per_decode_step") > 1
        assert steps < sum(lengths) / 4  # 16 slots: far fewer steps than tokens
        assert metric(metrics, "opt_serving_generation_tokens_total") == sum(lengths)
        assert metric(metrics, "opt_serving_running_slots") == 0
        assert metric(metrics, "opt_serving_time_to_first_token_seconds_count") == 64
    finally:
        g.close()


@pytest.fixture
def gated():
    slots = GatedSlots(num_slots=2, max_seq_len=64)
    engine = Engine(slots, max_queue=4)
    g = Generator(engine, byte_tokenizer(), model_name="opt-fake")
    cancelled = threading.Event()
    original = engine.cancel

    def cancel(req):
        cancelled.set()
        original(req)
    engine.cancel = cancel
    yield g, slots, cancelled
    for _ in range(100):   # let a blocked step finish so close() can join the thread
        slots.gate.release()
    g.close()


def test_client_disconnecting_mid_stream_frees_its_slot_within_a_step(gated):
    g, slots, cancelled = gated
    with serve_in_thread(create_app(g)) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            body = {"prompt": "a", "max_tokens": 50, "temperature": 0, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"] == "b"  # prefill's token, no step yet
                slots.gate.release()  # one decode step
                second = next(line for line in lines if line.startswith("data: "))
                assert json.loads(second[6:])["choices"][0]["text"] == "c"
                assert g.stats()["running"] == 1
            # leaving the block closes the connection mid-stream
            wait_for(cancelled.is_set, "the server to cancel the request")
            steps_before = slots.steps
            slots.gate.release()  # the step already waiting; after it the slot must be free
            wait_for(lambda: g.stats()["running"] == 0, "the slot to be freed")
            assert slots.steps == steps_before + 1


def test_client_disconnecting_from_a_plain_request_frees_its_slot(gated):
    g, slots, cancelled = gated
    with serve_in_thread(create_app(g)) as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "a", "max_tokens": 50, "temperature": 0}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: g.stats()["running"] == 1, "the request to take a slot")
        sock.close()
        wait_for(cancelled.is_set, "the server to cancel the request")
        slots.gate.release()
        wait_for(lambda: g.stats()["running"] == 0, "the slot to be freed")

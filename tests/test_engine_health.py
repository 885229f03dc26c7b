"""Engine.check_health (what /health and Ray Serve's replica health check ask): a dead engine thread, a busy
engine whose prefill or step has not finished in `health_stall_s`, and the slot model's own check are all
unhealthy; an idle engine is healthy however long it idles. Time is moved on by hand, never slept."""
import threading

import pytest
from fastapi.testclient import TestClient

from opt_serving.engine.scheduler import Engine, EngineClosed, SlotSettings
from opt_serving.text.generator import Generator
from opt_serving.service.app import create_app
from opt_serving.engine.fake import FakeBeamModel, FakeSlots, GatedSlots
from opt_serving.text.fake import byte_tokenizer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SignalledSlots(GatedSlots):
    """GatedSlots that say when a decode step has begun (so the prefill before it has finished)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.stepping = threading.Event()

    def step(self):
        self.stepping.set()
        return super().step()


def gated_engine(stall_s: float = 10.0):
    eng = Engine(SignalledSlots(num_slots=2, max_seq_len=64), max_queue=4, start=False, health_stall_s=stall_s)
    eng._clock = Clock()
    eng.start()
    return eng


def test_idle_engine_is_healthy_however_long_it_idles():
    eng = gated_engine()
    try:
        eng._clock.now += 10_000
        eng.check_health()
    finally:
        eng.close()


def test_a_step_stuck_past_the_bound_is_unhealthy_until_it_finishes():
    eng = gated_engine(stall_s=10)
    done = threading.Event()
    try:
        eng._clock.now += 500  # idle before the request: not counted
        eng.submit([2, 101], SlotSettings(max_tokens=2), lambda out: done.set() if out.finish_reason else None)
        assert eng.model.stepping.wait(10)  # prefilled; the engine now waits inside its first step
        eng._clock.now += 9
        eng.check_health()  # within the bound
        eng._clock.now += 2
        with pytest.raises(RuntimeError, match=r"engine stalled: no prefill or decode step finished in 11 s "
                                               r"\(limit 10 s\) with 0 queued and 1 running"):
            eng.check_health()
        eng.model.gate.release(1)  # the step finishes, and with it the request (max_tokens=2)
        assert done.wait(10)
        eng.check_health()
    finally:
        eng.close()


def test_a_dead_engine_thread_is_unhealthy_and_fails_what_waits():
    eng = Engine(FakeSlots(num_slots=2, max_seq_len=64), max_queue=4, start=False)

    def broken_loop():
        raise MemoryError("device lost")
    eng._run = broken_loop
    got = []
    eng.submit([2, 101], SlotSettings(max_tokens=2), got.append)  # queued before the thread starts
    eng.start()
    eng._thread.join(10)
    with pytest.raises(RuntimeError, match=r"engine thread died: MemoryError\('device lost'\)"):
        eng.check_health()
    assert isinstance(got[0].error, EngineClosed)  # the waiting request is told, not left hanging
    with pytest.raises(EngineClosed, match="died"):
        eng.submit([2, 101], SlotSettings(max_tokens=2), got.append)


def test_never_started_and_closed_engines_are_unhealthy():
    eng = Engine(FakeSlots(), start=False)
    with pytest.raises(RuntimeError, match="never started"):
        eng.check_health()
    eng.start()
    eng.check_health()
    eng.close()
    with pytest.raises(RuntimeError, match="not running"):
        eng.check_health()


class DeadStage(FakeSlots):
    """A slot model with its own health check (a pipeline whose stage actor died)."""

    def check_health(self):
        raise RuntimeError("pipeline stage 2 is dead")


def test_the_slot_models_own_check_is_asked():
    eng = Engine(DeadStage())
    try:
        with pytest.raises(RuntimeError, match="stage 2 is dead"):
            eng.check_health()
    finally:
        eng.close()


def test_health_route_answers_503_with_the_reason_when_unhealthy():
    eng = gated_engine(stall_s=10)
    gen = Generator(eng, byte_tokenizer(), model_name="opt-fake", model=FakeBeamModel())
    try:
        with TestClient(create_app(gen)) as client:
            assert client.get("/health").json() == {"status": "ok", "model": "opt-fake"}
            eng.submit([2, 101], SlotSettings(max_tokens=2), lambda out: None)
            assert eng.model.stepping.wait(10)
            eng._clock.now += 60
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unhealthy"
            assert r.json()["reason"].startswith("engine stalled: no prefill or decode step finished in 60 s")
            eng.model.gate.release(1)
    finally:
        gen.close()
    with pytest.raises(RuntimeError, match="generator closed"):
        gen.check_health()


def test_serves_replica_check_fails_with_the_engine():
    """The deployment's own health check (what Serve polls to replace a replica) asks the generator."""
    import types

    from opt_serving.service.deployment import build_app
    replica_class = build_app({})._bound_deployment.func_or_class
    eng = gated_engine(stall_s=10)
    gen = Generator(eng, byte_tokenizer(), model_name="opt-fake", model=FakeBeamModel())
    replica = types.SimpleNamespace(generator=gen)
    try:
        replica_class.check_health(replica)  # idle: healthy
        eng.submit([2, 101], SlotSettings(max_tokens=2), lambda out: None)
        assert eng.model.stepping.wait(10)
        eng._clock.now += 60
        with pytest.raises(RuntimeError, match="engine stalled"):
            replica_class.check_health(replica)
        eng.model.gate.release(1)
    finally:
        gen.close()
    with pytest.raises(RuntimeError, match="generator closed"):
        replica_class.check_health(replica)

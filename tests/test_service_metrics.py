"""metrics.py: per-request latencies and token counts, engine state read from stats() at scrape time."""
import dataclasses
import re

import pytest
from fastapi.testclient import TestClient

from opt_serving.service.app import create_app
from opt_serving.service.metrics import ServiceMetrics
from opt_serving.text.fake import fake_generator


def value(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{sample} missing"
    return float(m.group(1))


def render(m: ServiceMetrics) -> str:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    return body.decode()


def test_engine_stats_become_gauges_counters_and_a_mean_batch():
    m = ServiceMetrics(lambda: {"queue_length": 3, "running": 2, "num_slots": 8, "steps": 4, "step_tokens": 10})
    text = render(m)
    assert value(text, "opt_serving_queue_length") == 3
    assert value(text, "opt_serving_running_slots") == 2
    assert value(text, "opt_serving_decode_steps_total") == 4
    assert value(text, "opt_serving_mean_requests_per_decode_step") == 2.5


def test_prefix_cache_hits_queries_and_hit_rate():
    """The engine's prompt tokens and cached ones become vLLM's prefix_cache_queries / prefix_cache_hits
    counters (in tokens) and their ratio a gauge; no prompt yet: a rate of 0, not a division by zero."""
    text = render(ServiceMetrics(lambda: {"prompt_tokens": 400, "cached_tokens": 300}))
    assert value(text, "opt_serving_prefix_cache_queries_total") == 400
    assert value(text, "opt_serving_prefix_cache_hits_total") == 300
    assert value(text, "opt_serving_prefix_cache_hit_rate") == 0.75
    assert value(render(ServiceMetrics(lambda: {"prompt_tokens": 0, "cached_tokens": 0})),
                 "opt_serving_prefix_cache_hit_rate") == 0


def test_dataclass_stats_and_a_requests_per_step_histogram():
    @dataclasses.dataclass
    class Stats:
        steps: int = 4
        step_tokens: int = 10
        active_per_step: dict = dataclasses.field(default_factory=lambda: {1: 2, 4: 2})

    text = render(ServiceMetrics(Stats))
    assert value(text, 'opt_serving_requests_per_decode_step_bucket{le="1.0"}') == 2
    assert value(text, 'opt_serving_requests_per_decode_step_bucket{le="3.0"}') == 2
    assert value(text, 'opt_serving_requests_per_decode_step_bucket{le="4.0"}') == 4
    assert value(text, "opt_serving_requests_per_decode_step_sum") == 10


def test_where_the_engines_time_goes_becomes_counters_histograms_and_the_models_costs():
    """The engine's seconds and tokens in prefill passes and decode steps become counters, its waits histograms
    (cumulative buckets of Durations), the slot model's costs a token gauges."""
    from opt_serving.engine.types import Durations
    wait = Durations()
    for s in (0.003, 0.2, 0.2, 7.0):
        wait.observe(s)
    stats = {"prefill_s": 1.5, "prefill_passes": 3, "computed_tokens": 900, "joined_tokens": 40, "decode_s": 2.0,
             "decode_kv_entries": 5000, "queue_wait": dataclasses.asdict(wait),
             "decode_gap": dataclasses.asdict(Durations()),
             "costs": {"dense_flops": 1e8, "head_flops": 7e7, "weight_bytes": 5e8, "kv_entry_bytes": 7.4e4}}
    text = render(ServiceMetrics(lambda: stats))
    assert value(text, "opt_serving_prefill_seconds_total") == 1.5
    assert value(text, "opt_serving_prefill_computed_tokens_total") == 900
    assert value(text, "opt_serving_joined_prompt_tokens_total") == 40
    assert value(text, "opt_serving_decode_kv_entries_total") == 5000
    assert value(text, 'opt_serving_queue_wait_seconds_bucket{le="0.005"}') == 1
    assert value(text, 'opt_serving_queue_wait_seconds_bucket{le="0.25"}') == 3
    assert value(text, 'opt_serving_queue_wait_seconds_bucket{le="+Inf"}') == 4
    assert value(text, "opt_serving_queue_wait_seconds_sum") == pytest.approx(7.403)
    assert value(text, "opt_serving_decode_gap_seconds_count") == 0
    assert value(text, "opt_serving_model_weight_bytes") == 5e8
    assert wait.quantile(0.5) == 0.25 and wait.quantile(0.99) == 10.0


def engine_stats(**kw):
    """An EngineStats as the engine hands it out, `kw` over a few steps' counts."""
    from opt_serving.engine.types import EngineStats
    base = dict(queue_length=0, running=2, num_slots=4, steps=10, step_calls=5, step_tokens=32, prefills=2,
                joined=0, generated_tokens=34, prompt_tokens=16, cached_tokens=0, last_step_batch=2,
                active_per_step={2: 10})
    return EngineStats(**{**base, **kw})


SPEC = {"drafts": "opt_serving_spec_decode_num_drafts_total",
        "draft_tokens": "opt_serving_spec_decode_num_draft_tokens_total",
        "accepted": "opt_serving_spec_decode_num_accepted_tokens_total",
        "length": "opt_serving_spec_decode_mean_acceptance_length"}


def test_speculative_decoding_counters_and_the_mean_acceptance_length():
    """EngineStats' spec_* running totals become vLLM's spec_decode counters, and 1 + accepted / drafts the mean
    acceptance length gauge (EngineStats.mean_acceptance_length), from the dataclass and from the generator's
    dict of it alike."""
    stats = engine_stats(spec_drafts=8, spec_draft_tokens=30, spec_accepted_tokens=12)
    for source in (lambda: stats, lambda: {**dataclasses.asdict(stats), "tokens_per_step": stats.tokens_per_step}):
        text = render(ServiceMetrics(source))
        assert [value(text, SPEC[k]) for k in ("drafts", "draft_tokens", "accepted")] == [8, 30, 12]
        assert value(text, SPEC["length"]) == stats.mean_acceptance_length == 2.5
        assert "# TYPE opt_serving_spec_decode_num_drafts_total counter" in text
        assert "# TYPE opt_serving_spec_decode_mean_acceptance_length gauge" in text


def test_speculative_decoding_metrics_before_any_draft_are_zero():
    """No speculation (or none yet): counters at 0 and a mean acceptance length of 0, not a division by zero; a
    stats source without the fields (an older engine's dict) gives no spec_decode metric at all."""
    stats = engine_stats()
    text = render(ServiceMetrics(lambda: stats))
    assert [value(text, SPEC[k]) for k in SPEC] == [0, 0, 0, 0] and stats.mean_acceptance_length == 0.0
    assert "spec_decode" not in render(ServiceMetrics(lambda: {"steps": 4, "step_tokens": 10}))


def test_batch_buckets_are_fixed_by_the_slot_count():
    from opt_serving.service.metrics import _batch_buckets
    assert _batch_buckets(4) == [1, 2, 3, 4]
    assert _batch_buckets(100) == list(range(1, 17)) + [32, 64, 100]


def test_requests_per_step_histogram_from_the_engine():
    import asyncio
    from opt_serving.text.generator import SamplingParams
    g = fake_generator(num_slots=4, max_seq_len=64, start=False)  # queue all four before the first step

    async def main():
        streams = [g.stream(p, SamplingParams(max_tokens=3, temperature=0)) for p in "abcd"]
        g.engine.start()
        return [[d async for d in s] for s in streams]
    try:
        asyncio.run(main())
        text = render(ServiceMetrics(g.stats))
    finally:
        g.close()
    # the first token of each comes from its prefill; the other two from two steps over all four slots
    assert value(text, 'opt_serving_requests_per_decode_step_bucket{le="3.0"}') == 0
    assert value(text, 'opt_serving_requests_per_decode_step_bucket{le="4.0"}') == 2
    assert value(text, "opt_serving_requests_per_decode_step_count") == value(text, "opt_serving_decode_steps_total")
    assert value(text, "opt_serving_requests_per_decode_step_sum") == 8


def test_a_broken_stats_function_does_not_break_the_scrape():
    def broken():
        raise RuntimeError("engine gone")
    text = render(ServiceMetrics(broken))
    assert "opt_serving_generation_tokens_total 0.0" in text and "queue_length" not in text


def test_timer_first_token_then_inter_token_gaps_per_stream():
    m = ServiceMetrics()
    t = m.timer("completions")
    t.tokens(1, stream=0)   # first token of choice 0 -> TTFT
    t.tokens(1, stream=1)   # first token of choice 1 -> TTFT
    t.tokens(3, stream=0)   # three tokens arriving together -> three inter-token gaps
    t.tokens(0, stream=0)   # nothing arrived: nothing observed
    t.finish(prompt_tokens=7)
    t.finish(prompt_tokens=7)  # idempotent
    text = render(m)
    assert value(text, "opt_serving_time_to_first_token_seconds_count") == 2
    assert value(text, "opt_serving_inter_token_latency_seconds_count") == 3
    assert value(text, "opt_serving_generation_tokens_total") == 5
    assert value(text, "opt_serving_prompt_tokens_total") == 7
    assert value(text, 'opt_serving_e2e_request_latency_seconds_count{endpoint="completions"}') == 1


@pytest.fixture
def client():
    g = fake_generator(num_slots=4, max_seq_len=64)
    with TestClient(create_app(g)) as c:
        yield c
    g.close()


def test_metrics_endpoint_counts_what_the_api_served(client):
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5, "temperature": 0})
    client.post("/v1/completions", json={"prompt": ["ab", "c"], "max_tokens": 3, "temperature": 0, "stream": True})
    client.post("/generate", json={"prompt": ["a"], "max_length": 2, "min_length": 0, "do_sample": False})
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": -1})  # rejected before the engine
    text = client.get("/metrics").text
    assert value(text, "opt_serving_generation_tokens_total") == 5 + 3 + 3 + 2
    assert value(text, "opt_serving_prompt_tokens_total") == 2 + 3 + 2 + 2
    assert value(text, 'opt_serving_requests_total{endpoint="completions",status="200"}') == 2
    assert value(text, 'opt_serving_requests_total{endpoint="generate",status="200"}') == 1
    assert value(text, 'opt_serving_e2e_request_latency_seconds_count{endpoint="completions"}') == 2
    assert value(text, "opt_serving_running_slots") == 0
    assert value(text, "opt_serving_decode_steps_total") >= 1
    # the fake engine does not speculate: its spec_decode metrics are there, at 0
    assert value(text, "opt_serving_spec_decode_num_drafts_total") == 0
    assert value(text, "opt_serving_spec_decode_mean_acceptance_length") == 0


def test_rejected_requests_are_counted_by_status(client):
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": -1})
    client.post("/completions", json={"prompt": "a", "max_tokens": 1000})
    text = client.get("/metrics").text
    assert value(text, 'opt_serving_requests_total{endpoint="completions",status="400"}') == 1
    assert value(text, 'opt_serving_requests_total{endpoint="metaseq",status="400"}') == 1

"""Prometheus metrics for `GET /metrics`, and the middleware counting answers per API and status.

Latencies and token counts are observed per request by the HTTP layer; engine state (queue length, running
slots, how many requests share a decode step) is read from `generator.stats()` at scrape time, so it is exact
whenever it is read and costs nothing between scrapes. Each app gets its own registry: several apps (tests)
can live in one process.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from opt_serving.runner.types import acceptance_length

PREFIX = "opt_serving"
disable_created_metrics()  # the *_created series only add noise to every counter and histogram
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _as_dict(stats) -> dict:
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return dict(stats or {})


class _EngineCollector:
    """Turns `generator.stats()` (a dict or dataclass) into metrics when Prometheus scrapes."""
    GAUGES = {"queue_length": ("queue_length", "requests waiting for a decode slot"),
              "running": ("running_slots", "decode slots in use"),
              "num_slots": ("decode_slots", "decode slots in total"),
              "last_step_batch": ("last_step_requests", "requests advanced by the latest decode step")}
    COUNTERS = {"steps": ("decode_steps", "decode steps run"),
                "step_calls": ("decode_calls", "calls of the model that ran decode steps (several steps a call "
                               "while nobody waits for a slot)"),
                "step_tokens": ("decode_step_requests", "requests advanced by decode steps, summed over steps "
                                "(divide by decode_steps for the mean batch)"),
                "prefills": ("prefills", "prompts prefilled"),
                # as vLLM's prefix_cache_queries / prefix_cache_hits: in tokens
                "prompt_tokens": ("prefix_cache_queries", "prompt tokens prefilled (looked up in the prefix cache)"),
                "cached_tokens": ("prefix_cache_hits", "prompt tokens whose KV the prefix cache gave"),
                # where the engine thread's time goes (benchmark/peers/serve_vs_vllm.py reads them against the bounds)
                "prefill_s": ("prefill_seconds", "seconds the engine spent in prefill passes and chunks"),
                "prefill_passes": ("prefill_passes", "prefill calls of the model (a batched pass or one chunk)"),
                "computed_tokens": ("prefill_computed_tokens", "prompt tokens prefill passes computed (past "
                                    "their cached prefixes)"),
                "joined_tokens": ("joined_prompt_tokens", "prompt tokens computed inside decode steps"),
                "decode_s": ("decode_seconds", "seconds the engine spent in decode calls"),
                "decode_kv_entries": ("decode_kv_entries", "KV entries decode steps attended over (rows x "
                                      "context, summed over steps)"),
                # served speculative decoding (--speculative-config), as vLLM's spec_decode_* counters
                "spec_drafts": ("spec_decode_num_drafts", "rows that drafted tokens in a decode step, summed over "
                                "steps"),
                "spec_draft_tokens": ("spec_decode_num_draft_tokens", "tokens drafted (prompt lookup)"),
                "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "drafted tokens the model accepted")}
    DURATIONS = {"queue_wait": ("queue_wait_seconds", "time from a request's arrival to its start: a slot to join "
                                "the decode steps, or its prefill pass"),
                 "prompt_time": ("prompt_seconds", "time from a request's start to its first token: its prompt's "
                                 "computation, beside the other requests'"),
                 "decode_gap": ("decode_gap_seconds", "time from one decode call's start to the next's while "
                                "requests run: their inter-token latency in the engine")}
    COSTS = {"dense_flops": ("model_dense_flops_per_token", "FLOPs of the dense layers a token"),
             "head_flops": ("model_head_flops_per_token", "FLOPs of the LM head a token it is applied to"),
             "weight_bytes": ("model_weight_bytes", "bytes of weights a pass reads once"),
             "kv_entry_bytes": ("model_kv_entry_bytes", "bytes of one KV entry (every layer's k and v)")}

    def __init__(self, stats_fn: Callable[[], object]):
        self.stats_fn = stats_fn

    def collect(self):
        try:
            s = _as_dict(self.stats_fn())
        except Exception:  # a closed or broken engine must not break /metrics
            return
        for key, (name, doc) in self.GAUGES.items():
            if key in s:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(s[key]))
        for key, (name, doc) in self.COUNTERS.items():
            if key in s:
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(s[key]))
        if s.get("steps"):
            yield GaugeMetricFamily(f"{PREFIX}_mean_requests_per_decode_step",
                                    "requests advanced together by one decode step, averaged over all steps",
                                    value=float(s.get("step_tokens", 0)) / float(s["steps"]))
        if "cached_tokens" in s:
            queried = float(s.get("prompt_tokens") or 0)
            yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_hit_rate",
                                    "prompt tokens the prefix cache gave / prompt tokens prefilled, since start",
                                    value=float(s["cached_tokens"]) / queried if queried else 0.0)
        if "spec_drafts" in s:
            yield GaugeMetricFamily(f"{PREFIX}_spec_decode_mean_acceptance_length",
                                    "tokens a drafting row's decode step gave on average, 1 + accepted tokens / "
                                    "drafts, since start (0 before any draft)",
                                    value=acceptance_length(float(s.get("spec_accepted_tokens") or 0),
                                                            float(s["spec_drafts"] or 0)))
        for key, (name, doc) in self.DURATIONS.items():
            d = s.get(key)
            if d:
                cum, buckets = 0, []
                for bound, count in zip(list(d["bounds"]) + ["+Inf"], d["counts"]):
                    cum += count
                    buckets.append((str(float(bound)) if bound != "+Inf" else bound, cum))
                yield HistogramMetricFamily(f"{PREFIX}_{name}", doc, buckets=buckets, sum_value=float(d["total"]))
        for key, (name, doc) in self.COSTS.items():
            if (s.get("costs") or {}).get(key) is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(s["costs"][key]))
        hist = s.get("active_per_step")  # {active slots: number of steps}, when the engine keeps it
        if hist is not None:
            hist = {int(a): int(c) for a, c in hist.items()}
            bounds = _batch_buckets(int(s.get("num_slots") or max(hist, default=1)))
            buckets = [(str(float(b)), sum(c for a, c in hist.items() if a <= b)) for b in bounds]
            buckets.append(("+Inf", sum(hist.values())))
            yield HistogramMetricFamily(f"{PREFIX}_requests_per_decode_step",
                                        "requests (active slots) advanced together by one decode step",
                                        buckets=buckets, sum_value=float(sum(a * c for a, c in hist.items())))


def _batch_buckets(num_slots: int) -> list[int]:
    """Fixed bucket bounds for a batch size (the same at every scrape, as Prometheus expects): every size up
    to 16, then powers of two, then the slot count itself."""
    bounds = set(range(1, min(num_slots, 16) + 1)) | {num_slots}
    b = 32
    while b < num_slots:
        bounds.add(b)
        b *= 2
    return sorted(bounds)


class ServiceMetrics:
    def __init__(self, stats_fn: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "time from request to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "time between successive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "time from request to its last token",
                             ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        if stats_fn is not None:
            r.register(_EngineCollector(stats_fn))

    def timer(self, endpoint: str) -> "RequestTimer":
        return RequestTimer(self, endpoint)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """One request's clock. `tokens(k, stream)` when k new tokens of one of its streams (choices) arrive:
    the first arrival of a stream is its time to first token, later ones give inter-token latencies.
    `finish(prompt_tokens)` once at the end (idempotent) records the end-to-end latency."""

    def __init__(self, metrics: ServiceMetrics, endpoint: str):
        self.m, self.endpoint = metrics, endpoint
        self.start = time.perf_counter()
        self.last: dict[int, float] = {}
        self.finished = False

    def tokens(self, k: int, stream: int = 0) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        last = self.last.get(stream)
        if last is None:
            self.m.ttft.observe(now - self.start)
        else:
            # tokens that arrive together share the gap since the previous arrival
            for _ in range(k):
                self.m.itl.observe((now - last) / k)
        self.last[stream] = now
        self.m.generation_tokens.inc(k)

    def finish(self, prompt_tokens: int = 0) -> None:
        if not self.finished:
            self.finished = True
            self.m.prompt_tokens.inc(prompt_tokens)
            self.m.e2e.labels(self.endpoint).observe(time.perf_counter() - self.start)


class CountRequests:
    """ASGI middleware counting answers per API and status (a pure ASGI wrapper: Starlette's
    BaseHTTPMiddleware would get between a streaming response and the client's disconnect)."""
    ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/completions": "metaseq",
                 "/generate": "generate"}

    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        endpoint = self.ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        status = 499  # nothing was sent: the client went away first

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

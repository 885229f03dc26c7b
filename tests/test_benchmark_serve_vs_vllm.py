"""benchmark/peers/serve_vs_vllm.py: our engine's decode steps read against the machine's bounds from /metrics
counters: the printed bounds (overlapped and in series) and the factor the first leaves (headroom)."""
from __future__ import annotations

import math

import pytest

from benchmark.peers import serve_vs_vllm as svv

P = "opt_serving_"


def metrics(steps: int, seconds: float, rows: int, joined: int, kv_entries: int) -> dict:
    return {P + "model_dense_flops_per_token": 170e6, P + "model_head_flops_per_token": 77e6,
            P + "model_weight_bytes": 500e6, P + "model_kv_entry_bytes": 20_000,
            P + "decode_seconds_total": seconds, P + "decode_steps_total": steps,
            P + "decode_step_requests_total": rows, P + "joined_prompt_tokens_total": joined,
            P + "decode_kv_entries_total": kv_entries}


@pytest.mark.parametrize("joined,kv_entries", [(10_000, 100_000), (0, 5_000_000)])
def test_the_bound_is_the_longer_of_the_steps_flops_at_the_peak_and_their_bytes_at_the_bandwidth(joined, kv_entries):
    before, after = metrics(0, 0.0, 0, 0, 0), metrics(100, 10.0, 3200, joined, kv_entries)
    bounds = {"float32_gflops": 300.0, "bandwidth_gbs": 25.0}
    lines = svv.where_time_goes(before, after, bounds, "float32")
    flops = (3200 + joined) * 170e6 + 3200 * 77e6          # over 100 steps of 100 ms
    reads = 100 * 500e6 + kv_entries * 20_000
    bound_ms = max(1e3 * flops / 100 / 300e9, 1e3 * reads / 100 / 25e9)
    assert math.isclose(svv.headroom(before, after, bounds, "float32"), 100 / bound_ms, rel_tol=0.01)
    assert any(f"takes {bound_ms:.1f} ms" in line for line in lines)
    # in series: the FLOPs at the peak, then the KV attention reads at the bandwidth (never less than all the bytes)
    serial_ms = max(1e3 * flops / 100 / 300e9 + 1e3 * kv_entries * 20_000 / 100 / 25e9, 1e3 * reads / 100 / 25e9)
    assert serial_ms >= bound_ms
    assert any(f"in series: {serial_ms:.1f} ms" in line and f"ours {100 / serial_ms:.2f}x" in line for line in lines)


def test_the_float32_peak_is_the_faster_of_our_product_and_xlas_dot():
    before, after = metrics(0, 0.0, 0, 0, 0), metrics(100, 10.0, 3200, 0, 100_000)
    slower_ours = {"float32_gflops": 100.0, "xla_float32_gflops": 300.0, "bandwidth_gbs": 25.0}
    assert svv.peak_gflops(slower_ours, "float32") == 300.0
    assert svv.headroom(before, after, slower_ours, "float32") == pytest.approx(
        svv.headroom(before, after, {"float32_gflops": 300.0, "bandwidth_gbs": 25.0}, "float32"))
    assert svv.peak_gflops({"float32_gflops": 100.0, "xla_float32_gflops": 300.0, "bfloat16_gflops": 200.0,
                            "bandwidth_gbs": 25.0}, "bfloat16") == 200.0


def test_no_engine_figures_leave_no_headroom():
    assert math.isnan(svv.headroom({}, {}, {"bandwidth_gbs": 25.0}, "float32"))
    assert svv.where_time_goes({}, {}, {"bandwidth_gbs": 25.0}, "float32") == ["  (no engine figures in /metrics)"]

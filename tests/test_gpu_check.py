"""benchmark/gpu_check.sh, the prepared GPU check, rehearsed on the CPU at its smallest: the same script and
sections a GPU run takes, so a lent GPU's minutes go to measuring (benchmark/README.md has the H200's figures)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_the_gpu_check_passes_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": os.environ.get("PYTHON", _python()),
           "GPU_CHECK_REHEARSAL": "1", "GPU_CHECK_SIZES": "tiny", "GPU_CHECK_DTYPES": "float16",
           "GPU_CHECK_BUDGET_S": "1100", "GPU_CHECK_MODEL_CAP_S": "500", "GPU_CHECK_TINY_CAP_S": "500",
           "GPU_CHECK_WEIGHTS": "float int8",
           "GPU_CHECK_ARGS": "--batches 1,2 --new-tokens 4 --prompt-len 8 --logit-len 8 --max-seq-len 32 "
                             "--engine-reps 1 --ttft-batch 3 --ttft-prompt-len 20 --copy-mib 16"}
    r = subprocess.run(["bash", str(ROOT / "benchmark" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert not [row for row in rows if row.get("check") == "stopped"], r.stdout[-3000:]
    tiny = {(row["model"], row["check"]): row for row in rows if row.get("section") == "tiny"}
    for model in ("tiny", "tiny-post-ln"):  # the pre-LN shape and OPT-350m's
        for check in ("greedy_tokens_equal_hf", "beam_tokens_equal_hf", "engine_tokens_equal_generate"):
            assert tiny[(model, check)]["ok"] is True, (model, check)
    logits = {row.get("quantize"): row for row in rows if row.get("check") == "logits"}
    assert logits[None]["jax_rel_err"] < 2 * logits[None]["torch_rel_err"] + 1e-4  # float16: within torch's error
    # int8 weights beside float16 activations: a scale per output channel moves the logits by percents, not more
    assert logits[None]["jax_rel_err"] < logits["int8"]["jax_rel_err"] < 0.1
    speeds = {(row.get("quantize"), row["check"], row["batch"]): row["value"] for row in rows
              if row.get("check", "").endswith("_per_s")}
    for weights, checks in ((None, ("hf_generate_tokens_per_s", "jax_generate_tokens_per_s", "engine_tokens_per_s")),
                            ("int8", ("jax_generate_tokens_per_s", "engine_tokens_per_s"))):
        for check in checks:
            assert all(speeds[(weights, check, b)] > 0 for b in (1, 2)), (weights, check)
    memory = {row.get("quantize"): row for row in rows if row.get("check") == "memory"}
    for row in memory.values():
        assert row["param_bytes"] == row["plan_param_bytes"]  # the planner counts the weights we hold
    assert memory["int8"]["param_bytes"] < memory[None]["param_bytes"]
    # every decode figure beside its floor: the step's bytes (weights and the KV written) at the copy bandwidth
    bandwidth = {row.get("quantize"): row for row in rows if row.get("check") == "bandwidth"}
    assert all(row["gb_per_s"] > 0 and row["copy_bytes"] == 16 << 20 for row in bandwidth.values())
    for row in rows:
        if row.get("check") in ("engine_tokens_per_s", "jax_generate_tokens_per_s"):
            bw = bandwidth[row.get("quantize")]["gb_per_s"]
            assert row["step_bytes"] > memory[row.get("quantize")]["param_bytes"]  # the weights and the KV
            # (bound_ms is rounded to 0.1 us: a tiny model's floor on a CPU is tens of us)
            assert row["bound_ms"] == pytest.approx(row["step_bytes"] / bw / 1e6, rel=1e-2, abs=1e-4)
    ttft = [row for row in rows if row.get("check") == "ttft"]
    assert len(ttft) == 2 and all(0 < t["p50_s"] <= t["p99_s"] <= t["max_s"] and t["batch"] == 3 for t in ttft)
    assert "our engine" in r.stdout and "tiny float16 " in r.stdout and "tiny float16+int8" in r.stdout


def test_the_engine_probe_compares_admissions_on_the_cpu(tmp_path):
    """benchmark/gpu/gpu_engine_probe.py --admission, rehearsed at its smallest: the runs take the blocks they name, a
    CPU's shorter than the context, a GPU's longer (fewer steps for the same prompts, every prompt joining), none
    with joining off (every prompt prefilled)."""
    from opt_serving.runner.slots import join_blocks
    out = tmp_path / "probe.jsonl"
    probe = [os.environ.get("PYTHON", _python()), str(ROOT / "benchmark" / "gpu" / "gpu_engine_probe.py"), "--size",
             "tiny", "--max-seq-len", "64", "--out", str(out)]
    r = subprocess.run(probe + ["--admission", "--slots", "16", "--batches", "16"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = {row["variant"]: row for row in rows if row.get("check") == "engine_tokens_per_s"}
    cpu, gpu, none = runs["a CPU's join blocks"], runs["a GPU's join blocks"], runs["no joining"]
    assert cpu["join_blocks"] == list(join_blocks("cpu", 64, 15 * 32)) and max(cpu["join_blocks"]) < 64
    assert max(gpu["join_blocks"]) > 64
    assert cpu["engine_joined"] == cpu["engine_prefills"] == gpu["engine_joined"] == 32  # two runs of 16
    assert gpu["engine_steps"] < cpu["engine_steps"]
    assert none["engine_joined"] == 0 and none["engine_prefills"] == 32
    assert all(run["value"] > 0 and run["compiles_in_timed"] == 0 for run in runs.values())


def test_the_trace_split_sums_the_device_s_busy_time_and_its_gaps_by_their_neighbours():
    """benchmark/gpu/trace_split.py on a made-up trace: two kernels, a copy back, the host's turn and a copy in."""
    from benchmark.gpu.trace_split import split
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}}]
    dev = [("gemm", 0, 100), ("gemm", 110, 100), ("MemcpyD2H", 220, 10), ("MemcpyH2D", 1230, 10), ("gemm", 1250, 50)]
    host = [("$scheduler.py:343 _step", 0, 1300), ("$stage.py:236 <genexpr>", 220, 300)]
    events = meta + [{"ph": "X", "pid": 1, "tid": 3, "name": n, "ts": t, "dur": d} for n, t, d in dev] + \
        [{"ph": "X", "pid": 7, "tid": 9, "name": n, "ts": t, "dur": d} for n, t, d in host]
    r = split(events, 5)
    assert (r["span_ms"], r["busy_ms"], r["idle_ms"]) == (1.3, 0.27, 1.0)  # gaps of 10 us are not counted
    assert r["gaps"] == [(("MemcpyD2H", "MemcpyH2D"), 1.0)]
    assert r["kernels"][0] == ("gemm", 0.25) and r["host"][0] == ("$scheduler.py:343 _step", 1.3)


def _python() -> str:
    import sys
    return sys.executable

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
                             "--engine-reps 1"}
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


def _python() -> str:
    import sys
    return sys.executable

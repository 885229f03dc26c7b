"""JAX's device settings per process (jax_env) and the Ray resources a deployment reserves, from its plan, on a
Ray cluster that declares GPUs it does not have (Ray's resources are logical: JAX here still runs on the CPU)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opt_serving import jax_env

ROOT = Path(__file__).resolve().parents[1]


def test_each_kind_of_process_gets_its_settings():
    assert jax_env.route_only() == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert jax_env.runs_model(1) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.900"}  # the planner's 1 - headroom
    assert jax_env.runs_model(4) == jax_env.runs_model(1)  # a fraction of each of its GPUs
    assert jax_env.runs_model(0.5) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"}  # half a GPU: half the budget
    assert jax_env.runs_model(0) == {"JAX_PLATFORMS": "cpu"}  # no GPU reserved: sees none
    user = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert jax_env.keep_users(jax_env.runs_model(1), user) == user
    environ = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    jax_env.apply(jax_env.route_only() | {"OTHER": "1"}, environ)
    assert environ == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "OTHER": "1"}  # the user's value stays


def _child(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "RAY_ADDRESS"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"child exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_the_command_line_plans_without_taking_a_device():
    """`opt-serving plan` only plans: no GPU memory taken ahead, and JAX's backends never start."""
    out = _child("""
        import contextlib, io, json, os
        from opt_serving import cli, jax_env
        with contextlib.redirect_stdout(io.StringIO()) as text:
            rc = cli.main(["plan", "--model", "alpa/opt-13b", "--cluster", "1x8x16GB"])
        print(json.dumps([rc, os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"), jax_env.started(),
                          "dp" in text.getvalue()]))
    """)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, "false", False, True]


# placement() on a Ray cluster with two (logical) GPUs, in a child process that starts and stops its own Ray:
# every case's options, and whether planning started JAX there
PLACEMENTS = """
    import json, ray
    from opt_serving import jax_env
    from opt_serving.service.deployment import ServeArgs, placement
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="ERROR")
    out = {}
    try:
        for name, kw in [("jax", {}), ("jax_cpu", {"num_gpus": 0}), ("jax_half", {"num_gpus": 0.5}),
                         ("alpa_pp1", {"model": "alpa/opt-1.3b", "device_memory": "16GB"}),
                         ("alpa_pp2", {"model": "alpa/opt-6.7b", "device_memory": "16GB", "pipeline_parallel": 2,
                                       "max_batch_size": 4, "max_seq_len": 512})]:
            args = ServeArgs(**{"model": "jax/opt-125m", "dummy": True, **kw})
            out[name] = [placement(args), args.dtype, args.tensor_parallel, args.pipeline_parallel]
        for name, kw in [("too_many", {"model": "jax/opt-125m", "num_gpus": 3}),
                         ("alpa_gpus", {"model": "alpa/opt-125m", "num_gpus": 1})]:
            try:
                placement(ServeArgs(dummy=True, **kw))
                out[name] = None
            except ValueError as e:
                out[name] = str(e)
        out["jax_started"] = jax_env.started()
    finally:
        ray.shutdown()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def placements():
    return json.loads(_child(PLACEMENTS).stdout.strip().splitlines()[-1])


def test_a_one_device_model_reserves_a_gpu_where_the_cluster_has_them(placements):
    opts, dtype, _, _ = placements["jax"]
    assert opts == {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1.0, "runtime_env": {
        "env_vars": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.900"}}}}
    assert dtype == "auto"  # resolved by the replica, on its own device
    # --num-gpus 0: the replica stays on the CPU and sees no GPU; a half: half the planner's budget
    assert placements["jax_cpu"][0] == {"ray_actor_options": {"num_cpus": 1.0, "runtime_env": {
        "env_vars": {"JAX_PLATFORMS": "cpu"}}}}
    assert placements["jax_half"][0]["ray_actor_options"]["num_gpus"] == 0.5
    assert placements["jax_half"][0]["ray_actor_options"]["runtime_env"]["env_vars"] == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"}
    assert "num_gpus (--num-gpus) 3: the Ray cluster has 2 GPUs" in placements["too_many"]
    assert "one-device models" in placements["alpa_gpus"]


def test_an_alpa_plan_reserves_its_gpus_and_its_processes_their_share(placements):
    opts, dtype, tp, pp = placements["alpa_pp1"]
    assert dtype == "float16" and pp == 1  # "auto" on a cluster with GPUs: decided from Ray's resources
    assert opts["ray_actor_options"]["num_gpus"] == tp
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"] == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.900"}
    assert opts["placement_group_bundles"] == [{"CPU": 1.0, "GPU": float(tp)}]
    opts, dtype, tp, pp = placements["alpa_pp2"]
    assert (pp, dtype) == (2, "float16")
    assert [b["GPU"] for b in opts["placement_group_bundles"]] == [float(tp)] * 2
    # the replica only drives the stages, which hold the GPUs: it takes none
    assert "num_gpus" not in opts["ray_actor_options"]
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "cpu"}


def test_planning_a_deployment_starts_no_jax_in_the_planning_process(placements):
    assert placements["jax_started"] is False


STAGES = """
    import json, os, ray
    from opt_serving.parallel.backend import plan_model
    from opt_serving.spec import ModelSpec
    from opt_serving.parallel.pipeline import RayStages
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        spec = ModelSpec.parse("alpa/opt-tiny", dummy=True, pipeline_parallel=2, tensor_parallel=1)
        plan, cfg, _ = plan_model(spec, dtype="float32", device_memory="1GB")
        stages = RayStages(cfg, plan, None, dtype="float32", rows=1, max_seq_len=64)
        look = lambda actor, keys: {k: os.environ.get(k) for k in keys}
        keys = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_PLATFORMS")
        print(json.dumps([ray.get(a.__ray_call__.remote(look, keys)) for a in stages.actors]))
        stages.close()
    finally:
        ray.shutdown()
"""


def test_pipeline_stages_on_gpus_take_the_planners_share():
    got = json.loads(_child(STAGES).stdout.strip().splitlines()[-1])
    assert got == [{"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.900", "JAX_PLATFORMS": None}] * 2

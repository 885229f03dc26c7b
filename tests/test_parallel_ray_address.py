"""Which Ray cluster get_model / serve / batch join (parallel/ray_address.py): Ray's address file naming a head
that is gone is skipped in seconds, saying so, and a Ray of their own starts; an explicit address that does not
answer is an error naming it. Each case has Ray's temp folder in a folder of its own (RAY_TMPDIR), so no other
program's cluster or address file takes part."""
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from opt_serving.service.ports import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_tmp(monkeypatch):
    """A short private Ray temp folder (Ray's socket paths must stay short) as RAY_TMPDIR, no RAY_ADDRESS."""
    d = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    (d / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(d))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


def _dead_address() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def test_a_stale_address_file_is_skipped_saying_which_file_and_head(ray_tmp):
    from opt_serving.parallel import ray_address
    dead = _dead_address()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
    t0 = time.monotonic()
    found = ray_address.find_cluster()
    assert time.monotonic() - t0 < 5
    assert found.address is None
    assert dead in found.note and str(ray_tmp / "ray" / "ray_current_cluster") in found.note


def test_the_address_file_of_a_head_that_answers_is_joined(ray_tmp):
    from opt_serving.parallel import ray_address
    with socket.socket() as gcs:  # a GCS stand-in: the check is a TCP connection
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        live = f"127.0.0.1:{gcs.getsockname()[1]}"
        (ray_tmp / "ray" / "ray_current_cluster").write_text(live + "\n")
        assert ray_address.find_cluster() == ray_address.Found(live)
    assert ray_address.find_cluster(address="local") == ray_address.Found(None)


def test_an_explicit_address_that_does_not_answer_is_an_error_naming_it(ray_tmp, monkeypatch):
    from opt_serving.parallel import ray_address
    dead = _dead_address()
    with pytest.raises(ConnectionError, match=f"no Ray cluster answers at {dead} \\(from --ray-address\\)"):
        ray_address.find_cluster(address=dead)
    monkeypatch.setenv("RAY_ADDRESS", dead)
    with pytest.raises(ConnectionError, match=f"{dead} \\(from RAY_ADDRESS\\)"):
        ray_address.find_cluster()
    up, started = ray_address.init(address="local", start=False)
    assert (up, started) == (False, False)


@pytest.mark.slow
def test_get_model_with_a_stale_address_file_starts_its_own_ray_saying_so(ray_tmp):
    """The pipelined alpa/ model of the issue: get_model used to sit in ray.init(address="auto") retrying the
    dead head for minutes; now it says so and starts a Ray of its own, in which its stages run."""
    dead = _dead_address()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
    code = ("import ray\n"
            "from opt_serving.model.wrapper import get_model\n"
            "m = get_model('alpa/opt-tiny', dummy=True, pipeline_parallel=2, tensor_parallel=1)\n"
            "print('plan', m.plan.name, 'gcs', ray.get_runtime_context().gcs_address, flush=True)\n"
            "m.close()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"names a head at {dead} that does not answer" in r.stderr and "starting a Ray of this process's own" \
        in r.stderr, r.stderr[-3000:]
    plan_line = next(line for line in r.stdout.splitlines() if line.startswith("plan"))
    assert "pp2" in plan_line and dead not in plan_line

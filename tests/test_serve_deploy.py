"""The shipped serve_config.yaml under Ray Serve's own CLI on a `ray start --head` cluster: `serve deploy` runs it,
`serve status` reports it healthy, and a changed config deployed again replaces the replica without dropping a
stream in flight (the old replica drains it within graceful_shutdown_timeout_s).

The cluster is this test's own (testing/ray_cluster.py's foreign_head: a temp folder, so an address file, and a
token of its own, with the dashboard `serve deploy` talks to), and exactly its processes are killed at the end.
The config is the shipped one with the fake engine (engine/fake.py) instead of a model, its decode steps taking
`fake_step_s`, so a request lasts a known while."""
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import yaml

from opt_serving.service.ports import free_port

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("OPT_SERVING_SKIP_RAY") == "1", reason="OPT_SERVING_SKIP_RAY=1")]
REPO = Path(__file__).resolve().parents[1]
SERVE_CLI = str(Path(sys.executable).parent / "serve")
STEP_S, TOKENS = 0.05, 400  # the in-flight stream: 20 s of decode steps, beside a replica start of a few seconds
WINDOW_S = 60               # graceful_shutdown_timeout_s: the whole stream fits in it


class Head:
    def __init__(self, dashboard: str, env: dict, tmp: Path):
        self.dashboard, self.env, self.tmp, self.port = dashboard, env, tmp, free_port()

    def serve(self, *args: str) -> str:
        """`serve ARGS -a <dashboard>`'s output (an error with its output where it fails)."""
        res = subprocess.run([SERVE_CLI, *args, "-a", self.dashboard], env=self.env, cwd=REPO, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, f"serve {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}"
        return res.stdout

    def status(self) -> dict:
        return yaml.safe_load(self.serve("status")) or {}

    def config(self, name: str, **args) -> str:
        """The shipped serve_config.yaml with the fake engine, on this test's port: written to a file."""
        config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
        config["http_options"]["port"] = self.port
        [app] = config["applications"]
        app["args"].update(engine="fake", fake_step_s=STEP_S, max_seq_len=1024, graceful_shutdown_timeout_s=WINDOW_S,
                           **args)
        path = self.tmp / name
        path.write_text(yaml.safe_dump(config))
        return str(path)

    def replicas(self) -> dict:
        """The deployment's replica states and counts (none while the application's builder runs)."""
        app = self.status().get("applications", {}).get("opt", {})
        return app.get("deployments", {}).get("OPTServer", {}).get("replica_states", {})

    def wait_running(self, served_name: str) -> dict:
        """Poll `serve status` (a few seconds a call) until the application is RUNNING with its deployment
        HEALTHY and every replica running the config that serves `served_name`; the status then."""
        client = self.client()
        for _ in range(100):  # (a limit that only stops a hang)
            status = self.status()
            app = status.get("applications", {}).get("opt", {})
            deployment = app.get("deployments", {}).get("OPTServer", {})
            if (app.get("status") == "RUNNING" and deployment.get("status") == "HEALTHY"
                    and set(deployment.get("replica_states", {})) == {"RUNNING"}
                    and [m.id for m in client.models.list()] == [served_name]):
                return status
        raise AssertionError(f"the application did not come up serving {served_name}: {status}")

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def head():
    """A Ray head of this module's own, with the shipped config (the fake engine) deployed by `serve deploy`."""
    from opt_serving.testing.ray_cluster import foreign_head
    tmp = Path(tempfile.mkdtemp(prefix="rd", dir="/tmp"))  # short: Ray's socket paths live under it
    dashboard = free_port()
    try:
        with foreign_head(tmp, num_cpus=2, dashboard_port=dashboard, env_vars={"PYTHONPATH": str(REPO)}) as (_, env):
            h = Head(f"http://127.0.0.1:{dashboard}", env, tmp)
            h.serve("deploy", h.config("v1.yaml", served_model_name="opt-v1"))
            yield h
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_serve_deploy_runs_the_shipped_config_and_status_reports_it_healthy(head):
    status = head.wait_running("opt-v1")
    assert status["applications"]["opt"]["deployments"]["OPTServer"]["status"] == "HEALTHY"
    r = head.client().completions.create(model="opt-v1", prompt="a", max_tokens=3, temperature=0)
    assert r.choices[0].text == "bcd"  # the fake engine's greedy bytes, through Serve's proxy


def test_a_changed_config_redeploys_without_dropping_a_stream_in_flight(head):
    head.wait_running("opt-v1")
    stream = head.client().completions.create(
        model="opt-v1", prompt="a", max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [next(stream)]  # in flight on the v1 replica
    done, seen, failures = threading.Event(), [], []

    def redeploy_and_watch():
        """Deploy v2, then watch the old replica stop while the stream is still open."""
        try:
            head.serve("deploy", head.config("v2.yaml", served_model_name="opt-v2"))
            while not done.is_set() and not seen:
                states = head.replicas()
                if "STOPPING" in states and not done.is_set():
                    seen.append(states)
        except BaseException as e:  # (reported by the test, not lost in the thread)
            failures.append(e)

    watcher = threading.Thread(target=redeploy_and_watch, name="redeploy")
    watcher.start()
    try:
        chunks.extend(stream)
    finally:
        done.set()
        watcher.join(600)
    assert not failures, failures
    assert seen, "the stream ended before the old replica began to stop: nothing was in flight to keep"
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert ids == [(101 + k) % 260 for k in range(1, TOKENS + 1)]  # every token, in order, none dropped
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == ["length"] and chunks[-1].usage.completion_tokens == TOKENS
    assert {c.model for c in chunks} == {"opt-v1"}  # served to the end by the replica it started on
    head.wait_running("opt-v2")  # and the new config serves now

"""A killed model replica comes back quickly: `opt-serving serve` (embedded tiny model, direct ingress, one
replica, a private Ray) with 64 streaming requests running or waiting; SIGKILL the replica's process. The
in-flight requests must end (an error or a dropped connection) within 60 s (the issue's bound on a failed
request: later than that, a client cannot tell it from a hang), and a new request must be served on the same
port again. The server compiles each step at its first use (--no-warmup): what is tested is that the requests end
and the port serves again, not how long a warm-up takes; how soon at the defaults is a figure benchmark/faults/chaos.py
measures under load (benchmark/README.md). On a busy machine a replacement's start (loading the model, compiling its
steps) took 104.9 s where 13-25 s is usual, so the test waits for the real condition, a request served, up to
RECOVER_LIMIT_S, a limit that only keeps a server that never comes back from hanging the suite.

Before, new requests were refused for 150-190 s, for two reasons in Ray Serve's direct ingress, both fixed
on our side (opt_serving/service/ray_session.py direct_ingress_env, deployment.py reuse_replica_port_after_crash):
- a released replica port is quarantined for 150 s (RAY_SERVE_PORT_QUARANTINE_S, for HAProxy's stale
  workers; there is no HAProxy here), and our port range is that one port: every replacement loaded the model,
  found no port (NoAvailablePortError) and was retried until the quarantine ended;
- the replica binds without SO_REUSEADDR, so the killed replica's connections, in TIME_WAIT for 60 s,
  made the replacement's bind fail (EADDRINUSE) until they expired.
"""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from opt_serving.service.testserver import free_port
from opt_serving.testing.cli_server import wait_for_line

pytest.importorskip("ray.serve")

REPO = Path(__file__).resolve().parents[1]
IN_FLIGHT, END_BOUND_S, RECOVER_LIMIT_S = 64, 60.0, 600.0


def _replica_pids(server: subprocess.Popen) -> list[int]:
    pids = []
    for c in psutil.Process(server.pid).children(recursive=True):
        try:
            if "ServeReplica" in " ".join(c.cmdline()):
                pids.append(c.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


async def _stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> tuple[str, float]:
    """One long streaming request: ('done' | 'truncated' | error name, monotonic time it ended)."""
    body = {"prompt": "hello", "max_tokens": 480, "min_tokens": 480, "ignore_eos": True, "stream": True,
            "temperature": 0}
    outcome = "truncated"
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    started.set()
                    if line.strip() == "data: [DONE]":
                        outcome = "done"
    except Exception as e:  # the dropped connection
        outcome = type(e).__name__
    return outcome, time.monotonic()


async def _kill_under_load(server: subprocess.Popen, url: str) -> dict:
    started = asyncio.Event()
    limits = httpx.Limits(max_connections=IN_FLIGHT + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, url, started)) for _ in range(IN_FLIGHT)]
        await asyncio.wait_for(started.wait(), timeout=60)  # tokens are streaming: kill the replica now
        pids = _replica_pids(server)
        assert len(pids) == 1, pids
        t_kill = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        done, pending = await asyncio.wait(tasks, timeout=END_BOUND_S + 30)
        for t in pending:
            t.cancel()
        outcomes = [t.result() for t in done]
        # a new request on the same port, tried every half second
        first_ok, seen = None, []
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as probe:
            while time.monotonic() - t_kill < RECOVER_LIMIT_S:
                try:
                    r = await probe.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
                    status = r.status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                if not seen or seen[-1][1] != status:
                    seen.append((round(time.monotonic() - t_kill, 1), status))
                if status == 200:
                    first_ok = time.monotonic() - t_kill
                    break
                await asyncio.sleep(0.5)
    return {"killed": pids[0], "pending": len(pending), "outcomes": [o for o, _ in outcomes],
            "ends": sorted(t - t_kill for _, t in outcomes), "first_ok": first_ok, "seen": seen}


@pytest.mark.slow
def test_killed_replica_fails_in_flight_requests_and_serves_again_on_the_same_port():
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "opt_serving", "serve", "--port", str(port), "--num-cpus", "2",
         "--ray-address", "local", "--drain-timeout", "2", "--no-warmup"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(proc, f"http://127.0.0.1:{port}/", timeout=240)
        start_s = time.monotonic() - t0
        url = f"http://127.0.0.1:{port}"
        m = asyncio.run(_kill_under_load(proc, url))
        ends = m["ends"]
        print(f"\nserver start {start_s:.1f} s; replica {m['killed']} killed with {IN_FLIGHT} requests in flight: "
              f"they ended {ends[0]:.2f}-{ends[-1]:.2f} s after the kill "
              f"({ {o: m['outcomes'].count(o) for o in set(m['outcomes'])} }); first request served on port "
              f"{port} {m['first_ok']} s after the kill; probe answers {m['seen']}")
        assert m["pending"] == 0 and len(ends) == IN_FLIGHT
        assert ends[-1] < END_BOUND_S
        assert "done" not in m["outcomes"]  # none ran to completion: every one was cut off by the kill
        assert m["first_ok"] is not None, f"not served again within {RECOVER_LIMIT_S} s: {m['seen']}"
        new = _replica_pids(proc)
        assert new and m["killed"] not in new  # served by the replacement replica, on the same port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                for c in psutil.Process(proc.pid).children(recursive=True):
                    c.kill()
                proc.kill()
        proc.stdout.close()


def test_replica_port_binds_past_time_wait(monkeypatch):
    """The adjustment alone: a port whose last connection is in TIME_WAIT (the server closed first, as a
    killed process's sockets do) refuses a plain bind and takes one with Serve's socket, once adjusted."""
    from ray.serve._private import http_util

    from opt_serving.service.deployment import reuse_replica_port_after_crash

    monkeypatch.setattr(http_util, "socket", http_util.socket)  # undone after the test
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server side closes first: it goes to TIME_WAIT once the client closes too
    assert client.recv(1) == b""
    client.close()
    listener.close()
    time.sleep(0.05)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    assert reuse_replica_port_after_crash()
    with http_util.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as serves:
        serves.bind(("127.0.0.1", port))  # what start_asgi_http_server does, now past TIME_WAIT
        serves.listen()
    assert http_util.socket.AF_INET == socket.AF_INET  # everything else is the socket module's

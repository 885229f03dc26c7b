"""`opt-serving serve` as a child process on a private Ray (tests, benchmarks): started, waited for, and stopped
with everything it started, and the processes under it found by what they run.

    with cli_server(["--engine", "fake"]) as server:
        httpx.get(server.url + "/health")
        server.pids("ServeReplica")
    assert not server.left_over   # (after the block) processes that outlived the server
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import psutil

from opt_serving.service.ports import free_port

REPO = Path(__file__).resolve().parents[2]

# what a Ray process runs, as its command line names it
REPLICA, PROXY, CONTROLLER, STAGE = "ray::ServeReplica", "ray::ProxyActor", "ray::ServeController", "ray::StageActor"


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> list[str]:
    """Read the child's output until a line contains `text`; AssertionError with the output otherwise, also
    when the child stays silent past `timeout` (its lines are read by a thread of their own, so a readline
    that blocks never outlasts the deadline)."""
    lines = _lines(proc)
    seen, deadline, why = [], time.monotonic() + timeout, f"within {timeout:.0f} s"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            lines.put(None)  # (for a later call too)
            why = "before its output ended"
            break
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"server did not print {text!r} {why} (exit status {proc.poll()}); "
                         f"output:\n{''.join(seen)}")


_readers: "weakref.WeakKeyDictionary[subprocess.Popen, queue.Queue]" = weakref.WeakKeyDictionary()
_readers_lock = threading.Lock()


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The child's output lines as they come (None once it ends), from one reader thread per child."""
    with _readers_lock:
        q = _readers.get(proc)
        if q is None:
            q = _readers[proc] = queue.Queue()
            out = proc.stdout

            def read():
                while True:
                    line = out.readline()
                    if not line:
                        break
                    q.put(line)
                q.put(None)
            threading.Thread(target=read, name=f"output of {proc.pid}", daemon=True).start()
        return q


def processes_under(root: int, marker: str | None = None) -> list[psutil.Process]:
    """Live (not zombie) descendants of `root`, those whose command line starts with `marker` if given."""
    out = []
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for c in children:
        try:
            if c.status() == psutil.STATUS_ZOMBIE:
                continue
            if marker is None or " ".join(c.cmdline()).startswith(marker):
                out.append(c)
        except psutil.Error:
            continue
    return out


@dataclass
class CliServer:
    proc: subprocess.Popen
    url: str
    start_s: float
    seen: set = field(default_factory=set)      # every process found under the server while it ran
    left_over: list = field(default_factory=list)  # (pid, command line) of those alive after it stopped

    def pids(self, marker: str) -> list[int]:
        found = processes_under(self.proc.pid, marker)
        self.seen.update(found)
        return [p.pid for p in found]

    def snapshot(self) -> None:
        self.seen.update(processes_under(self.proc.pid))


@contextlib.contextmanager
def cli_server(args: Sequence[str] = (), port: int | None = None, start_timeout: float = 300.0,
               stop_timeout: float = 120.0, output=None) -> Iterator[CliServer]:
    """`opt-serving serve --ray-address local --port PORT *args` (its own Ray, never one already running
    here). On exit: SIGINT (as Ctrl-C), then every process seen under it is waited for; those still alive
    after 30 s are listed in `left_over` and killed. `output`: a file the server's output is copied to after
    the banner (default: discarded)."""
    port = port or free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "opt_serving", "serve", "--ray-address", "local",
                             "--port", str(port), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    server = CliServer(proc, f"http://127.0.0.1:{port}", 0.0)
    pump = None
    try:
        wait_for_line(proc, f"http://127.0.0.1:{port}/", start_timeout)
        server.start_s = time.monotonic() - t0
        pump = _copy_output(proc, output)
        server.snapshot()
        yield server
    finally:
        server.snapshot()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        _, alive = psutil.wait_procs(list(server.seen), timeout=30)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    server.left_over.append((p.pid, " ".join(p.cmdline())[:80]))
                    p.kill()
        if pump is not None:
            pump.join(10)
        proc.stdout.close()


def _copy_output(proc: subprocess.Popen, output):
    """Keep reading the server's output (so it never blocks on a full pipe), into `output` if given."""
    import threading

    def run():
        for line in proc.stdout:
            if output is not None:
                output.write(line)
                output.flush()
    t = threading.Thread(target=run, name="server-output", daemon=True)
    t.start()
    return t

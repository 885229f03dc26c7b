"""The harness the peer comparisons share: start a server (ours or a peer's) as a child process and wait for its
ready line, stop exactly what it started, run the sides in turn for N rounds, print ours against the peer.

    with started(["vllm", "serve", ...], ready="Application startup complete", name="vllm", log=path) as server:
        ...                                       # server.lines: its last output lines; server.log: the file
    with serve(["--engine", "fake"], log=path) as server:   # `opt-serving serve` on a Ray of its own
        server.processes("ray::ServeReplica")     # the processes under it, by what they run
    for rnd, side in in_turn(["ours", "vllm"], rounds=2):   # ours, vllm, vllm, ours
        ...
    print_comparison([("output tokens/s", 120.0, 100.0)], ours="ours", peer="vLLM")   # a table and JSON lines

A server is started in a session of its own, so that stopping it reaches everything it started and nothing
else: SIGINT to its process group (what Ctrl-C in a terminal sends: ours drains and stops the Ray it started,
vLLM shuts down), SIGKILL to the group if it is still there after `stop_timeout`, then any process that was
seen under it and outlived it is killed and named in `left_over`.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 40  # the output lines an error shows
SERVING = "opt-serving: serving"  # our server's ready line


class StartError(RuntimeError):
    """A server exited, or did not print its ready line in time; the message names it and shows its output's end."""


def _default_sigint_for_children() -> None:
    """A process started with SIGINT ignored (a background job of a non-interactive shell: `nohup ... &`, a CI
    runner) hands that on to what it starts, and a server ignoring SIGINT is stopped only by the SIGKILL
    `stop_timeout` later (2 minutes a server). Stopping with SIGINT needs it at its default in the servers: from
    a handler of the harness's own, exec restores the default, as a terminal's shell gives it (main thread only,
    as Python's signal handlers are)."""
    if (signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Server:
    """A command started in its own session; its output is read on a thread (so the pipe never fills), kept in
    `lines` (the last 200) and copied to `log` if given. `url`: where it serves, for its users."""

    def __init__(self, cmd: Sequence[str], ready: str, *, name: str | None = None, env: dict | None = None,
                 cwd: str | os.PathLike | None = None, log: str | os.PathLike | None = None,
                 preexec_fn: Callable[[], None] | None = None, url: str | None = None):
        self.cmd, self.ready, self.name = [str(c) for c in cmd], ready, name or Path(str(cmd[0])).name
        self.url = url
        self.log = Path(log) if log else None
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.seen: set[psutil.Process] = set()  # every process found under it while it ran
        self.left_over: list[tuple[int, str]] = []  # (pid, command line) of those that outlived it
        self.start_s = float("nan")
        self._ready = threading.Event()
        self._t0 = time.monotonic()
        _default_sigint_for_children()
        self.proc = subprocess.Popen(self.cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True,
                                     preexec_fn=preexec_fn)
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = open(self.log, "w") if self.log else None
        try:
            for line in self.proc.stdout:
                self.lines.append(line)
                if out is not None:
                    out.write(line)
                    out.flush()
                if self.ready in line and not self._ready.is_set():
                    self.start_s = time.monotonic() - self._t0
                    self._ready.set()
        finally:
            if out is not None:
                out.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, n: int = TAIL_LINES) -> str:
        return "".join(list(self.lines)[-n:])

    def _failure(self, what: str) -> str:
        where = f" (all of it: {self.log})" if self.log else ""
        return (f"{self.name} {what}\n  command: {shlex.join(self.cmd)}\n  its last {TAIL_LINES} output lines"
                f"{where}:\n{self.tail()}")

    def wait_ready(self, timeout: float) -> "Server":
        """Until a line of its output holds `ready`; StartError (after stopping it) if it exits or times out."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None:
                self._reader.join(10)  # its last lines (the ready line may be among them)
                if self._ready.is_set():
                    break
                self.stop()
                raise StartError(self._failure(f"exited (status {self.proc.returncode}) before it printed "
                                               f"{self.ready!r}"))
            if time.monotonic() > deadline:
                self.stop()
                raise StartError(self._failure(f"did not print {self.ready!r} in {timeout:g} s"))
        self.snapshot()
        return self

    def snapshot(self) -> None:
        """Note the processes under it now (those it started that may outlive it)."""
        with contextlib.suppress(psutil.Error):
            self.seen.update(psutil.Process(self.proc.pid).children(recursive=True))

    def processes(self, marker: str | None = None) -> list[psutil.Process]:
        """Live processes under it, those whose command line starts with `marker` if given."""
        self.snapshot()
        out = []
        for p in list(self.seen):
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and (
                        marker is None or " ".join(p.cmdline()).startswith(marker)):
                    out.append(p)
        return out

    def stop(self, stop_timeout: float = 120.0, grace: float = 30.0) -> list[tuple[int, str]]:
        """SIGINT to its process group, SIGKILL after `stop_timeout`; then the processes seen under it that
        are still alive after `grace` are killed and returned (also kept in `left_over`)."""
        if self.proc.poll() is None:
            self.snapshot()
            self._signal_group(signal.SIGINT)
            try:
                self.proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        _, alive = psutil.wait_procs(list(self.seen), timeout=grace)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    self.left_over.append((p.pid, " ".join(p.cmdline())[:80]))
                    p.kill()
        for p in self._group_left():  # any of its group started after the last look
            with contextlib.suppress(psutil.Error):
                self.left_over.append((p.pid, " ".join(p.cmdline())[:80]))
                p.kill()
        self._reader.join(10)
        if self.left_over:
            print(f"{self.name}: processes it started outlived it, killed: {self.left_over}", file=sys.stderr)
        return self.left_over

    def _group_left(self) -> list[psutil.Process]:
        """Live members of its process group other than the (reaped) leader, whose pid a new process may have."""
        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if (p.pid != self.proc.pid and os.getpgid(p.pid) == self.proc.pid
                        and p.status() != psutil.STATUS_ZOMBIE):
                    out.append(p)
        return out

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # its session's group: its pid (start_new_session)


def start(cmd: Sequence[str], ready: str, *, timeout: float = 600.0, **kwargs) -> Server:
    """Start `cmd` and wait for a line holding `ready` (Server's arguments: name, env, cwd, log, preexec_fn, url)."""
    return Server(cmd, ready, **kwargs).wait_ready(timeout)


def serve(argv: Sequence[str] = (), *, port: int | None = None, timeout: float = 600.0, env: dict | None = None,
          **kwargs) -> Server:
    """`opt-serving serve *argv --port PORT --ray-address local` from this checkout (a Ray of its own, never one
    already running here; PORT: a free one unless given), started and waited for; `url`: where it serves. `env`:
    its environment (default: this process's). Other arguments: Server's (name, log, preexec_fn). A `with` block
    stops it when it ends."""
    from opt_serving.service.ports import free_port  # (here: a peer-only script may run where opt_serving is not)
    port = port or free_port()
    env = {**(os.environ if env is None else env), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "opt_serving", "serve", *argv, "--port", str(port), "--ray-address", "local"]
    kwargs.setdefault("name", "opt-serving serve")
    return start(cmd, SERVING, timeout=timeout, env=env, cwd=ROOT, url=f"http://127.0.0.1:{port}", **kwargs)


@contextlib.contextmanager
def started(cmd: Sequence[str], ready: str, *, timeout: float = 600.0, stop_timeout: float = 120.0,
            **kwargs) -> Iterator[Server]:
    """`start`, and stop it when the block ends, however it ends."""
    server = start(cmd, ready, timeout=timeout, **kwargs)
    try:
        yield server
    finally:
        server.stop(stop_timeout)


def script(main: Callable[[], object]) -> object:
    """Run a script's `main` -> what it returns; a server that would not start ends it with the StartError's
    message, not a trace."""
    try:
        return main()
    except StartError as e:
        raise SystemExit(f"error: {e}") from None


def in_turn(sides: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, side) for `rounds` rounds, each round in the reverse order of the one before (A B, B A, A B, ...),
    so that a drift in the machine's speed falls on every side alike."""
    for rnd in range(rounds):
        for side in (sides if rnd % 2 == 0 else list(reversed(sides))):
            yield rnd, side


def medians(runs: Sequence[dict], by: str, keys: Sequence[str]) -> dict[str, dict[str, float]]:
    """{side: {key: the median over that side's runs}}, sides in the order they first ran."""
    sides = list(dict.fromkeys(r[by] for r in runs))
    return {s: {k: float(np.median([r[k] for r in runs if r[by] == s])) for k in keys} for s in sides}


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_comparison(rows: Sequence[tuple[str, float, float]], ours: str = "ours", peer: str = "peer",
                     title: str | None = None, digits: int = 1) -> list[dict]:
    """A table (what, ours, the peer, ours / peer), then the same rows as JSON lines; returns the rows."""
    out = [{"comparison": title, "what": what, ours: a, peer: b, "ratio": ratio(a, b)} for what, a, b in rows]
    width = max([len(r["what"]) for r in out] + [4])
    a, b, c = max(12, len(ours)), max(12, len(peer)), max(12, len(ours) + len(peer) + 3)
    if title:
        print(title)
    print(f"  {'':<{width}} {ours:>{a}} {peer:>{b}} {ours + ' / ' + peer:>{c}}")
    for r in out:
        print(f"  {r['what']:<{width}} {r[ours]:>{a}.{digits}f} {r[peer]:>{b}.{digits}f} {r['ratio']:>{c - 1}.2f}x")
    for r in out:
        print(json.dumps(r))
    return out

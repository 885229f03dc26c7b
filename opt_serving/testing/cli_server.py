"""`opt-serving serve` as a child process, for the tests that start it themselves (benchmark/harness.py's `serve`
starts, waits for and stops one for the benchmarks and test_chaos): its output read until a line appears, and
the Ray processes under it found by what they run.

    proc = subprocess.Popen([...serve...], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_line(proc, "opt-serving: serving", timeout=300)
    processes_under(proc.pid, REPLICA)
"""
from __future__ import annotations

import queue
import subprocess
import threading
import time
import weakref

import psutil

# what a Ray process runs, as its command line names it
REPLICA, PROXY, CONTROLLER, STAGE = "ray::ServeReplica", "ray::ProxyActor", "ray::ServeController", "ray::StageActor"


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> list[str]:
    """Read the child's output until a line contains `text`; AssertionError with the output otherwise, also
    when the child stays silent past `timeout` (its lines are read by a thread of their own, so a readline
    that blocks never outlasts the deadline)."""
    seen, why = _read(proc, timeout, text)
    if why is None:
        return seen
    raise AssertionError(f"server did not print {text!r} {why} (exit status {proc.poll()}); "
                         f"output:\n{''.join(seen)}")


def rest_of_output(proc: subprocess.Popen, timeout: float) -> str:
    """The child's output from where wait_for_line left it to its end (a child that has exited), or what came
    within `timeout` where it has not ended by then."""
    return "".join(_read(proc, timeout)[0])


def _read(proc: subprocess.Popen, timeout: float, text: str | None = None) -> tuple[list[str], str | None]:
    """The child's next lines up to one containing `text` -> (lines, None), or up to its output's end or
    `timeout` -> (lines, why it stopped there)."""
    lines, seen, deadline = _lines(proc), [], time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            lines.put(None)  # (for a later call too)
            return seen, "before its output ended"
        seen.append(line)
        if text is not None and text in line:
            return seen, None
    return seen, f"within {timeout:.0f} s"


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

"""benchmark/harness.py: a server started and waited for by its ready line, stopped with what it started (and
nothing else), an error naming a server that died or stayed silent, the sides in turn, the comparison table."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from benchmark import harness  # as the scripts import it

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# prints a line, starts a grandchild that sleeps, names it, says it is ready, then waits to be stopped
SERVER = python("""
    import subprocess, sys, time
    print("loading", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"child {child.pid}", flush=True)
    print("serving at http://127.0.0.1:1/", flush=True)
    time.sleep(600)
""")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_waits_for_the_ready_line_and_stops_what_it_started_and_nothing_else(tmp_path):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # not the harness's
    try:
        log = tmp_path / "server.log"
        with harness.started(SERVER, "serving at", name="tiny", log=log, timeout=60) as server:
            assert server.proc.poll() is None
            child = int(next(line.split()[1] for line in server.lines if line.startswith("child ")))
            assert [p.pid for p in server.processes()] == [child]
            assert server.start_s > 0
        assert server.proc.returncode is not None
        assert gone(child)
        assert server.left_over == []  # SIGINT reached its group: the grandchild went with it
        assert stranger.poll() is None
        assert log.read_text().splitlines()[0] == "loading"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_server_that_dies_before_its_ready_line_is_named_with_its_output():
    cmd = python("""
        import sys
        print("reading weights from /nowhere", flush=True)
        print("FileNotFoundError: /nowhere", file=sys.stderr, flush=True)
        sys.exit(3)
    """)
    with pytest.raises(harness.StartError) as e:
        harness.start(cmd, "serving at", name="peer-server", timeout=60)
    msg = str(e.value)
    assert "peer-server exited (status 3) before it printed 'serving at'" in msg
    assert "reading weights from /nowhere" in msg and "FileNotFoundError: /nowhere" in msg  # stdout and stderr
    assert sys.executable in msg  # the command


def test_a_silent_server_times_out_and_is_stopped():
    server = harness.Server(python("import time; time.sleep(600)"), "serving at", name="silent")
    with pytest.raises(harness.StartError, match=r"silent did not print 'serving at' in 1 s"):
        server.wait_ready(1)
    assert server.proc.returncode is not None


def test_a_server_that_ignores_sigint_is_killed():
    cmd = python("""
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
    """)
    server = harness.start(cmd, "ready", timeout=60)
    server.stop(stop_timeout=1)
    assert server.proc.returncode == -9


def test_a_harness_run_with_sigint_ignored_stops_its_server_with_sigint():
    # as under `nohup ... &`: the harness's own process ignores SIGINT, and its server must not inherit that
    driver = python(f"""
        import signal, sys
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.path.insert(0, {str(ROOT)!r})
        from benchmark import harness
        server = harness.start([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                               "ready", timeout=60)
        server.stop(stop_timeout=30)
        print("returncode", server.proc.returncode)
    """)
    out = subprocess.run(driver, capture_output=True, text=True, timeout=120)
    assert f"returncode {-signal.SIGINT}" in out.stdout, out.stdout + out.stderr  # not -9 after 30 s


def test_a_grandchild_that_outlives_the_server_is_left_over_and_killed():
    # the grandchild leaves the server's session and ignores SIGINT: only the harness's own list finds it
    cmd = python("""
        import subprocess, sys, time
        code = ("import os, signal, time; os.setsid(); signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "print('set', flush=True); time.sleep(600)")
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()  # it has left the session
        print("ready", flush=True)
        time.sleep(600)
    """)
    server = harness.start(cmd, "ready", timeout=60)
    [child] = server.processes()
    left = server.stop(stop_timeout=30, grace=1)
    assert [pid for pid, _ in left] == [child.pid]
    child.wait(10)
    assert gone(child.pid)


def test_sides_take_turns_in_reverse_order_each_round():
    assert list(harness.in_turn(["ours", "peer"], 3)) == [(0, "ours"), (0, "peer"), (1, "peer"), (1, "ours"),
                                                         (2, "ours"), (2, "peer")]


def test_medians_by_side():
    runs = [{"side": "a", "x": 1.0}, {"side": "b", "x": 5.0}, {"side": "b", "x": 7.0}, {"side": "a", "x": 3.0},
            {"side": "a", "x": 10.0}]
    assert harness.medians(runs, "side", ["x"]) == {"a": {"x": 3.0}, "b": {"x": 6.0}}


def test_comparison_prints_a_table_and_json_lines(capsys):
    rows = harness.print_comparison([("tokens/s", 150.0, 100.0), ("TTFT p50 ms", 20.0, 0.0)], ours="ours",
                                    peer="vLLM", title="shared-prefix")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "shared-prefix"
    assert out[2].split() == ["tokens/s", "150.0", "100.0", "1.50x"]
    assert out[3].split()[-1] == "nanx"  # a zero peer figure gives no ratio, not an error
    lines = [json.loads(line) for line in out[4:]]
    assert lines[0] == {"comparison": "shared-prefix", "what": "tokens/s", "ours": 150.0, "vLLM": 100.0,
                        "ratio": 1.5}
    assert len(lines) == 2 and math.isnan(lines[1]["ratio"]) and lines[0] == rows[0]

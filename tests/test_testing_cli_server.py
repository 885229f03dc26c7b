"""opt_serving/testing/cli_server.py's wait_for_line: the tests' bound on a server's start holds even when the
child prints nothing at all (a readline on its silent output would block past any deadline)."""
import contextlib
import subprocess
import sys
import time

import pytest

from opt_serving.testing.cli_server import wait_for_line


@contextlib.contextmanager
def _child(code: str):
    """A Python child running `code`, its output piped; killed when the block ends."""
    proc = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_silent_child_fails_at_the_timeout_not_later():
    with _child("import time; time.sleep(60)") as proc:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="did not print 'ready' within 1 s"):
            wait_for_line(proc, "ready", timeout=1.0)
        assert time.monotonic() - t0 < 10


def test_lines_before_and_after_the_awaited_one_are_all_read():
    with _child("print('one'); print('ready at 1'); print('two'); print('ready at 2')") as proc:
        assert wait_for_line(proc, "ready", timeout=30) == ["one\n", "ready at 1\n"]
        assert wait_for_line(proc, "ready", timeout=30) == ["two\n", "ready at 2\n"]  # the same reader goes on
        t0 = time.monotonic()
        for _ in range(2):  # its output has ended: no wait for the timeout, this time or the next
            with pytest.raises(AssertionError, match="did not print 'ready' before its output ended"):
                wait_for_line(proc, "ready", timeout=30)
        assert time.monotonic() - t0 < 10

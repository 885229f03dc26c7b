"""Multi-device JAX tests on a CPU: jax must see 8 host devices before it is imported, so a test file
runs itself again in a child pytest with XLA_FLAGS set. Its multi-device tests carry the `multidevice` marker:
they skip in the parent (tests/conftest.py) and are the only ones the child runs (the others ran in the parent)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from opt_serving import jax_env

FLAG = f"{jax_env.HOST_DEVICES}=8"
IN_CHILD = FLAG in os.environ.get("XLA_FLAGS", "")
# pytest's exit statuses
_PYTEST_STATUS = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error", 5: "no tests ran"}


MARKER = "multidevice"


def rerun_with_8_devices(test_file: str, hang_limit_s: float = 3600.0, marker: str | None = MARKER) -> str:
    """Run `test_file`'s tests with `marker` (None: all of them) in a child pytest that sees 8 CPU devices; its
    output. When the child fails, is killed (the kernel's OOM killer: SIGKILL) or hangs past `hang_limit_s` (a
    guard against hanging only), AssertionError saying how it ended, which test was running, and its last output
    (stdout and stderr interleaved, as they came)."""
    env = {**os.environ, **jax_env.host_devices(8), "JAX_PLATFORMS": "cpu"}
    # -v: each test's name is printed as it starts, so a child that dies names the test it died in
    select = ["-m", marker] if marker else []
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *select, test_file],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=hang_limit_s)
        ended = how_it_ended(proc.returncode)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        ended = f"still running after {hang_limit_s:.0f} s: killed"
    if proc.returncode != 0:
        raise AssertionError(f"the 8-device child pytest {ended}; running: {running_test(out)}\n"
                             f"--- its last output ---\n{out[-6000:]}")
    return out


def how_it_ended(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        why = " (as the kernel's OOM killer does)" if -returncode == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with status {returncode} ({_PYTEST_STATUS.get(returncode, 'unknown')})"


def running_test(out: str) -> str:
    """The last test pytest -v started and did not finish, or the last one it finished."""
    lines = [ln for ln in out.splitlines() if "::" in ln]
    if not lines:
        return "none started (collection?)"
    last = lines[-1]
    finished = re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", last)
    return f"{last.split()[0]} ({'finished: ' + finished.group(1) if finished else 'unfinished'})"

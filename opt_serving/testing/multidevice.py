"""Multi-device JAX tests on a CPU: jax must see 8 host devices before it is imported, so a test file
runs itself again in a child pytest with XLA_FLAGS set (its multi-device tests skip in the parent)."""
from __future__ import annotations

import os
import subprocess
import sys

FLAG = "--xla_force_host_platform_device_count=8"
IN_CHILD = FLAG in os.environ.get("XLA_FLAGS", "")


def rerun_with_8_devices(test_file: str) -> str:
    """Run `test_file` in a child pytest that sees 8 CPU devices; its output (AssertionError if it failed)."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip(),
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                       env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise AssertionError(r.stdout[-4000:] + r.stderr[-2000:])
    return r.stdout

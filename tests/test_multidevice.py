"""The 8-device child pytest (testing/multidevice.py) says why it failed: how it ended (an exit status, or the
signal that killed it, as the OOM killer's SIGKILL), the test it was in, and its last output."""
import textwrap

import pytest

from opt_serving.testing.multidevice import rerun_with_8_devices

CHILD_TESTS = textwrap.dedent("""
    import os, signal, jax

    def test_sees_eight_devices():
        assert len(jax.devices()) == 8

    def test_{name}():
        print("about to {name}", flush=True)
        {body}
""")


def child(tmp_path, name: str, body: str) -> str:
    path = tmp_path / f"test_child_{name}.py"
    path.write_text(CHILD_TESTS.format(name=name, body=body))
    return str(path)


def test_a_killed_child_names_the_signal_and_the_test_it_died_in(tmp_path):
    with pytest.raises(AssertionError) as e:
        rerun_with_8_devices(child(tmp_path, "dies", "os.kill(os.getpid(), signal.SIGKILL)"), marker=None)
    message = str(e.value)
    assert "was killed by SIGKILL (as the kernel's OOM killer does)" in message
    assert "test_child_dies.py::test_dies (unfinished)" in message
    assert "test_sees_eight_devices PASSED" in message  # its output, up to where it stopped


def test_a_failing_child_gives_its_status_and_the_failure(tmp_path):
    with pytest.raises(AssertionError) as e:
        rerun_with_8_devices(child(tmp_path, "fails", "assert 1 + 1 == 3, 'arithmetic is broken'"), marker=None)
    message = str(e.value)
    assert "exited with status 1 (tests failed)" in message and "arithmetic is broken" in message


def test_a_passing_child_returns_its_output(tmp_path):
    out = rerun_with_8_devices(child(tmp_path, "passes", "pass"), marker=None)
    assert "2 passed" in out

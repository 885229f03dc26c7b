"""`opt-serving serve` beside another program's Ray cluster (service/cli.py): it never prints a URL that does
not answer, never replaces a Serve application it did not deploy, exits within 10 s of Ctrl-C when the cluster
it joined has gone, refuses a --port another process holds (naming it), and with Ray's address file naming a
dead head starts a Ray of its own, saying so. The other cluster is started here (`ray start --head` with a
temp folder, and so an address file, of its own: testing/ray_cluster.py's foreign_head) and killed at the end;
every command runs with that temp folder as RAY_TMPDIR, so no other cluster on the machine takes part."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from opt_serving.service.ports import free_port
from opt_serving.testing.cli_server import wait_for_line

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("OPT_SERVING_SKIP_RAY") == "1", reason="OPT_SERVING_SKIP_RAY=1")]
REPO = Path(__file__).resolve().parents[1]


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths live under it


def _env(env: dict) -> dict:
    return {**env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _serve(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "opt_serving", "serve", "--engine", "fake", "--drain-timeout", "2",
                             *args], cwd=REPO, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _get(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()



def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def foreign_serve():
    """Another program's cluster running a Serve application named 'opt' (the fake engine) on its own port."""
    from opt_serving.testing.ray_cluster import foreign_head
    tmp = _tmp()
    port = free_port()
    with foreign_head(tmp) as (address, env):
        deploy = ("import ray\nfrom ray import serve\nfrom opt_serving.service.deployment import build_app\n"
                  f"ray.init(address={address!r})\n"
                  f"serve.start(http_options={{'host': '127.0.0.1', 'port': {port}}})\n"
                  "serve.run(build_app({'engine': 'fake', 'max_batch_size': 2, 'max_seq_len': 77}), name='opt', "
                  "route_prefix='/')\n")
        subprocess.run([sys.executable, "-c", deploy], env=_env(env), cwd=REPO, check=True, timeout=600,
                       capture_output=True)
        yield address, env, port


@pytest.mark.parametrize("same_port", [False, True], ids=["its serve on another port", "its app on our port"])
def test_a_cluster_already_serving_is_left_as_it_is_and_the_command_says_why(foreign_serve, same_port):
    address, env, their_port = foreign_serve
    assert '"max_model_len":77' in _get(f"http://127.0.0.1:{their_port}/v1/models")  # theirs (ours would say 256)
    port = their_port if same_port else free_port()
    proc = _serve(env, "--port", str(port))
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        _stop(proc)
    assert proc.returncode == 2, out
    assert f"http://127.0.0.1:{port}/" not in out  # no URL printed
    if same_port:
        assert f"already runs a Serve application named 'opt' that this command did not deploy" in out, out
    else:
        assert f"its HTTP proxy on 127.0.0.1:{their_port}" in out and f"--port {their_port}" in out, out
    assert address in out and "--ray-address local" in out
    assert '"max_model_len":77' in _get(f"http://127.0.0.1:{their_port}/v1/models")  # still theirs, answering


def test_ctrl_c_exits_within_10_s_when_the_joined_cluster_has_gone():
    from opt_serving.testing.ray_cluster import foreign_head, kill_processes_naming
    tmp = _tmp()
    port = free_port()
    with foreign_head(tmp) as (address, env):
        proc = _serve(env, "--port", str(port))
        try:
            out = "".join(wait_for_line(proc, f"opt-serving: serving the fake engine at http://127.0.0.1:{port}/",
                                          timeout=400))
            assert "Serve proxy" in out, out  # a cluster it did not start: Serve's proxy on --port
            assert "ok" in _get(f"http://127.0.0.1:{port}/health")
            assert kill_processes_naming(str(tmp)) > 0  # the cluster goes away under it
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
            assert time.monotonic() - t0 < 10, proc.stdout.read()
        finally:
            _stop(proc)


def test_a_taken_port_is_refused_before_ray_starts_naming_its_holder():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _serve({**os.environ, "RAY_TMPDIR": str(_tmp())}, "--port", str(port), "--ray-address", "local")
        try:
            out, _ = proc.communicate(timeout=120)
        finally:
            _stop(proc)
    assert proc.returncode == 2, out
    assert f"--port {port} on 127.0.0.1 is taken by process {os.getpid()}" in out, out


def test_a_stale_address_file_serves_on_a_ray_of_its_own_saying_so():
    tmp = _tmp()
    (tmp / "ray").mkdir()
    dead = f"127.0.0.1:{free_port()}"
    (tmp / "ray" / "ray_current_cluster").write_text(dead)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = _serve({**env, "RAY_TMPDIR": str(tmp)}, "--port", str(port), "--num-cpus", "2")
    try:
        out = "".join(wait_for_line(proc, f"opt-serving: serving the fake engine at http://127.0.0.1:{port}/",
                                          timeout=400))
        assert f"names a head at {dead} that does not answer" in out and "starting a Ray of its own" in out, out
        assert "ok" in _get(f"http://127.0.0.1:{port}/health")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        _stop(proc)
        from opt_serving.testing.ray_cluster import kill_processes_naming
        kill_processes_naming(str(tmp))

"""A multi-node Ray cluster simulated on this machine (tests, benchmarks): `ray.cluster_utils.Cluster`,
each node with its own custom resource ("node0", "node1", ...) so a test can tell where things ran; and
`no_foreign_clusters()`, which keeps tests and benchmarks off Ray clusters they did not start."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


def no_foreign_clusters() -> bool:
    """Make Ray's address discovery find no cluster, in this process: `ray.init()` with no address (which
    joins the latest `ray start` or `ray.cluster_utils.Cluster` on the machine, or $RAY_ADDRESS) and with
    address="auto" (which joins any Ray found running here; the alpa/ backend's `connect_ray` does this, as
    a notebook should) then start a Ray of their own or find none. Another program's cluster on the machine
    can then neither change a test's result nor be used by it. Clusters a test starts are joined by their
    address (`simulated_cluster`) or started with address="local". False where Ray is not installed."""
    os.environ.pop("RAY_ADDRESS", None)
    try:
        from ray._private import services
    except ImportError:
        return False

    def none_found():
        return []
    none_found.cache_clear = lambda: None  # what Ray calls on the function it replaces
    services.find_gcs_addresses = none_found
    services.find_bootstrap_address = lambda temp_dir=None: None
    return True


@contextlib.contextmanager
def simulated_cluster(nodes: int = 2, cpus_per_node: int = 2) -> Iterator:
    """Start the nodes and connect this process as the driver; on exit, Serve (if started), the driver
    and every node are stopped (only the processes this started)."""
    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": cpus_per_node, "resources": {"node0": 1}, "include_dashboard": False})
    try:
        for i in range(1, nodes):
            cluster.add_node(num_cpus=cpus_per_node, resources={f"node{i}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        yield cluster
    finally:
        try:
            if ray.is_initialized():
                from ray import serve
                with contextlib.suppress(Exception):
                    serve.shutdown()
                ray.shutdown()
        finally:
            cluster.shutdown()


def node_names() -> dict[str, str]:
    """Ray node id -> the simulated node's name ("node0", ...)."""
    import ray
    return {n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node") and k[4:].isdigit())
            for n in ray.nodes() if n.get("Alive")}


def stage_actors() -> list[dict]:
    """Every live pipeline stage actor in the cluster, by name: its node id, pid and devices."""
    import ray
    from opt_serving.parallel.pipeline import STAGE_NAME_PREFIX
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(STAGE_NAME_PREFIX):
            try:
                out.append(ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).where.remote(), timeout=30))
            except Exception:  # just died: not live
                pass
    return out


@contextlib.contextmanager
def foreign_head(tmp, num_cpus: int = 2, dashboard_port: int | None = None,
                 env_vars: dict | None = None) -> Iterator[tuple[str, dict]]:
    """Another program's Ray cluster on this machine, as a user starts one: `ray start --head --port=<free>`,
    with Ray's temp folder (and so its address file) in `tmp` (RAY_TMPDIR) and a token of its own. Yields (its
    GCS address, the environment a process joining it uses). `dashboard_port`: with the dashboard there, on
    127.0.0.1 (what `serve deploy` and `serve status` talk to); `env_vars`: set for the cluster's processes too
    (PYTHONPATH: the replicas import the package under test). On exit, exactly the processes it started are
    killed (their command lines name `tmp`; `ray stop` would stop every Ray on the machine)."""
    import os
    import secrets
    import subprocess
    import sys
    from pathlib import Path

    from opt_serving.service.ports import free_port
    tmp = Path(tmp)
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0", **(env_vars or {})}
    env.pop("RAY_ADDRESS", None)
    ray_cli = str(Path(sys.executable).parent / "ray")
    dashboard = ["--include-dashboard=false"] if dashboard_port is None else [
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
    try:
        # (Ray's client server on a free port too: its default, 10001, may be another cluster's on this machine)
        subprocess.run([ray_cli, "start", "--head", f"--port={free_port()}", f"--num-cpus={num_cpus}",
                        f"--ray-client-server-port={free_port()}", *dashboard, "--disable-usage-stats"],
                       env=env, check=True, timeout=180, capture_output=True)
        address = (tmp / "ray" / "ray_current_cluster").read_text().strip()
        yield address, env
    finally:
        kill_processes_naming(str(tmp))


def kill_processes_naming(text: str) -> int:
    """SIGKILL every process whose command line contains `text` (a cluster's own temp folder), and Ray's client
    server whose RAY_TMPDIR is it (`ray start` leaves it an orphan naming no folder), and their descendants (Ray's
    workers retitle themselves `ray::...`), and wait for them; returns how many there were. Never this process
    or its parents; never another program that merely runs with that RAY_TMPDIR (a server joining the cluster)."""
    import os

    import psutil
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    procs = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
            if p.pid not in spared and (text in cmdline or ("ray.util.client.server" in cmdline
                                                            and p.environ().get("RAY_TMPDIR") == text)):
                for q in [p, *p.children(recursive=True)]:
                    procs[q.pid] = q
        except psutil.Error:  # gone, or another user's
            pass
    procs = list(procs.values())
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)
    return len(procs)

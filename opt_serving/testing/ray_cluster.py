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

"""A multi-node Ray cluster simulated on this machine (tests, benchmarks): `ray.cluster_utils.Cluster`,
each node with its own custom resource ("node0", "node1", ...) so a test can tell where things ran."""
from __future__ import annotations

import contextlib
from typing import Iterator


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

"""The Ray `opt-serving serve` runs on: joining a cluster or starting a local Ray, the environment and priority of
the processes of a Ray started here, and stopping what the command started.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

from opt_serving.parallel import ray_address


def start_ray(found, num_cpus: int | None, local_env: dict | None = None) -> bool:
    """Join `found` (ray_address.find_cluster's pick: a cluster that answers), or with none start a local Ray
    with `local_env` set for its processes. Returns True when we started it."""
    import ray
    if ray.is_initialized():
        return False
    if found.note:
        print(f"opt-serving serve: {found.note}; "
              + (f"joining the Ray cluster at {found.address}" if found.address else "starting a Ray of its own"),
              file=sys.stderr, flush=True)
    if found.address is not None:
        ray.init(address=found.address, log_to_driver=False)
        return False
    os.environ.update(local_env or {})  # Ray's processes (controller, replicas) inherit it from here
    ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, log_to_driver=False)
    return True


def wants_direct_ingress(ingress: str, num_replicas: int | None) -> bool:
    """Direct ingress gives each replica its own port, so only one replica can own --port."""
    return ingress == "direct" or (ingress == "auto" and (num_replicas or 1) == 1)


def local_ray_env(args: argparse.Namespace, direct: bool) -> dict:
    """Environment for the processes of a Ray started here (an existing cluster keeps its own)."""
    local_env = replica_priority_env(args.ray_nice)
    if direct:
        local_env.update(direct_ingress_env(args.port, args.drain_timeout))
    return local_env


def direct_ingress_env(port: int, drain_s: float) -> dict:
    """Ray Serve's throughput-optimised mode (the replica runs the ASGI app on its own HTTP port,
    user code on the main loop, no proxy hop) with that port pinned to ours.
    A replica normally keeps answering 30 s after shutdown starts, for load balancers to notice;
    one machine has none, so it drains for --drain-timeout only.
    A replica's port is normally held out of the pool for 150 s after the replica stops (Ray Serve's
    RAY_SERVE_PORT_QUARANTINE_S: HAProxy's hard-stop-after, 120 s, + 30 s, so that a stale HAProxy worker
    cannot route one app's traffic to another app's replica on the same port). Here there is no HAProxy and
    the pool is the one port, so a replica replacing a dead one (SIGKILL, a failed health check) could not
    get --port for 150 s: every attempt would load the model, fail with NoAvailablePortError and be retried,
    the server refusing connections all the while."""
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # Serve's range excludes its maximum
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(max(drain_s, 0.1)),
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def replica_priority_env(ray_nice: int) -> dict:
    """Ray starts its workers at niceness 15 so that they yield to its own processes; a model replica
    that keeps every core busy then loses its cores to each of their wake-ups, and a product split
    across the cores waits for the slowest part. The replica starts at 0 instead (lower_ray_priority
    then sends Ray's own processes the other way)."""
    return {} if ray_nice < 0 else {"RAY_worker_niceness": "0"}


def lower_ray_priority(ray_nice: int, include_proxy: bool, procs=None) -> int:
    """Give the Ray processes this command started (`procs`, default: every descendant of this process),
    other than the model replicas and idle workers (a restarted replica may take one), niceness
    `ray_nice`, so that their periodic wake-ups do not take the replica's cores (benchmark/README.md has
    the measurements). Returns how many were changed."""
    if ray_nice < 0:
        return 0
    import psutil
    keep = ("ray::ServeReplica", "ray::IDLE") + (() if include_proxy else ("ray::ProxyActor",))
    changed = 0
    for proc in psutil.Process().children(recursive=True) if procs is None else procs:
        try:
            title = " ".join(proc.cmdline())
            if not title.startswith(keep) and proc.nice() < ray_nice:
                proc.nice(ray_nice)
                changed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or not ours to change
            continue
    return changed


def stop_serving(started_ray: bool, deployed: str | None, timeout_s: float) -> bool:
    """Stop what this command started: with a Ray it started, Serve and that Ray; on someone else's cluster
    only the application it deployed (`deployed`, its name), then disconnect. Bounded by `timeout_s`, and
    with a cluster that has gone (its GCS does not answer) the Serve calls, which would retry for a minute,
    are skipped. Returns False when it did not finish in time."""
    import ray

    if not ray.is_initialized():
        return True
    try:
        alive = ray_address.answers(ray.get_runtime_context().gcs_address, timeout_s=1.0)
    except Exception:
        alive = False

    def stop() -> None:
        if alive:
            from ray import serve
            if started_ray:
                serve.shutdown()
            elif deployed is not None:  # someone else's cluster: remove only our application
                serve.delete(deployed)
        ray.shutdown()  # stops the processes we started; merely disconnects otherwise

    done = threading.Event()

    def guarded() -> None:
        try:
            stop()
        except Exception as e:  # a cluster going away under us: nothing more to stop there
            print(f"opt-serving: while stopping: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            done.set()

    threading.Thread(target=guarded, daemon=True, name="opt-serving-stop").start()
    if not alive:
        print("opt-serving: the Ray cluster has gone; nothing left to stop there", file=sys.stderr, flush=True)
    return done.wait(timeout_s if alive else min(timeout_s, 5.0))

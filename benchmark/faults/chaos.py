"""Chaos under load: 16 streaming clients while a random component is SIGKILLed every 10-20 s.

    .venv/bin/python benchmark/faults/chaos.py --config embedded [--minutes 5] [--ingress auto|proxy]
    .venv/bin/python benchmark/faults/chaos.py --config pp2 [--minutes 5]

embedded: `opt-serving serve` (the embedded tiny model, a private Ray started by it, direct ingress unless
--ingress proxy); the kills: the model replica, Serve's proxy, Serve's controller.
pp2: alpa/opt-tiny pipelined over two stage actors (pipeline_parallel=2) on a two-node Ray cluster simulated
on this machine (ray.cluster_utils.Cluster, started here), behind Serve's proxy; the kills: the model replica,
a pipeline stage actor, Serve's proxy, Serve's controller.

Prints requests sent, completed and failed (by kind: an HTTP status, an error event in the stream, a stream cut
short, a refused connection), the longest time from a kill to the error of a request it failed, each kill's
recovery (served again; the killed kind running again), and what was left over at the end (processes,
placement groups). Exits 1 when a request hung, a kill did not recover, an error took longer than 60 s, or
something was left over. The machine's other load changes the figures: say so beside them.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path
import time

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark import harness  # noqa: E402
from opt_serving.testing import chaos  # noqa: E402
from opt_serving.testing.cli_server import processes_under  # noqa: E402

ERROR_BOUND_S = 60.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=["embedded", "pp2"], default="embedded")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--kinds", default=None,
                   help="comma-separated kinds to kill (replica, stage, proxy, controller; default: all of the "
                        "config's)")
    p.add_argument("--ingress", choices=["auto", "proxy"], default="auto", help="embedded only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="embedded only: file the server's output is copied to")
    return p.parse_args(argv)


def run_embedded(a, kinds) -> tuple[chaos.ChaosReport, list]:
    ingress = ["--ingress", a.ingress] if a.ingress != "auto" else []
    with harness.serve(["--num-cpus", "2", "--drain-timeout", "2", *ingress], log=a.log) as server:
        print(f"opt-serving serve (embedded model, ingress {a.ingress}) up after {server.start_s:.1f} s", flush=True)
        report = asyncio.run(chaos.run_chaos(server.url, chaos.targets(server.processes, kinds), a.minutes * 60,
                                             clients=a.clients, seed=a.seed))
    return report, [f"process {pid} {cmd}" for pid, cmd in server.left_over]


def run_pp2(a, kinds) -> tuple[chaos.ChaosReport, list]:
    import ray
    from ray import serve

    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.service.deployment import ServeArgs, build_app
    from opt_serving.service.ports import free_port
    from opt_serving.testing.ray_cluster import simulated_cluster
    folder = ensure_embedded_model()
    seen: set = set()
    left: list = []

    def under_here(marker: str) -> list[psutil.Process]:  # (noted, to be waited for at the end)
        procs = processes_under(os.getpid(), marker)
        seen.update(procs)
        return procs

    t0 = time.monotonic()
    with simulated_cluster(nodes=2, cpus_per_node=2):
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = ServeArgs(model="alpa/opt-tiny", path=str(folder), pipeline_parallel=2, max_batch_size=16,
                         max_seq_len=160)
        serve.run(build_app(args), name="opt", route_prefix="/")
        print(f"alpa/opt-tiny pp=2 on two simulated nodes up after {time.monotonic() - t0:.1f} s", flush=True)
        report = asyncio.run(chaos.run_chaos(f"http://127.0.0.1:{port}", chaos.targets(under_here, kinds),
                                             a.minutes * 60, clients=a.clients, seed=a.seed))
        seen.update(processes_under(os.getpid()))
        groups = ray.util.placement_group_table()
        live = [g for g in groups.values() if g["state"] != "REMOVED"]
        print(f"placement groups: {len(groups)} made, {len(live)} not removed (the live replica needs 1)")
        if len(live) != 1:
            left.append(f"placement groups not removed: {[(g['placement_group_id'], g['state']) for g in live]}")
    _, alive = psutil.wait_procs(list(seen), timeout=30)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"process {p.pid} {' '.join(p.cmdline())[:80]}")
                p.kill()
    return report, left


def main(argv=None) -> int:
    a = parse_args(argv)
    everything = ["replica", "proxy", "controller"] + (["stage"] if a.config == "pp2" else [])
    kinds = a.kinds.split(",") if a.kinds else everything
    print(f"chaos: config {a.config}, {a.minutes} min, {a.clients} streaming clients, killing {kinds} "
          f"every 10-20 s (after the previous kill recovered)", flush=True)
    report, left = (run_embedded if a.config == "embedded" else run_pp2)(a, kinds)
    for line in report.lines():
        print(line)
    print(f"left over at the end: {left or 'nothing'}")
    hung = report.failed.get(chaos.HUNG, 0)
    unrecovered = [k for k in report.kills if k.served_again_s is None or k.replaced_s is None]
    ok = not hung and not unrecovered and not left and report.longest_time_to_error < ERROR_BOUND_S
    print("PASS" if ok else f"FAIL: hung {hung}, not recovered {len(unrecovered)}, left over {len(left)}, "
                            f"longest time to an error {report.longest_time_to_error:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(harness.script(main))

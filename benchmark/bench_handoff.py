"""Stage hand-off of the pipelined decode loop: Ray object refs (what RayStages chains today) against Ray Compiled
Graphs (ray.dag, shared-memory channels on a CPU), at OPT-1.3b's and OPT-6.7b's hidden sizes.

    python benchmark/bench_handoff.py [--hidden 2048,4096] [--rows 1,8] [--stages 2] [--steps 300]

Two (or --stages) actors on a two-node Ray cluster simulated on this machine (started and stopped here), each
a stand-in stage: it takes the previous stage's hidden states [rows, hidden] (float32), adds one to them (a
stage's compute is left out: this is the hand-off alone) and hands them on; the driver sends the decode step's
input and waits for the last stage's output, as Slots does for one micro-batch. Printed per configuration: the
median and p90 of a whole step (driver -> every stage -> driver) for each path, alternating between them in
rounds so that other work on the machine hits both alike.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Stage:
    def step(self, x):
        return x + np.float32(1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="2048,4096", help="hidden sizes (OPT-1.3b: 2048, OPT-6.7b: 4096)")
    p.add_argument("--rows", default="1,8", help="rows of a micro-batch")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="steps per path and configuration")
    p.add_argument("--rounds", type=int, default=5, help="alternations between the two paths")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes the stages are spread over (1: one node)")
    return p.parse_args(argv)


def chain_refs(actors, x):
    for a in actors:
        x = a.step.remote(x)
    return x


def main(argv=None) -> None:
    args = parse_args(argv)
    import ray
    from ray.dag import InputNode

    from opt_serving.testing.ray_cluster import simulated_cluster
    with simulated_cluster(nodes=args.nodes, cpus_per_node=max(1, args.stages)):
        actors = [ray.remote(num_cpus=0, resources={f"node{i % args.nodes}": 0.01})(Stage).remote()
                  for i in range(args.stages)]
        with InputNode() as inp:
            node = inp
            for a in actors:
                node = a.step.bind(node)
        compiled = node.experimental_compile()
        print(f"{args.stages} stages on {args.nodes} simulated node(s); a step: driver -> stages -> driver; "
              f"{args.steps} steps x {args.rounds} rounds per path; ms")
        print(f"{'hidden':>6} {'rows':>4} {'KiB':>6} {'refs p50':>9} {'refs p90':>9} {'cgraph p50':>11} "
              f"{'cgraph p90':>11} {'refs/cgraph':>11}")
        try:
            for hidden in (int(h) for h in args.hidden.split(",")):
                for rows in (int(r) for r in args.rows.split(",")):
                    x = np.zeros((rows, hidden), np.float32)
                    times = {"refs": [], "cgraph": []}
                    ray.get(chain_refs(actors, x))  # warm
                    compiled.execute(x).get()
                    for _ in range(args.rounds):
                        for path in ("refs", "cgraph"):
                            for _ in range(args.steps // args.rounds):
                                t0 = time.perf_counter()
                                if path == "refs":
                                    out = ray.get(chain_refs(actors, x))
                                else:
                                    out = compiled.execute(x).get()
                                times[path].append(time.perf_counter() - t0)
                                assert out[0, 0] == args.stages
                    q = {k: (statistics.median(v) * 1e3, np.percentile(v, 90) * 1e3) for k, v in times.items()}
                    print(f"{hidden:>6} {rows:>4} {x.nbytes / 1024:>6.0f} {q['refs'][0]:>9.3f} {q['refs'][1]:>9.3f} "
                          f"{q['cgraph'][0]:>11.3f} {q['cgraph'][1]:>11.3f} {q['refs'][0] / q['cgraph'][0]:>11.2f}",
                          flush=True)
        finally:
            compiled.teardown()


if __name__ == "__main__":
    main()

"""Stage hand-off of the pipelined decode loop: Ray object refs (what RayStages chains today) against Ray Compiled
Graphs (ray.dag, shared-memory channels on a CPU), at OPT-1.3b's and OPT-6.7b's hidden sizes.

    python benchmark/scale/bench_handoff.py [--hidden 2048,4096] [--rows 1,8] [--stages 2] [--steps 300]
    python benchmark/scale/bench_handoff.py --decode [--model alpa/opt-125m] [--path FOLDER] [--pp 2] [--slots 16]

Two (or --stages) actors on a two-node Ray cluster simulated on this machine (started and stopped here), each
a stand-in stage: it takes the previous stage's hidden states [rows, hidden] (float32), adds one to them (a
stage's compute is left out: this is the hand-off alone) and hands them on; the driver sends the decode step's
input and waits for the last stage's output, as Slots does for one micro-batch. Printed per configuration: the
median and p90 of a whole step (driver -> every stage -> driver) for each path, alternating between them in
rounds so that other work on the machine hits both alike.

`--decode`: the real pipelined decode loop instead (runner.slots.Slots.step over pipeline.RayStages, `--groups`
micro-batches in flight), one pipeline per hand-off (handoff="refs" and "cgraph") over the same weights (`--path`,
a numpy folder, default /tmp/bench/opt125/np where it exists, else random weights of `--model`'s shape), both
on one simulated node (compiled graphs are used on one node only). Every slot holds the same greedy prompt; each
round times `--steps` steps on one pipeline then the other, alternating; printed: each round's decode rate (tokens
a second over all slots) with the time a stage's call took (its compute), the median, whether both gave the same
tokens, and the CPU each stage process takes while both pipelines are idle.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving


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
    p.add_argument("--decode", action="store_true", help="the pipelined decode loop's rate, refs against cgraph")
    p.add_argument("--model", default="alpa/opt-125m", help="--decode: the model's shape (random weights)")
    p.add_argument("--path", default=None, help="--decode: a numpy weights folder (default /tmp/bench/opt125/np "
                                                "where it exists, else random weights)")
    p.add_argument("--pp", type=int, default=2, help="--decode: pipeline stages")
    p.add_argument("--slots", type=int, default=16, help="--decode: decode slots")
    p.add_argument("--groups", type=int, default=2, help="--decode: micro-batch groups in flight")
    p.add_argument("--prompt-len", type=int, default=8, help="--decode: the prompt's tokens")
    p.add_argument("--cpus-per-stage", type=int, default=1, help="--decode: CPUs (kernel threads) a stage uses")
    return p.parse_args(argv)


def chain_refs(actors, x):
    for a in actors:
        x = a.step.remote(x)
    return x


def decode_rates(args) -> None:
    import types

    import ray

    from opt_serving.config import config_for
    from opt_serving.parallel.pipeline import RayStages
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.types import SlotSettings
    from opt_serving.testing.ray_cluster import simulated_cluster
    folder = args.path or (DEFAULT_FOLDER if Path(DEFAULT_FOLDER, "config.json").is_file() else None)
    cfg = config_for(args.model, folder)
    steps, max_seq_len = args.steps // args.rounds, 256
    if args.prompt_len + steps >= max_seq_len:
        raise SystemExit(f"--prompt-len + --steps / --rounds must stay under {max_seq_len}")
    plan = types.SimpleNamespace(pp=args.pp, tp=1, layer_split=None)
    paths = ("refs", "cgraph")
    with simulated_cluster(nodes=1, cpus_per_node=2 * args.pp * args.cpus_per_stage):
        pipes = {}
        for h in paths:
            stages = RayStages(cfg, plan, folder, rows=args.slots // args.groups, groups=args.groups,
                               max_seq_len=max_seq_len, cpus_per_stage=args.cpus_per_stage, handoff=h)
            assert stages.handoff == h, stages.handoff_reason
            slots = Slots(cfg, stages, args.slots, args.groups, max_seq_len)
            pipes[h] = (slots, slots.prefill([cfg.bos_token_id] + [100 + i for i in range(args.prompt_len - 1)],
                                             SlotSettings(max_tokens=max_seq_len)))

        def run(h):
            """`steps` steps of every slot from the prompt -> (seconds, tokens, slot 0's tokens)."""
            slots, prefix = pipes[h]
            for s in range(args.slots):
                slots.insert(prefix, s, keep=True)
            slots.stages.get([slots.stages.call(i, "ready") for i in range(args.pp)])  # the inserts are in
            ray.get([a.reset_stats.remote() for a in slots.stages.actors])
            t0, tokens, first = time.perf_counter(), 0, []
            for _ in range(steps * args.groups):  # each step() returns one group's tokens
                r = slots.step()
                rows = r.rows if r.rows is not None else np.ones(args.slots, bool)
                tokens += int(rows.sum())
                if rows[0]:
                    first.append(int(r.tokens[0]))
            dt = time.perf_counter() - t0
            busy[h].append([st["busy_s"] / max(st["calls"], 1) for st in
                            ray.get([a.stats.remote() for a in slots.stages.actors])])
            for s in range(args.slots):
                slots.free(s)
            while slots._flights:  # the groups still in the stages come back with nothing to hand out
                slots.step()
            return dt, tokens, first

        busy = {h: [] for h in paths}
        made = {h: run(h)[2] for h in paths}  # compiles every window the rounds reach
        print(f"{args.model} ({'folder ' + str(folder) if folder else 'random weights'}), pp={args.pp}, "
              f"{args.slots} slots in {args.groups} groups, prompt {args.prompt_len}, {steps} steps a round, "
              f"{args.cpus_per_stage} CPU a stage, one simulated node; decode tokens/s")
        rates = {h: [] for h in paths}
        for k in range(args.rounds):
            for h in (paths if k % 2 == 0 else paths[::-1]):
                dt, tokens, first = run(h)
                assert first == made[h]
                rates[h].append(tokens / dt)
            print(f"round {k}: " + "  ".join(
                f"{h} {rates[h][-1]:7.1f} (a stage's call: " + ", ".join(f"{b * 1e3:.1f}" for b in busy[h][-1]) + " ms)"
                for h in paths), flush=True)
        med = {h: statistics.median(v) for h, v in rates.items()}
        print("median:  " + "  ".join(f"{h} {med[h]:7.1f}" for h in paths) +
              f"  cgraph/refs {med['cgraph'] / med['refs']:.3f}")
        print(f"same tokens through both: {made['refs'] == made['cgraph']}")
        idle = idle_cpu({h: [w["pid"] for w in pipes[h][0].stages.where()] for h in paths})
        print("CPU seconds a second each stage process takes while its pipeline is idle (5 s): " + "  ".join(
            f"{h} " + ", ".join(f"{c:.2f}" for c in idle[h]) for h in paths))
        for slots, _ in pipes.values():
            slots.close()


DEFAULT_FOLDER = "/tmp/bench/opt125/np"


def idle_cpu(pids: dict, seconds: float = 5.0) -> dict:
    """CPU seconds a second each process (on this machine) takes over `seconds` (/proc/PID/stat)."""
    import os

    def used(pid):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    before, t0 = {h: [used(p) for p in ps] for h, ps in pids.items()}, time.perf_counter()
    time.sleep(seconds)
    dt = time.perf_counter() - t0
    return {h: [(used(p) - b) / dt for p, b in zip(ps, before[h])] for h, ps in pids.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.decode:
        return decode_rates(args)
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

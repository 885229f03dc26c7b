"""Plan quality: run every candidate plan, print the planner's estimate beside the measured time.

    .venv/bin/python benchmark/scale/benchmark_plans.py [--model opt-125m] [--devices 8] [--max-seq-len 256]

On this machine's CPU with N host devices (XLA_FLAGS is set here, before jax loads). The
device spec is calibrated first, the way Alpa profiled stages: the model's decode stages
are timed at each tp degree (1, 4 and all layers, embeddings, logits head; profile.py),
in this process for pp = 1 plans and inside Ray stage actors for pp > 1 plans, and the
Ray hand-off is measured. The planner ranks every feasible
dp x pp x tp plan for batch 1 (latency) from those measurements, and each plan's decode
step is then measured: pp = 1 as a tensor-parallel group in this process, pp > 1 as Ray
stage actors, all built first and then timed in interleaved rounds. Plans are compared by
their median step (the machine is shared and unevenly loaded; the interquartile range is
printed as the spread). Batch 1 keeps one replica busy, so dp does not change the time.
Dummy weights, float32 (this CPU has no fast float16).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m")
    p.add_argument("--devices", type=int, default=8, help="host devices (one node)")
    p.add_argument("--max-seq-len", type=int, default=256, help="KV cache length per sequence")
    p.add_argument("--steps", type=int, default=5, help="decode steps timed per plan per round")
    p.add_argument("--rounds", type=int, default=12, help="interleaved timing rounds")
    p.add_argument("--max-pp", type=int, default=4, help="skip plans with more stages")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from opt_serving import jax_env  # (imports no JAX: the devices are set before JAX loads)
    os.environ.update(jax_env.host_devices(args.devices))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import ray
    from tqdm import tqdm

    from opt_serving.config import get_config
    from opt_serving.model import param_tree
    from opt_serving.model.wrapper import OPTModel
    from opt_serving.parallel.cluster import calibrate, cluster_from_jax
    from opt_serving.parallel.handoff_choice import measure_handoff_latency
    from opt_serving.parallel.pipeline import RayStages
    from opt_serving.parallel.planner import search
    from opt_serving.parallel.sharding import make_mesh, shard_params

    cfg = get_config(args.model)
    L = args.max_seq_len
    assert len(jax.devices()) == args.devices, "XLA_FLAGS did not take: was jax imported first?"
    # every plan's stage actors stay up at once (1 logical CPU each); they are idle between turns
    ray.init(address="local", num_cpus=64, include_dashboard=False, logging_level="ERROR")  # never another's
    load = os.getloadavg()
    spec = calibrate(model=cfg, batch=1, context=L, dtype="float32", stage_actors=True)
    hop = measure_handoff_latency()
    spec = dataclasses.replace(spec, handoff_latency_s=hop, remote_call_s=hop)
    cluster = dataclasses.replace(cluster_from_jax(), spec=spec)
    print(f"load average before calibrating: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"calibrated: dispatch {spec.launch_overhead_s * 1e6:.0f} us, Ray hand-off "
          f"{spec.handoff_latency_s * 1e3:.2f} ms, host-device pool {spec.pool:.2f}")
    depths = [n for n, _ in spec.profile.by_tp[0][1].middle_s]
    for where, table in (("in this process (pp = 1 plans)", spec.profile.by_tp),
                         ("in Ray stage actors (pp > 1 plans)", spec.profile.stage_by_tp)):
        print(f"profiled {args.model} decode stages {where}, batch 1, KV cache {L}, float32; "
              f"ms, medians:")
        print(f"{'tp':>4} " + " ".join(f"{f'{n} layers':>9}" for n in depths)
              + f" {'per layer':>9} {'embed':>8} {'head':>8} {'spread':>7}")
        for tp, t in table:
            print(f"{tp:>4} " + " ".join(f"{s * 1e3:>9.2f}" for _, s in t.middle_s)
                  + f" {t.layer_s * 1e3:>9.2f} {t.embed_s * 1e3:>8.2f} {t.head_s * 1e3:>8.2f} "
                  f"{t.spread:>7.0%}")
    result = search(cfg, cluster, model=args.model, batch_size=1, max_seq_len=L, dtype="float32")
    plans = [p for p in result.plans if p.pp <= args.max_pp]
    params = param_tree.init_params(cfg, 0, jnp.float32)
    ids = np.arange(3, 3 + 16, dtype=np.int32)[None]
    mask = np.ones_like(ids)

    # Build every plan first, then time them in interleaved rounds: other processes on this
    # machine load it unevenly, and taking turns spreads the drift over every plan.
    steps = {}
    pipes = []
    tok, pos, idx = (np.array([5], np.int32), np.array([16], np.int32), np.array([16], np.int32))
    for plan in tqdm(plans, desc="building plans", unit="plan"):
        if plan.pp == 1:
            mesh = make_mesh(jax.devices()[:plan.tp], plan.tp)
            model = OPTModel(cfg, shard_params(params, cfg, mesh), mesh=mesh, plan=plan)
            state = {"cache": model.prefill(model.init_cache(1, L), ids, mask, False)[1]}

            def step(model=model, state=state):
                out, state["cache"] = model.decode(state["cache"], tok, pos, idx)
                out.block_until_ready()
        else:
            from opt_serving.runner.generate import Generation
            pipe = Generation(cfg, RayStages(cfg, plan, None, seed=0), plan)  # the same random weights
            pipes.append(pipe)
            key = pipe._open(1, L)
            pipe.stages.get(pipe._chain("prefill", key, ids, mask, False))

            def step(pipe=pipe, key=key):
                pipe.stages.get(pipe._chain("decode", key, tok, pos, idx))
        step()                                   # compile and warm
        steps[plan.degrees] = step
    samples = {d: [] for d in steps}
    for _ in tqdm(range(args.rounds), desc="timing rounds", unit="round"):
        for d, step in steps.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                samples[d].append(time.perf_counter() - t0)
    best = {d: min(t) for d, t in samples.items()}
    measured = {d: float(np.median(t)) for d, t in samples.items()}
    spread = {d: float(np.subtract(*np.percentile(t, [75, 25]))) / measured[d]
              for d, t in samples.items()}
    for pipe in pipes:
        pipe.close()
    ray.shutdown()

    fastest = min(measured.values())
    chosen = plans[0]
    load = os.getloadavg()
    print(f"\n{args.model}, batch 1, KV cache {L}, {args.devices} host devices "
          f"(CPU shared by all of them), float32; ms per decode step, median and best of "
          f"{args.rounds * args.steps} in {args.rounds} interleaved rounds, spread = interquartile "
          f"range / median; load average after timing {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'plan':<20} {'layers':<18} {'estimate':>9} {'median':>9} {'best':>9} {'spread':>7} "
          f"{'est/med':>8}")
    for p in plans:
        m = measured[p.degrees]
        tag = (" <- chosen" if p is chosen else "") + (" (fastest measured)" if m == fastest else "")
        split = ",".join(map(str, p.layer_split))
        print(f"{p.name:<20} {split:<18} {p.step_s * 1e3:>9.2f} {m * 1e3:>9.2f} "
              f"{best[p.degrees] * 1e3:>9.2f} {spread[p.degrees]:>7.0%} {p.step_s / m:>8.2f}{tag}")
    ratio = measured[chosen.degrees] / fastest
    ok = ratio <= 1.15
    print(f"\nchosen {chosen.name}: {ratio:.3f}x the fastest measured median -> "
          f"{'within' if ok else 'NOT within'} 15%")
    est_rank = [p.degrees for p in plans]
    meas_rank = sorted(measured, key=measured.get)
    print(f"estimated order: {[f'pp{d[1]}tp{d[2]}' for d in est_rank]}")
    print(f"measured order:  {[f'pp{d[1]}tp{d[2]}' for d in meas_rank]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

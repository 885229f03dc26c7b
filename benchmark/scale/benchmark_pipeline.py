"""Served pp = 1 against pp = 2 on a two-node Ray cluster simulated on this machine.

    python benchmark/scale/benchmark_pipeline.py [--model alpa/opt-125m] [--tokenizer ../shared/opt-assets]
    python benchmark/scale/benchmark_pipeline.py --plans 2 --weights float32,int8 --concurrency 32

For each plan it deploys the app under Ray Serve (the stages in the replica's placement group, one per
node), runs benchmark_serving.py's load generator at each concurrency, and prints output tokens/s, TTFT
and TPOT, plus each stage's busy fraction over the run (time in its prefill and decode calls / wall
time: what the micro-batching leaves of the pipeline bubble). It also prints the Ray hand-off time of a
stage's hidden states and the planner's figures for OPT-175B on Alpa's 4 x 8 x 16 GB cluster.

Every simulated node shares this machine's cores: pp = 2 here measures the pipeline's overheads and
its bubble, not a speed-up from more hardware.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving

ASSETS = Path(__file__).resolve().parents[3] / "shared" / "opt-assets"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="alpa/opt-125m", help="an alpa/ model, random weights of its size")
    p.add_argument("--tokenizer", default=str(ASSETS), help="tokenizer folder for the random-weight model")
    p.add_argument("--plans", default="1,2", help="pipeline degrees to serve, comma separated")
    p.add_argument("--weights", default="float32", help="float32, int8 (--quantize int8) or both, comma separated")
    p.add_argument("--concurrency", default="8,32", help="client counts, comma separated")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", default="8:8")
    p.add_argument("--output-len", default="64:64")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--cpus-per-node", type=int, default=2)
    return p.parse_args(argv)


def stage_stats(reset: bool = False) -> list[dict]:
    import ray
    from opt_serving.parallel.pipeline import STAGE_NAME_PREFIX
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(STAGE_NAME_PREFIX):
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
            out.append(ray.get(actor.reset_stats.remote() if reset else actor.stats.remote()))
    return sorted((s for s in out if s), key=lambda s: s["stage"]) if not reset else []


def planned_175b() -> str:
    from opt_serving.config import get_config
    from opt_serving.parallel.cluster import parse_cluster
    from opt_serving.parallel.planner import search
    cluster = parse_cluster("4x8x16GB")
    lines = []
    for batch in (1, 8):
        best = search(get_config("175b"), cluster, model="opt-175b", batch_size=batch, max_seq_len=2048,
                      dtype="float16").best
        lines.append(f"  batch {batch:>2}: {best.name}, layers {best.layer_split}, {best.micro_batches} micro-batches, "
                     f"{best.step_s * 1e3:.0f} ms a step, {best.throughput:.0f} tokens/s, "
                     f"{best.max_memory_bytes / 1e9:.1f} GB on the fullest device")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    from ray import serve

    from benchmark.served import benchmark_serving
    from opt_serving.parallel.handoff_choice import measure_handoff_latency
    from opt_serving.service.deployment import ServeArgs, build_app
    from opt_serving.service.testserver import free_port
    from opt_serving.testing.ray_cluster import simulated_cluster

    plans = [(int(x), w) for x in args.plans.split(",") for w in args.weights.split(",")]
    clients = [int(x) for x in args.concurrency.split(",")]
    rows = []
    with simulated_cluster(nodes=2, cpus_per_node=args.cpus_per_node):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        import numpy as np
        hidden = args.max_batch_size // 2 * 768 * 4  # one micro-batch's hidden states, OPT-125m's width
        handoff = {n: measure_handoff_latency(nbytes=n) for n in (4096, hidden)}
        for pp, weights in plans:
            t0 = time.perf_counter()
            sargs = ServeArgs(model=args.model, dummy=True, tokenizer=args.tokenizer,
                              max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                              pipeline_parallel=pp, tensor_parallel=1,
                              quantize="int8" if weights == "int8" else None)
            serve.run(build_app(sargs), name="opt", route_prefix="/")
            print(f"pp={pp} {weights}: deployed in {time.perf_counter() - t0:.1f} s", flush=True)
            for c in clients:
                stage_stats(reset=True)
                s = benchmark_serving.main(["--url", url, "--concurrency", str(c), "--num-requests",
                                            str(c * args.requests_per_client), "--prompt-len", args.prompt_len,
                                            "--output-len", args.output_len, "--ignore-eos"])
                rows.append((pp, weights, c, s, stage_stats()))
            serve.delete("opt")
        print(f"\n{args.model} (random weights), prompt {args.prompt_len}, output {args.output_len}, "
              f"{args.max_batch_size} decode slots, 2 simulated nodes x {args.cpus_per_node} CPUs on this machine")
        print(f"{'pp':>3} {'weights':>7} {'clients':>7} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9}  stage busy")
        for pp, weights, c, s, st in rows:
            busy = ", ".join(f"{x['stage']}: {x['busy_fraction']:.0%}" for x in st) or "(one process)"
            fail = f"  ({s['failed']} failed)" if s["failed"] else ""
            print(f"{pp:>3} {weights:>7} {c:>7} {s['output_tokens_per_s']:>9.1f} {s['ttft_s']['median'] * 1e3:>7.0f}ms "
                  f"{s['ttft_s']['p99'] * 1e3:>7.0f}ms {s['tpot_s']['median'] * 1e3:>7.1f}ms  {busy}{fail}")
        print("Ray hand-off between two actors (median, one hop): " + ", ".join(
            f"{n / 1024:.0f} KiB {t * 1e3:.2f} ms" for n, t in handoff.items()))
        del np
    print("planned by the same code for OPT-175B, float16, 4 x 8 x 16 GB (Alpa's cluster):")
    print(planned_175b())


if __name__ == "__main__":
    main()

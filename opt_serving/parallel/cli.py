"""`opt-serving plan`: derive (or dry-run) the parallel plan and explain it.

    opt-serving plan --model opt-175b --cluster 4x8x16GB
    opt-serving plan --model opt-30b --cluster 2x4x16GB --batch-size 16 --json
    opt-serving plan --model /path/to/numpy-folder --cluster local --calibrate
    opt-serving plan --model opt-175b --cluster 2x8x80GB --quantize int8

Exit status 0 with a plan, 1 when nothing fits (the reason in numbers on stderr),
2 for bad arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from opt_serving.config import OPTConfig, SpeculativeConfig, config_for, get_config
from opt_serving.jax_env import DEFAULT_HEADROOM
from opt_serving.parallel import cost, ray_address
from opt_serving.parallel.cluster import GB, Cluster, cluster_from_jax, cluster_from_ray, parse_cluster
from opt_serving.parallel.cluster import calibrate as measure
from opt_serving.parallel.planner import NoFeasiblePlan, SearchResult, search
from opt_serving.parallel.stage_memory import DraftModel


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="opt-175b, alpa/opt-30b, ... or a numpy folder with config.json")
    p.add_argument("--cluster", default="local",
                   help="NODESxDEVICESxMEMORY[:kind][@inter=100Gbps,intra=300GBps,flops=..,membw=..] "
                        "for a dry run (e.g. 4x8x16GB), 'local' for this process's JAX devices, "
                        "'ray' for the running Ray cluster (default: local)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="sequences served at once; 1 optimises latency, more optimises throughput")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="prompt + generated tokens per sequence (default: the model's maximum)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8 weights with a scale per output channel (activations and KV cache stay --dtype)")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                   help="fraction of device memory kept free (default 0.1)")
    p.add_argument("--tensor-parallel", type=int, default=None, help="fix the tp degree")
    p.add_argument("--pipeline-parallel", type=int, default=None, help="fix the pp degree")
    p.add_argument("--data-parallel", type=int, default=None, help="fix the number of replicas")
    p.add_argument("--objective", choices=["latency", "throughput"], default=None,
                   help="default: latency at batch 1, throughput above")
    p.add_argument("--calibrate", action="store_true",
                   help="measure FLOP/s, memory bandwidth and all-reduce cost on the local devices, "
                        "and (local, batch 1, small models) time the model's decode stages at "
                        "each tp degree")
    p.add_argument("--speculative-config", default=None,
                   help="as `opt-serving serve` takes it: a draft model's memory (its weights, and a cache for each "
                        "of --batch-size rows) is held beside the first stage, e.g. '{\"model\": \"jax/opt-125m\", "
                        "\"num_speculative_tokens\": 4}' (\"path\": its folder's config.json, else the name's)")
    p.add_argument("--runners-up", type=int, default=5, help="how many runner-up plans to show")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")


def load_model_config(model: str) -> tuple[str, OPTConfig]:
    path = Path(model)
    if path.is_dir():
        return path.name, OPTConfig.from_hf_json(path)
    cfg = get_config(model)   # raises with the known sizes listed
    return model.rsplit("/", 1)[-1], cfg


def _draft(args: argparse.Namespace) -> DraftModel | None:
    """The draft model a --speculative-config names, as the serving process holds it (runner/draft.py's caches)."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None or spec.model is None:
        return None
    return DraftModel.of(config_for(spec.model.rsplit("/", 1)[-1], spec.path), spec, args.quantize or "float32")


def load_cluster(text: str, calibrate: bool = False, profile: dict | None = None) -> Cluster:
    """`profile`: calibrate(...) keywords (model, batch, context, dtype) to also measure that
    model's decode stages on the local devices; see profile.py."""
    if text == "local":
        cluster = cluster_from_jax()
    elif text == "ray":
        if not ray_address.init(start=False, logging_level="ERROR")[0]:
            raise ValueError("--cluster ray: no Ray cluster is running on this machine (or at RAY_ADDRESS); "
                             "start one with `ray start --head`, or give the cluster as text (e.g. 2x8x80GB)")
        cluster = cluster_from_ray()
    else:
        cluster = parse_cluster(text)
        if calibrate:
            raise ValueError("--calibrate measures the local devices; it cannot apply to a "
                             "dry-run cluster given as text")
    if calibrate:
        cluster = dataclasses.replace(cluster, spec=measure(base=cluster.spec, **(profile or {})))
    return cluster


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def _devices(ids: tuple[int, ...]) -> str:
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def format_plan(result: SearchResult, cluster: Cluster, runners_up: int = 5) -> str:
    best = result.best
    lines = [
        f"{best.model} on {cluster.describe()}, {best.dtype}"
        + (", int8 weights" if best.weights == "int8" else "") + f", batch {best.batch_size}, "
        f"max_seq_len {best.max_seq_len}, objective: {best.objective}",
        f"chosen: {best.name}  ({best.dp * best.pp * best.tp} of {cluster.num_devices} devices"
        + (f", {best.idle_devices} idle" if best.idle_devices else "") + ")"
        + (f", {best.micro_batches} micro-batches of {best.micro_batch_size} in flight"
           if best.micro_batches > 1 else ""),
        "",
        f"{'stage':>5}  {'layers':>12}  {'devices':>7}  {'node':>4}  {'weights':>8}  {'runtime':>7}  {'KV':>6}  "
        f"{'activ.':>6}  {'loading':>7}  {'memory':>7}  {'headroom':>8}  {'ms/step':>7}",
    ]
    for s in best.stages:
        extra = "+embed" if s.has_embed else ""
        extra += "+head" if s.has_head else ""
        lines.append(
            f"{s.index:>5}  {f'{s.layers[0]}-{s.layers[1] - 1} ({s.num_layers})':>12}  "
            f"{_devices(s.devices):>7}  {s.node:>4}  {_gb(s.param_bytes):>8}  {_gb(s.runtime_bytes):>7}  "
            f"{_gb(s.kv_bytes):>6}  {_gb(s.act_bytes):>6}  {_gb(s.load_bytes):>7}  {_gb(s.memory_bytes):>7}  "
            f"{_gb(best.device_memory - s.memory_bytes):>8}  {s.busy_s * 1e3:>7.2f}  {extra}")
    draft = best.stages[0].draft_bytes
    lines += [
        "(memory: weights + runtime layout + the larger of KV + activations and the loading overhead"
        + (f"; stage 0's with the draft model's {_gb(draft)} GB beside it)" if draft else ")"),
        f"(GB per device of {_gb(best.device_memory)} GB; usable {_gb(best.memory_limit)} GB "
        f"after headroom; replicas 1..{best.dp - 1} repeat this layout on the next devices)"
        if best.dp > 1 else
        f"(GB per device of {_gb(best.device_memory)} GB; usable {_gb(best.memory_limit)} GB "
        f"after headroom)",
        f"estimated: {best.step_s * 1e3:.2f} ms per token, {best.throughput:.1f} tokens/s, "
        f"first token of a {best.max_seq_len // 2}-token prompt in {best.prefill_s * 1e3:.1f} ms",
    ]
    if len(result.plans) > 1:
        lines += ["", "runners-up:"]
        for p in result.plans[1:1 + runners_up]:
            lines.append(f"  {p.name:<20} {p.step_s * 1e3:>9.2f} ms/token {p.throughput:>9.1f} tok/s  "
                         f"{result.why_lost(p)}")
    if result.rejected:
        lines += ["", f"not feasible ({len(result.rejected)}), closest:"]
        closest = sorted(result.rejected, key=lambda r: (r.need_bytes == 0, r.need_bytes))
        for r in closest[:runners_up]:
            lines.append(f"  {r.name:<20} {r.reason}")
    return "\n".join(lines)


def plan_json(result: SearchResult, cluster: Cluster, runners_up: int) -> dict:
    return {"cluster": cluster.to_dict(),
            "chosen": result.best.to_dict(),
            "runners_up": [dict(p.to_dict(), why_lost=result.why_lost(p))
                           for p in result.plans[1:1 + runners_up]],
            "rejected": [dict(name=r.name, dp=r.dp, pp=r.pp, tp=r.tp, reason=r.reason)
                         for r in result.rejected]}


def run(args: argparse.Namespace) -> int:
    try:
        name, cfg = load_model_config(args.model)
        profile = None
        if args.calibrate and args.cluster == "local" and args.batch_size == 1:
            # profiling builds the whole model's stages for real: only where that is small
            need = cost.weight_bytes(cfg, args.dtype)
            if need < 2 * GB:
                profile = dict(model=cfg, batch=1, dtype=args.dtype,
                               context=args.max_seq_len or cfg.max_position_embeddings)
        cluster = load_cluster(args.cluster, args.calibrate, profile)
        result = search(cfg, cluster, model=name, batch_size=args.batch_size,
                        max_seq_len=args.max_seq_len, dtype=args.dtype, headroom=args.headroom,
                        tensor_parallel=args.tensor_parallel,
                        pipeline_parallel=args.pipeline_parallel,
                        data_parallel=args.data_parallel, objective=args.objective,
                        weights=args.quantize or "float32", draft=_draft(args))
    except NoFeasiblePlan as e:
        if args.json:
            print(json.dumps({"error": str(e)}))
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(result, cluster, args.runners_up), indent=2))
    else:
        print(format_plan(result, cluster, args.runners_up))
    return 0

"""A model too big for one node's device memory, served over two nodes: each process's peak memory against
its share and against the planner's estimate.

    python benchmark/scale/benchmark_pipeline_memory.py --model alpa/opt-1.3b --folder /tmp/opt-1.3b-np --write \
        --device-memory 4GB
    python benchmark/scale/benchmark_pipeline_memory.py --model alpa/opt-1.3b --dummy --device-memory 4GB
    python benchmark/scale/benchmark_pipeline_memory.py --model alpa/opt-6.7b --dummy --quantize int8 --device-memory 5GB

It starts a two-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`, stopped at the
end), starts Serve on a free port, and deploys the app with Ray Serve's own CLI into that cluster
(`serve run --non-blocking --address ... opt_serving.service:app model=... path=... device_memory=...`): the
planner splits the model by itself because one node's `device_memory` cannot hold it. It sends greedy
requests (their text is printed; with --folder written by --write from the same seed as --dummy the two
runs answer alike), then reads each stage actor's peak resident memory (the kernel's high-water mark, in the
actor) and the replica's (from /proc), and prints them beside the planner's per-stage estimate (weights, KV
cache, activations, runtime layout, loading overhead and the process's own base) and the issue's targets:
each stage under 0.75x the whole model's weights at pp = 2, the replica under 0.35x, the estimate within
20% of the measured peak. Then it deletes the app and loads the same model with `get_model("alpa/...")` in
this process (the driver), planned for generate() calls of --max-batch-size rows of --max-seq-len tokens; it
generates from one prompt (the text to compare with the served one), then once at the planned size (that many
rows, prompt and new tokens half of --max-seq-len each), and prints the same figures for its stages and this
process.

`--write` writes a random numpy folder with the project's writer (model/sources.py: save_random_folder),
one tensor at a time, from --seed: the model --dummy draws from the same seed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving

ASSETS = Path(__file__).resolve().parents[3] / "shared" / "opt-assets"
PROMPTS = ["Paris is the capital city of", "The quick brown fox", "Once upon a time", "def fibonacci(n):"]
GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="alpa/opt-1.3b")
    p.add_argument("--folder", default=None, help="numpy weights folder (else --dummy)")
    p.add_argument("--write", action="store_true", help="write a random folder at --folder first if it has none")
    p.add_argument("--dummy", action="store_true", help="random weights drawn by each stage from --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", choices=["int8"], default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device-memory", default="4GB", help="what each simulated node may hold")
    p.add_argument("--tokenizer", default=str(ASSETS))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--deploy-timeout", type=float, default=1800)
    p.add_argument("--skip-get-model", action="store_true", help="only the served deployment")
    p.add_argument("--json", default=None, help="write the figures here too")
    return p.parse_args(argv)


def write_folder(args, cfg) -> None:
    from opt_serving.model.sources import save_random_folder
    folder = Path(args.folder)
    if (folder / "config.json").exists():
        return
    t0 = time.perf_counter()
    save_random_folder(folder, cfg, args.seed)
    print(f"wrote {folder} (random, seed {args.seed}) in {time.perf_counter() - t0:.0f} s", flush=True)


def stage_memory() -> list[dict]:
    import ray
    from opt_serving.parallel.pipeline import STAGE_NAME_PREFIX
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(STAGE_NAME_PREFIX):
            try:
                actor = ray.get_actor(a["name"], namespace=a["namespace"])
                out.append(ray.get(actor.memory.remote(), timeout=60))
            except Exception:  # a pipeline being torn down
                pass
    return sorted(out, key=lambda m: m["stage"])


def proc_memory(pid: int) -> dict:
    fields = {"VmHWM": "peak_rss", "VmRSS": "rss"}
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) * 1024
    return out


def replica_pids() -> list[int]:
    """The Serve replica processes under this process (the simulated nodes are its children)."""
    import psutil
    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith("ray::ServeReplica"):
                pids.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def plan_for(args, cluster_plan=True):
    from opt_serving.parallel import backend
    from opt_serving.runner.load import resolve_dtype
    from opt_serving.spec import ModelSpec
    dtype = resolve_dtype(args.dtype, cluster=True)
    spec = ModelSpec.parse(args.model, args.folder, dummy=args.dummy, quantize=args.quantize)
    plan, cfg, _ = backend.plan_model(spec, dtype, device_memory=args.device_memory, batch_size=args.max_batch_size,
                                      max_seq_len=args.max_seq_len)
    return plan, cfg


def whole_weights(cfg, args) -> int:
    from opt_serving.parallel import cost
    return cost.weight_bytes(cfg, args.dtype, args.quantize or "float32")


def print_memory(title: str, plan, cfg, args, stages: list[dict], others: dict[str, dict]) -> list[dict]:
    """The table: planner estimate beside the measured peaks; returns its rows."""
    from opt_serving.parallel.cluster import default_process_bytes
    whole = whole_weights(cfg, args)
    base = default_process_bytes(plan.use)
    rows = []
    print(f"\n{title}: {plan.name}, layers {plan.layer_split}, whole model's weights {whole / GB:.2f} GB "
          f"({args.dtype}{', int8' if args.quantize else ''})")
    print(f"{'process':>26} {'weights':>8} {'runtime':>8} {'KV':>6} {'act':>6} {'load':>6} {'base':>6} "
          f"{'estimate':>9} {'measured':>9} {'est/meas':>8} {'x whole':>8}  (GB; peak resident memory)")
    by_name = {m["stage"]: m for m in stages}
    for i, st in enumerate(plan.stages):
        name = f"stage {i} (layers {st.layers[0]}-{st.layers[1] - 1})"
        m = by_name.get(name)
        est = st.memory_bytes + base
        peak = m["peak_rss"] if m else float("nan")
        rows.append({"process": name, "estimate": est, "peak_rss": peak, "whole": whole,
                     "params": st.param_bytes, "runtime": st.runtime_bytes, "kv": st.kv_bytes,
                     "act": st.act_bytes, "load": st.load_bytes, "base": base,
                     "loaded": m["loaded"] if m else None})
        print(f"{name:>26} {st.param_bytes / GB:>8.2f} {st.runtime_bytes / GB:>8.2f} {st.kv_bytes / GB:>6.2f} "
              f"{st.act_bytes / GB:>6.2f} {st.load_bytes / GB:>6.2f} {base / GB:>6.2f} {est / GB:>9.2f} "
              f"{peak / GB:>9.2f} {est / peak:>8.2f} {peak / whole:>8.2f}")
    for name, m in others.items():
        rows.append({"process": name, "peak_rss": m["peak_rss"], "whole": whole})
        print(f"{name:>26} {'':>8} {'':>8} {'':>6} {'':>6} {'':>6} {'':>6} {'':>9} {m['peak_rss'] / GB:>9.2f} "
              f"{'':>8} {m['peak_rss'] / whole:>8.2f}")
    for m in stages:
        ld = m["loaded"]
        print(f"  {m['stage']}: loaded in {ld['load_s']:.0f} s; resident before the load "
              f"{ld['before']['rss'] / GB:.2f} GB, after it {ld['rss'] / GB:.2f} GB (peak so far "
              f"{ld['peak_rss'] / GB:.2f}); now {m['rss'] / GB:.2f} GB")
    print("targets (issue 34): each stage < 0.75x the whole weights at pp = 2, the replica < 0.35x, "
          "the estimate within 20% of the measured peak")
    return rows


def serve_run(args, address: str) -> None:
    """`serve run --non-blocking` into the simulated cluster (the real CLI, as a user runs it)."""
    env = {**os.environ, "RAY_ADDRESS": address}
    cmd = [str(Path(sys.executable).parent / "serve"), "run", "--non-blocking", "--address", address,
           "--name", "opt", "--route-prefix", "/", "opt_serving.service:app", f"model={args.model}",
           f"device_memory={args.device_memory}", f"max_batch_size={args.max_batch_size}",
           f"max_seq_len={args.max_seq_len}", f"tokenizer={args.tokenizer}", f"dtype={args.dtype}",
           f"seed={args.seed}"]
    cmd += [f"path={args.folder}"] if args.folder else ["dummy=true"]
    cmd += [f"quantize={args.quantize}"] if args.quantize else []
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, env=env, check=True, timeout=args.deploy_timeout)


def wait_ready(url: str, timeout_s: float) -> float:
    import requests
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f} s")


def ask(url: str, args) -> list[str]:
    import concurrent.futures

    import requests

    def one(prompt):
        r = requests.post(url + "/v1/completions", timeout=600, json={
            "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(one, PROMPTS))
    wall = time.perf_counter() - t0
    print(f"{len(PROMPTS)} concurrent greedy requests of {args.max_tokens} tokens in {wall:.1f} s "
          f"({len(PROMPTS) * args.max_tokens / wall:.1f} tokens/s)")
    for p, t in zip(PROMPTS, texts):
        print(f"  {p!r} -> {t!r}")
    return texts


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.folder and not args.dummy:
        raise SystemExit("give --folder (with --write to create it) or --dummy")
    from opt_serving.config import get_config
    from opt_serving.service.ports import free_port
    from opt_serving.testing.ray_cluster import simulated_cluster
    cfg = get_config(args.model)
    if args.folder and args.write:
        write_folder(args, cfg)
    os.environ.setdefault("RAY_worker_niceness", "0")
    result = {"args": vars(args)}
    with simulated_cluster(nodes=args.nodes, cpus_per_node=args.cpus_per_node) as cluster:
        import ray
        from ray import serve
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        plan, cfg = plan_for(args)
        t0 = time.perf_counter()
        serve_run(args, cluster.address)
        ready = wait_ready(url, args.deploy_timeout)
        print(f"deployed and healthy {time.perf_counter() - t0:.0f} s after `serve run`", flush=True)
        warm = stage_memory()
        for m in warm:
            print(f"  {m['stage']} warmed up, before any request: resident {m['rss'] / GB:.2f} GB, peak so far "
                  f"{m['peak_rss'] / GB:.2f} GB")
        result["warm"] = warm
        result["served_texts"] = ask(url, args)
        replicas = {f"replica (pid {pid})": proc_memory(pid) for pid in replica_pids()}
        result["served"] = print_memory("served by `serve run`", plan, cfg, args, stage_memory(), replicas)
        serve.delete("opt")
        del ready
        if not args.skip_get_model:
            from opt_serving.model.wrapper import get_model
            from opt_serving.parallel.stage_actor import process_memory
            from opt_serving.text.tokenizer import load_tokenizer
            tok = load_tokenizer(args.tokenizer)
            t0 = time.perf_counter()
            model = get_model(args.model, args.folder, dtype=args.dtype, dummy=args.dummy, seed=args.seed,
                              device_memory=args.device_memory, quantize=args.quantize,
                              batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
            print(f"\nget_model({args.model!r}, ...) in {time.perf_counter() - t0:.0f} s: {model.plan.name}",
                  flush=True)
            ids = tok(PROMPTS[0], return_tensors="np").input_ids
            out = model.generate(ids, max_new_tokens=args.max_tokens)
            text = tok.decode(out[0, ids.shape[1]:])
            print(f"  generate: {PROMPTS[0]!r} -> {text!r}")
            # the size planned for, so the stages hold the caches and prefill the activations the plan counts: the
            # prompt's width and the new tokens are each rounded up to a power of two (runner.generate.Generation)
            half = 1 << (args.max_seq_len.bit_length() - 2)
            full = np.tile(np.resize(ids[0], half), (args.max_batch_size, 1))
            t0 = time.perf_counter()
            model.generate(full, max_new_tokens=half)
            print(f"  generate at the planned size: {args.max_batch_size} rows x {half} prompt + {half} new tokens "
                  f"in {time.perf_counter() - t0:.0f} s", flush=True)
            result["get_model_text"] = text
            result["get_model"] = print_memory("get_model in this process", model.plan, cfg, args, stage_memory(),
                                               {"this process (driver)": process_memory()})
            model.close()
        del ray
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()

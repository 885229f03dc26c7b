"""How long a server takes from launch to its first completion answered: `opt-serving serve` with an empty XLA
compile cache (cold: OPT_SERVING_COMPILE_CACHE a fresh folder) and again with the cache the cold start filled
(warm), each start's phases as it printed them (startlog.py); vLLM's CPU server beside it with --servers ours,vllm
(its torch.compile cache likewise: VLLM_CACHE_ROOT a fresh folder, then the same again).

Usage (the weights: serve_vs_vllm.py's random OPT-125m, a numpy folder for ours and the Hugging Face folder of the
same weights for vLLM, made when missing):
  python benchmark/bench_start.py                       # ours, cold then warm, our defaults
  python benchmark/bench_start.py --servers ours,vllm --rounds 2 --json start.json
Each server runs on a Ray of its own (harness.serve: --ray-address local) and is stopped before the next starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root, when run by path

from benchmark import harness  # noqa: E402
from benchmark.common import machine_description, now, write_json  # noqa: E402
from benchmark.peers import serve_vs_vllm  # noqa: E402

PHASE = "opt-serving start:"  # our start log's lines (opt_serving/startlog.py)


def first_completion(url: str, model: str, timeout: float = 300.0) -> float:
    """POST one short completion -> when it was answered (time.monotonic())."""
    body = json.dumps({"model": model, "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        json.loads(r.read())
    return time.monotonic()


def ours(args, cache: Path, log: Path) -> dict:
    """One start of ours on compile cache `cache` -> its times and phases."""
    env = {**os.environ, "OPT_SERVING_COMPILE_CACHE": str(cache)}  # (a folder of this run's own)
    argv = ["--model", "jax/opt-125m", "--path", args.numpy, "--tokenizer", args.tokenizer, *args.ours_flags]
    server = harness.serve(argv, env=env, log=log, timeout=args.start_timeout)
    try:
        answered = first_completion(server.url, "jax/opt-125m")
    finally:
        server.stop()
    phases = [line.strip()[len(PHASE):].strip() for line in server.lines if line.strip().startswith(PHASE)]
    return {"ready_s": server.start_s, "first_completion_s": answered - server._t0, "phases": phases}


def vllm(args, cache: Path, log: Path) -> dict:
    """One start of vLLM at full strength (serve_vs_vllm.py's configuration) on torch.compile cache `cache`."""
    cmd, env, ready = serve_vs_vllm.server_command("vllm", args)
    server = harness.start(cmd, ready, name="vllm", env={**env, "VLLM_CACHE_ROOT": str(cache)}, log=log,
                           timeout=args.start_timeout, url=f"http://127.0.0.1:{args.port}")
    try:
        answered = first_completion(server.url, args.hf)
    finally:
        server.stop()
    return {"ready_s": server.start_s, "first_completion_s": answered - server._t0, "phases": []}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "opt-serving-vs-vllm"
    p.add_argument("--servers", default="ours", help="comma separated: ours, vllm (default: ours)")
    p.add_argument("--rounds", type=int, default=1, help="cold then warm starts of each server, this many times")
    p.add_argument("--hf", default=str(work / "hf"), help="Hugging Face OPT folder (vLLM's)")
    p.add_argument("--numpy", default=str(work / "np"), help="our numpy folder of the same weights")
    p.add_argument("--tokenizer", default=str(harness.ROOT / ".." / "shared" / "opt-assets"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="vLLM's weights")
    p.add_argument("--port", type=int, default=18650, help="vLLM's port (ours takes a free one)")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--ours-flags", default="", help="more `opt-serving serve` flags, one string")
    p.add_argument("--cache", metavar="DIR", help="warm starts only, on this compile cache folder (filled before)")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    args.servers = args.servers.split(",")
    args.ours_flags = args.ours_flags.split()
    unknown = [s for s in args.servers if s not in ("ours", "vllm")]
    if unknown:
        p.error(f"unknown servers {unknown}: ours, vllm")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    serve_vs_vllm.make_weights(Path(args.hf), Path(args.numpy), args.tokenizer)
    runs = []
    with tempfile.TemporaryDirectory(prefix="opt-serving-start-") as tmp:
        for rnd, name in harness.in_turn(args.servers, args.rounds):
            cache = Path(tmp) / f"{name}-cache-{rnd}"  # fresh: the cold start fills it, the warm one reads it
            if args.cache:
                cache = Path(args.cache)
            for kind in ("warm",) if args.cache else ("cold", "warm"):
                run = (ours if name == "ours" else vllm)(args, cache, Path(tmp) / f"{name}-{rnd}-{kind}.log")
                runs.append({"round": rnd, "server": name, "start": kind, "time": now(), **run})
                print(f"round {rnd} {name} {kind}: first completion {run['first_completion_s']:.1f} s after launch "
                      f"(ready line at {run['ready_s']:.1f} s)", flush=True)
                for line in run["phases"]:
                    print(f"    {line}", flush=True)
    med = harness.medians([{**r, "side": f"{r['server']} {r['start']}"} for r in runs], "side",
                          ("first_completion_s", "ready_s"))
    print(f"{machine_description()}; medians over {args.rounds} rounds:")
    for side, m in med.items():
        print(f"  {side:>10}: first completion {m['first_completion_s']:.1f} s, ready {m['ready_s']:.1f} s")
    if args.json:
        write_json(args.json, {"time": now(), "machine": machine_description(), "runs": runs, "medians": med})
    return med


if __name__ == "__main__":
    harness.script(main)

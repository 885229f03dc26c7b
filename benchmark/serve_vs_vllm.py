"""`opt-serving serve` against vLLM's CPU backend (`vllm serve`), each started in turn on this machine, driven by
benchmark_serving.py with the same load, alternating, so both see the same machine.

Usage (vLLM: `bash benchmark/setup_vllm.sh`; the same weights on both sides: a Hugging Face folder of an OPT,
its tokenizer saved in it, and our numpy folder converted from it with `opt-serving convert --dtype float32`):
  python benchmark/serve_vs_vllm.py --hf /tmp/opt-125m/hf --numpy /tmp/opt-125m/np --scenario shared-prefix \\
      --rounds 2 --json shared.json
  python benchmark/serve_vs_vllm.py --hf ... --numpy ... --scenario mixed-long --servers ours,vllm

Scenarios (the issue's loads; every request greedy with exactly max_tokens new tokens):
  shared-prefix  64 requests, one 448-token prefix and a 16-token tail each, 32 new tokens, 16 streams
  mixed-long     96 requests of 64-512 prompt tokens and 32-128 new, 32 streams
Servers: `ours` (`opt-serving serve` with its default scheduling; 32 decode slots, 1024 positions), `ours-no-prefix`
(the same with --no-prefix-caching), `ours-whole` (--prefill-chunk 0), `vllm` (`vllm serve` with its defaults:
prefix caching and chunked prefill on; --enforce-eager, 32 sequences, 1024 positions, as in benchmark/README.md).
Each round starts each server, runs the load once after a short warm-up load, stops it; the next round goes in
the reverse order. Prints one line a run and each server's median output tokens/s and TTFT against vLLM's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `common` when run from anywhere
import harness  # noqa: E402
from common import machine_description, now, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {
    "shared-prefix": ["--concurrency", "16", "--num-requests", "64", "--shared-prefix", "448", "--prompt-len", "16",
                      "--output-len", "32", "--ignore-eos"],
    "mixed-long": ["--concurrency", "32", "--num-requests", "96", "--prompt-len", "64:512", "--output-len", "32:128",
                   "--ignore-eos"],
}
OURS_FLAGS = {"ours": [], "ours-no-prefix": ["--no-prefix-caching"], "ours-whole": ["--prefill-chunk", "0"]}


def server_command(name: str, args) -> tuple[list[str], dict, str]:
    """(command, environment, the log line that says it is ready)."""
    if name == "vllm":
        cmd = [str(ROOT / ".venv-vllm" / "bin" / "vllm"), "serve", args.hf, "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--max-num-seqs", "32", "--port", str(args.port)]
        return cmd, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}, "Application startup complete"
    cmd = [str(ROOT / ".venv" / "bin" / "opt-serving"), "serve", "--model", "jax/opt-125m", "--path", args.numpy,
           "--tokenizer", args.tokenizer, "--dtype", "float32", "--max-batch-size", "32", "--max-seq-len", "1024",
           "--port", str(args.port), "--ray-address", "local", *OURS_FLAGS[name]]
    return cmd, {**os.environ, "PYTHONPATH": str(ROOT)}, "opt-serving: serving"


def start(name: str, args, log: Path) -> harness.Server:
    cmd, env, ready = server_command(name, args)
    return harness.start(cmd, ready, name=name, env=env, log=log, timeout=args.start_timeout)


def load(args, scenario: list[str], out: Path, warm: bool = False) -> dict:
    extra = ["--num-requests", "16"] if warm else []
    cmd = [sys.executable, str(ROOT / "benchmark" / "benchmark_serving.py"), "--url",
           f"http://127.0.0.1:{args.port}", "--seed", str(1 if warm else 0), *scenario, *extra, "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"benchmark_serving failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="Hugging Face OPT folder (weights and tokenizer), vLLM's")
    p.add_argument("--numpy", required=True, help="our numpy folder of the same weights (opt-serving convert)")
    p.add_argument("--tokenizer", default=str(ROOT / ".." / "shared" / "opt-assets"))
    p.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    p.add_argument("--servers", default=None, help="comma separated (default: ours,ours-no-prefix,vllm for "
                                                  "shared-prefix, ours,vllm for mixed-long)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=18600)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    servers = (args.servers or ("ours,ours-no-prefix,vllm" if args.scenario == "shared-prefix" else "ours,vllm")
               ).split(",")
    scenario, runs = SCENARIOS[args.scenario], []
    with tempfile.TemporaryDirectory(prefix="opt-serving-vs-vllm-") as tmp:
        work = Path(tmp)
        for rnd, name in harness.in_turn(servers, args.rounds):
            server = start(name, args, work / f"{name}-{rnd}.log")
            try:
                load(args, scenario, work / "warm.json", warm=True)
                s = load(args, scenario, work / f"{name}-{rnd}.json")
            finally:
                server.stop()
            row = {"round": rnd, "server": name, "time": now(), "tokens_per_s": s["output_tokens_per_s"],
                   "ttft_p50_s": s["ttft_s"]["median"], "ttft_p99_s": s["ttft_s"]["p99"],
                   "itl_p99_s": s["itl_s"]["p99"], "cached_input_tokens": s["cached_input_tokens"],
                   "input_tokens": s["total_input_tokens"], "failed": s["failed"]}
            runs.append(row)
            print(f"round {rnd} {name:>15}: {row['tokens_per_s']:7.1f} tokens/s, TTFT p50 "
                  f"{1e3 * row['ttft_p50_s']:7.0f} ms, p99 {1e3 * row['ttft_p99_s']:7.0f} ms, ITL p99 "
                  f"{1e3 * row['itl_p99_s']:6.0f} ms, cached {row['cached_input_tokens']}/{row['input_tokens']}"
                  f"{', FAILED ' + str(row['failed']) if row['failed'] else ''}", flush=True)
    med = harness.medians(runs, "server", ("tokens_per_s", "ttft_p50_s", "ttft_p99_s"))
    print(f"{machine_description()}; scenario {args.scenario}; medians over {args.rounds} rounds:")
    for n in servers:
        vs = "" if "vllm" not in med or n == "vllm" else (
            f"  = {med[n]['tokens_per_s'] / med['vllm']['tokens_per_s']:.2f}x vLLM's tokens/s, TTFT p50 "
            f"{med[n]['ttft_p50_s'] / med['vllm']['ttft_p50_s']:.2f}x, p99 {med[n]['ttft_p99_s'] / med['vllm']['ttft_p99_s']:.2f}x")
        print(f"  {n:>15}: {med[n]['tokens_per_s']:7.1f} tokens/s, TTFT p50 {1e3 * med[n]['ttft_p50_s']:.0f} ms, "
              f"p99 {1e3 * med[n]['ttft_p99_s']:.0f} ms{vs}")
    for n in [n for n in servers if n != "vllm" and "vllm" in med]:
        harness.print_comparison([(what, scale * med[n][k], scale * med["vllm"][k]) for what, k, scale in
                                  (("output tokens/s", "tokens_per_s", 1), ("TTFT p50 ms", "ttft_p50_s", 1e3),
                                   ("TTFT p99 ms", "ttft_p99_s", 1e3))],
                                 ours=n, peer="vllm", title=f"{args.scenario}: {n} against vllm, medians")
    if args.json:
        write_json(args.json, {"time": now(), "machine": machine_description(), "scenario": args.scenario,
                               "load": scenario, "runs": runs, "medians": med})


if __name__ == "__main__":
    harness.script(main)

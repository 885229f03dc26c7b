"""`opt-serving serve` against vLLM's CPU backend (`vllm serve`), each started in turn on this machine, driven by
benchmark_serving.py with the same load, alternating, so both see the same machine.

Usage (vLLM: `bash benchmark/peers/setup_vllm.sh`): the same random weights on both sides, a Hugging Face folder of an
OPT with the real OPT tokenizer saved in it (`--hf`) and our numpy folder converted from it (`--numpy`); both are
made when missing (a random OPT-125m, seed 0, every 2-D weight x3 as benchmark_peers.py draws them):
  python benchmark/peers/serve_vs_vllm.py --scenario short --dtype float32 --rounds 2
  python benchmark/peers/serve_vs_vllm.py --scenario mixed-long --dtype bfloat16 --rounds 2 --json long.json
  python benchmark/peers/serve_vs_vllm.py --scenario shared-prefix --servers ours,ours-no-prefix,vllm

Scenarios (the issue's loads; every request greedy with exactly max_tokens new tokens):
  short          128 requests of 8 prompt tokens and 64 new, 32 streams
  mixed-long     128 requests of 64-512 prompt tokens and 32-128 new, 32 streams
  shared-prefix  64 requests, one 448-token prefix and a 16-token tail each, 32 new tokens, 16 streams

Servers, each with 32 sequences and 1024 positions, in --dtype:
  ours            `opt-serving serve` with its defaults (prefix caching, chunked prefill)
  ours-no-prefix  the same with --no-prefix-caching;  ours-whole: --prefill-chunk 0
  vllm            vLLM at full strength, configured as its CPU documentation advises for this machine: its OpenMP
                  threads bound to every core (VLLM_CPU_OMP_THREADS_BIND=0-N, VLLM_CPU_NUM_OF_RESERVED_CPU=0),
                  TCMalloc and Intel's OpenMP preloaded where found, the KV cache space sized to the run
                  (VLLM_CPU_KVCACHE_SPACE), its default compiled mode; prefix caching and chunked prefill on (its
                  defaults). The configuration is printed.
  vllm-defaults   vLLM's bare defaults on this machine (it then reserves one core for its scheduler and binds its
                  model's threads to the others: on 2 cores, one), labelled so; for the record, not the comparison
Each round starts each server, runs a short warm-up load then the load, and stops it; the next round goes in the
reverse order. Prints one line a run, this machine's measured bounds (machine_bounds.py) before and after, and each
server's medians against vLLM's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark import harness  # noqa: E402
from benchmark import machine_bounds  # noqa: E402
from benchmark.common import machine_description, now, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = {
    "short": ["--concurrency", "32", "--num-requests", "128", "--prompt-len", "8", "--output-len", "64",
              "--ignore-eos"],
    "mixed-long": ["--concurrency", "32", "--num-requests", "128", "--prompt-len", "64:512", "--output-len", "32:128",
                   "--ignore-eos"],
    "shared-prefix": ["--concurrency", "16", "--num-requests", "64", "--shared-prefix", "448", "--prompt-len", "16",
                      "--output-len", "32", "--ignore-eos"],
}
SEQS, POSITIONS = 32, 1024
OURS_FLAGS = {"ours": [], "ours-no-prefix": ["--no-prefix-caching"], "ours-whole": ["--prefill-chunk", "0"]}
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
            "/usr/lib64/libtcmalloc_minimal.so.4")


def kv_space_gib(hf: str, dtype: str) -> int:
    """GiB of KV cache for SEQS sequences of POSITIONS tokens of the model at `hf` (rounded up, one more)."""
    cfg = json.loads((Path(hf) / "config.json").read_text())
    width = 4 if dtype == "float32" else 2
    per_token = 2 * cfg["num_hidden_layers"] * cfg["hidden_size"] * width
    return math.ceil(SEQS * POSITIONS * per_token / 2 ** 30) + 1


def vllm_config(full: bool, hf: str, dtype: str) -> tuple[dict, list[str], str]:
    """(environment additions, extra flags, a description) of vLLM at full strength or with its bare defaults."""
    if not full:
        return {}, [], "vLLM's bare defaults (one core reserved for its scheduler, its model on the rest)"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(hf, dtype))}
    preload = [p for p in TCMALLOC if Path(p).exists()][:1]
    iomp = ROOT / ".venv-vllm" / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [os.environ.get("LD_PRELOAD", "")]).rstrip(":")
    desc = ", ".join(f"{k}={v}" for k, v in env.items()) + " (its docs' CPU settings), compiled mode (its default)"
    return env, [], desc


def server_command(name: str, args) -> tuple[list[str], dict, str]:
    """(command, environment, the log line that says it is ready)."""
    if name.startswith("vllm"):
        extra_env, flags, _ = vllm_config(name == "vllm", args.hf, args.dtype)
        cmd = [str(ROOT / ".venv-vllm" / "bin" / "vllm"), "serve", args.hf, "--dtype", args.dtype,
               "--max-model-len", str(POSITIONS), "--max-num-seqs", str(SEQS), "--port", str(args.port), *flags]
        return cmd, {**os.environ, **extra_env}, "Application startup complete"
    cmd = [str(ROOT / ".venv" / "bin" / "opt-serving"), "serve", "--model", "jax/opt-125m", "--path", args.numpy,
           "--tokenizer", args.tokenizer, "--dtype", args.dtype, "--max-batch-size", str(SEQS), "--max-seq-len",
           str(POSITIONS), "--port", str(args.port), "--ray-address", "local", *OURS_FLAGS[name]]
    return cmd, {**os.environ, "PYTHONPATH": str(ROOT)}, "opt-serving: serving"


def make_weights(hf: Path, numpy_dir: Path, tokenizer: str) -> None:
    """A random OPT-125m as a Hugging Face folder with the real tokenizer, and our numpy folder of it."""
    if not (hf / "config.json").exists():
        print(f"building random OPT-125m weights in {hf}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "benchmark" / "peers" / "peers_worker.py"), "build",
                        "--model-dir", str(hf), "--size", "opt-125m", "--seed", "0", "--weight-scale", "3"],
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        subprocess.run([sys.executable, "-c", "import sys; from opt_serving.text.tokenizer import load_tokenizer; "
                        "load_tokenizer(sys.argv[1]).save_pretrained(sys.argv[2])", tokenizer, str(hf)],
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if not (numpy_dir / "config.json").exists() and not any(numpy_dir.glob("*")):
        subprocess.run([sys.executable, "-m", "opt_serving", "convert", "--input", str(hf), "--output", str(numpy_dir),
                        "--dtype", "float32", "--no-progress"], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def scrape(url: str) -> dict:
    """Our server's engine figures from /metrics: {name: value}, histograms as {name: [(bound, cumulative)],
    name_sum, name_count}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.endswith("_bucket"):
                out.setdefault(smp.name[:-len("_bucket")], []).append((float(smp.labels["le"]), smp.value))
            elif not smp.labels:
                out[smp.name] = smp.value
    return out


def _quantile(buckets: list, q: float) -> float:
    """The bucket bound at or below which a fraction q of the observations fall (cumulative buckets)."""
    total = buckets[-1][1] if buckets else 0
    return next((b for b, c in buckets if c >= q * total and c > 0), float("nan")) if total else float("nan")


def peak_gflops(bounds: dict, dtype: str) -> float:
    """The product rate a step's FLOPs are read against: in float32 the faster of our kernels' product and XLA's
    dot as machine_bounds measured them (where ours read less, as at its 2048 rows on a CPU without AVX-512, the
    machine can do better: a bound must not sit below it); in bfloat16 our bfloat16 product."""
    if dtype == "bfloat16":
        return bounds.get("bfloat16_gflops") or float("nan")
    return max(bounds.get("float32_gflops") or 0.0, bounds.get("xla_float32_gflops") or 0.0) or float("nan")


def where_time_goes(before: dict, after: dict, bounds: dict, dtype: str) -> list[str]:
    """Our engine over the measured load, read against the machine's bounds."""
    P = "opt_serving_"
    d = lambda k: after.get(P + k, 0.0) - before.get(P + k, 0.0)  # noqa: E731
    dense = after.get(P + "model_dense_flops_per_token")
    wbytes, kvbytes = after.get(P + "model_weight_bytes"), after.get(P + "model_kv_entry_bytes")
    if dense is None:
        return ["  (no engine figures in /metrics)"]
    peak = peak_gflops(bounds, dtype)
    bw = bounds["bandwidth_gbs"]
    pre_s, dec_s, computed = d("prefill_seconds_total"), d("decode_seconds_total"), d("prefill_computed_tokens_total")
    passes, steps, rows = d("prefill_passes_total"), d("decode_steps_total"), d("decode_step_requests_total")
    joined, kv = d("joined_prompt_tokens_total"), d("decode_kv_entries_total")
    out = []
    if pre_s > 0:
        gf = computed * dense / pre_s / 1e9
        out.append(f"  prefill: {computed:.0f} prompt tokens computed in {passes:.0f} passes, {pre_s:.1f} s: "
                   f"{computed / pre_s:.0f} tokens/s, {gf:.0f} GFLOP/s in the dense layers = {gf / peak:.0%} of the "
                   f"measured {peak:.0f} GFLOP/s peak")
    w = decode_work(before, after, bounds, dtype)
    if w:
        gb, gf, step_ms, bound_ms = w["gb"], w["gflop"], w["step_ms"], w["bound_ms"]
        out.append(f"  decode: {steps:.0f} steps of {rows / steps:.1f} rows on average ({joined:.0f} prompt tokens "
                   f"joined them), {dec_s:.1f} s, {step_ms:.1f} ms a step; a step reads {gb / steps * 1e3:.0f} MB "
                   f"(weights {wbytes / 1e6:.0f} MB + KV {kv * kvbytes / steps / 1e6:.0f} MB): {gb / dec_s:.1f} GB/s "
                   f"= {gb / dec_s / bw:.0%} of the measured {bw:.1f} GB/s; {gf / dec_s:.0f} GFLOP/s = "
                   f"{gf / dec_s / peak:.0%} of the peak")
        out.append(f"  bound: a step's work at the machine's bounds takes {bound_ms:.1f} ms (its "
                   f"{gf / steps:.1f} GFLOP at the {peak:.0f} GFLOP/s peak: {w['flop_ms']:.1f} ms; its "
                   f"{gb / steps * 1e3:.0f} MB at {bw:.1f} GB/s: {w['read_ms']:.1f} ms; the longer of the two, "
                   f"{w['flop_ms'] + w['read_ms']:.1f} ms if they do not overlap), ours {step_ms / bound_ms:.2f}x "
                   f"that: at most {step_ms / bound_ms:.2f}x these tokens/s on this machine")
        out.append(f"  in series: {w['serial_ms']:.1f} ms (the FLOPs at the peak, then the KV at the bandwidth: a "
                   f"layer's attention waits for its products and the next products for it; the weights stream "
                   f"under their products), ours {step_ms / w['serial_ms']:.2f}x that")
    busy = pre_s + dec_s
    if busy > 0:
        out.append(f"  the engine's busy time: prefill {pre_s / busy:.0%}, decode {dec_s / busy:.0%}; "
                   f"{passes / max(steps, 1):.2f} prefill passes a decode step")
    for key, what in (("queue_wait_seconds", "wait for a slot (or a prefill pass)"),
                      ("prompt_seconds", "from the start to the first token"),
                      ("decode_gap_seconds", "from one decode call to the next (rows running)")):
        count = d(key + "_count")
        if count:
            b = [(le, c - dict(before.get(P + key, [])).get(le, 0.0)) for le, c in after.get(P + key, [])]
            out.append(f"  {what}: mean {1e3 * d(key + '_sum') / count:.0f} ms, p50 <= {1e3 * _quantile(b, .5):.0f} "
                       f"ms, p99 <= {1e3 * _quantile(b, .99):.0f} ms ({count:.0f})")
    return out


def decode_work(before: dict, after: dict, bounds: dict, dtype: str) -> dict | None:
    """Our decode steps between two /metrics scrapes: their GB read and GFLOP done in all, a step's time, and a
    step's work at the machine's bounds (its FLOPs at the measured peak, its bytes at the bandwidth, the longer),
    and in series (serial_ms: the FLOPs, then the KV entries attention reads; at least all the bytes); None without
    engine figures or decode steps."""
    P = "opt_serving_"
    d = lambda k: after.get(P + k, 0.0) - before.get(P + k, 0.0)  # noqa: E731
    dense = after.get(P + "model_dense_flops_per_token")
    steps, dec_s = d("decode_steps_total"), d("decode_seconds_total")
    if dense is None or not steps or dec_s <= 0:
        return None
    peak = peak_gflops(bounds, dtype)
    rows, joined, kv = d("decode_step_requests_total"), d("joined_prompt_tokens_total"), d("decode_kv_entries_total")
    kv_gb = kv * after[P + "model_kv_entry_bytes"] / 1e9  # what attention reads
    gb = steps * after[P + "model_weight_bytes"] / 1e9 + kv_gb
    gflop = ((rows + joined) * dense + rows * after[P + "model_head_flops_per_token"]) / 1e9
    flop_ms, read_ms = 1e3 * gflop / steps / peak, 1e3 * gb / steps / bounds["bandwidth_gbs"]
    kv_ms = 1e3 * kv_gb / steps / bounds["bandwidth_gbs"]
    return {"gb": gb, "gflop": gflop, "step_ms": 1e3 * dec_s / steps, "flop_ms": flop_ms, "read_ms": read_ms,
            "bound_ms": max(flop_ms, read_ms), "serial_ms": max(flop_ms + kv_ms, read_ms)}


def headroom(before: dict, after: dict, bounds: dict, dtype: str) -> float:
    """Our decode step's time over its work at the machine's bounds (nan: no decode steps measured)."""
    w = decode_work(before, after, bounds, dtype)
    return w["step_ms"] / w["bound_ms"] if w else float("nan")


def load(args, scenario: list[str], out: Path, warm: bool = False) -> dict:
    extra = ["--num-requests", "16"] if warm else []
    cmd = [sys.executable, str(ROOT / "benchmark" / "served" / "benchmark_serving.py"), "--url",
           f"http://127.0.0.1:{args.port}", "--seed", str(1 if warm else 0), *scenario, *extra, "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"benchmark_serving failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "opt-serving-vs-vllm"
    p.add_argument("--hf", default=str(work / "hf"), help="Hugging Face OPT folder (weights and tokenizer), vLLM's")
    p.add_argument("--numpy", default=str(work / "np"), help="our numpy folder of the same weights")
    p.add_argument("--tokenizer", default=str(ROOT / ".." / "shared" / "opt-assets"))
    p.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides' weights")
    p.add_argument("--servers", default=None, help="comma separated (default: ours,ours-no-prefix,vllm for "
                                                  "shared-prefix, ours,vllm otherwise)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=18600)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    args.servers = (args.servers or ("ours,ours-no-prefix,vllm" if args.scenario == "shared-prefix"
                                     else "ours,vllm")).split(",")
    unknown = [s for s in args.servers if s not in OURS_FLAGS and s not in ("vllm", "vllm-defaults")]
    if unknown:
        p.error(f"unknown servers {unknown}: ours, ours-no-prefix, ours-whole, vllm, vllm-defaults")
    return args


def report(args, runs: list[dict], bounds: list[dict]) -> dict:
    med = harness.medians(runs, "server", ("tokens_per_s", "ttft_p50_s", "ttft_p99_s"))
    print(f"{machine_description()}; scenario {args.scenario}, {args.dtype}; medians over {args.rounds} rounds:")
    for b in bounds:
        print(f"  {machine_bounds.describe(b)} ({b['when']})")
    for n in args.servers:
        vs = "" if "vllm" not in med or n == "vllm" else (
            f"  = {med[n]['tokens_per_s'] / med['vllm']['tokens_per_s']:.2f}x vLLM's tokens/s, TTFT p50 "
            f"{med[n]['ttft_p50_s'] / med['vllm']['ttft_p50_s']:.2f}x, p99 {med[n]['ttft_p99_s'] / med['vllm']['ttft_p99_s']:.2f}x")
        print(f"  {n:>15}: {med[n]['tokens_per_s']:7.1f} tokens/s, TTFT p50 {1e3 * med[n]['ttft_p50_s']:.0f} ms, "
              f"p99 {1e3 * med[n]['ttft_p99_s']:.0f} ms{vs}")
    for n in [n for n in args.servers if not n.startswith("vllm") and "vllm" in med]:
        room = sorted(r.get("headroom", float("nan")) for r in runs if r["server"] == n)
        if room and room[0] == room[0]:
            best = med[n]["tokens_per_s"] * room[len(room) // 2]
            print(f"  {n} at the machine's bounds (its steps' FLOPs at the peak or their bytes at the bandwidth, "
                  f"the longer): at most {best:.0f} tokens/s = {best / med['vllm']['tokens_per_s']:.2f}x vLLM's")
        harness.print_comparison([(what, scale * med[n][k], scale * med["vllm"][k]) for what, k, scale in
                                  (("output tokens/s", "tokens_per_s", 1), ("TTFT p50 ms", "ttft_p50_s", 1e3),
                                   ("TTFT p99 ms", "ttft_p99_s", 1e3))],
                                 ours=n, peer="vllm", title=f"{args.scenario} {args.dtype}: {n} against vLLM at full "
                                                             "strength, medians")
    return med


def main(argv=None) -> None:
    args = parse_args(argv)
    make_weights(Path(args.hf), Path(args.numpy), args.tokenizer)
    scenario, runs, configs = SCENARIOS[args.scenario], [], {}
    for name in args.servers:
        if name.startswith("vllm"):
            configs[name] = vllm_config(name == "vllm", args.hf, args.dtype)[2]
            print(f"{name}: {configs[name]}", flush=True)
    bounds = [{**machine_bounds.measure(), "when": "before"}]
    print(machine_bounds.describe(bounds[0]), flush=True)
    with tempfile.TemporaryDirectory(prefix="opt-serving-vs-vllm-") as tmp:
        work = Path(tmp)
        for rnd, name in harness.in_turn(args.servers, args.rounds):
            cmd, env, ready = server_command(name, args)
            server = harness.start(cmd, ready, name=name, env=env, log=work / f"{name}-{rnd}.log",
                                   timeout=args.start_timeout)
            ours = not name.startswith("vllm")
            try:
                load(args, scenario, work / "warm.json", warm=True)
                before = scrape(f"http://127.0.0.1:{args.port}") if ours else None
                s = load(args, scenario, work / f"{name}-{rnd}.json")
                after = scrape(f"http://127.0.0.1:{args.port}") if ours else None
            finally:
                server.stop()
            row = {"round": rnd, "server": name, "time": now(), "start_s": server.start_s,
                   "tokens_per_s": s["output_tokens_per_s"], "ttft_p50_s": s["ttft_s"]["median"],
                   "ttft_p99_s": s["ttft_s"]["p99"], "itl_p99_s": s["itl_s"]["p99"],
                   "cached_input_tokens": s["cached_input_tokens"], "input_tokens": s["total_input_tokens"],
                   "failed": s["failed"]}
            runs.append(row)
            print(f"round {rnd} {name:>15}: {row['tokens_per_s']:7.1f} tokens/s, TTFT p50 "
                  f"{1e3 * row['ttft_p50_s']:7.0f} ms, p99 {1e3 * row['ttft_p99_s']:7.0f} ms, ITL p99 "
                  f"{1e3 * row['itl_p99_s']:6.0f} ms, cached {row['cached_input_tokens']}/{row['input_tokens']}, "
                  f"started in {row['start_s']:.0f} s{', FAILED ' + str(row['failed']) if row['failed'] else ''}",
                  flush=True)
            if ours:
                row["engine"] = where_time_goes(before, after, bounds[0], args.dtype)
                row["headroom"] = headroom(before, after, bounds[0], args.dtype)
                print("\n".join(row["engine"]), flush=True)
    bounds.append({**machine_bounds.measure(products=False), "cores": bounds[0]["cores"], "when": "after"})
    med = report(args, runs, bounds)
    if args.json:
        write_json(args.json, {"time": now(), "machine": machine_description(), "scenario": args.scenario,
                               "dtype": args.dtype, "load": scenario, "configs": configs, "bounds": bounds,
                               "runs": runs, "medians": med})


if __name__ == "__main__":
    harness.script(main)

"""Our load generator (benchmark_serving.py) against a third-party one, NVIDIA's AIPerf (PyPI `aiperf`),
on the same server and the same request shape, run alternately; prints both tools' figures side by side.

Usage:
  python -m venv .venv-bench && .venv-bench/bin/pip install -r requirements-bench.txt   # AIPerf, its own venv
  python benchmark/served/compare_loadgen.py                       # starts `opt-serving serve` (the embedded tiny model)
  python benchmark/served/compare_loadgen.py --model jax/opt-125m --dummy --tokenizer ../shared/opt-assets \\
      --concurrency 32 --num-requests 128 --prompt-len 8 --output-len 64 --rounds 2 --json compare.json
  python benchmark/served/compare_loadgen.py --url http://127.0.0.1:8000 --tokenizer ../shared/opt-assets  # a running server

Both tools send streaming OpenAI /v1/completions requests, greedy, with max_tokens = min_tokens = --output-len
and ignore_eos (vLLM's extensions, which our server honours), so every request makes exactly --output-len
tokens; both count output tokens from the server's usage chunk (AIPerf: --use-server-token-count).
Prompts: ours sends --prompt-len random token ids; AIPerf sends text it synthesises to --prompt-len tokens of
the server's own tokenizer (saved for it in Hugging Face form from --tokenizer, or the embedded model's), so
the server sees the same prompt lengths (the usage's prompt tokens are printed for both).
Definitions, the same in both tools: TTFT = request sent -> first chunk with text; TPOT (AIPerf's "inter token
latency") = (end-to-end - TTFT) / (output tokens - 1); output tokens/s = output tokens / the run's wall time
(ours: first request sent to last finished, AIPerf: its benchmark duration, the same span).
Runs go in ABBA order (ours, AIPerf, AIPerf, ours, ...) so drift in the machine's speed hits both alike;
one short warm-up run of ours comes first. Loopback URLs only.
Also printed per run: the CPU time the tool's processes used inside its measured window (sampled with
psutil) and, from our server's /metrics read around the run, the server's own TTFT (request received -> first
token out) and mean inter-token latency; a tool's TPOT over the server's ITL shows whether it measures what
the server did. On a machine where client and server share the cores, a client that uses more CPU slows the
server itself: --server-cpus 0 --client-cpus 1 gives the load generators a core of their own.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark import harness  # noqa: E402
from benchmark.common import machine_description, now, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OURS = REPO / "benchmark" / "served" / "benchmark_serving.py"


def find_aiperf(given: str | None = None) -> str | None:
    """--aiperf, $AIPERF, `aiperf` on PATH, or the benchmark venv's (.venv-bench/bin/aiperf)."""
    for cand in (given, os.environ.get("AIPERF"), shutil.which("aiperf"), REPO / ".venv-bench" / "bin" / "aiperf"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def save_hf_tokenizer(tokenizer: str | None, out_dir: str) -> str:
    """The server's tokenizer (a folder as `opt-serving serve --tokenizer` takes it, or None: the embedded
    model's) written as a Hugging Face tokenizer folder, which AIPerf loads with AutoTokenizer."""
    from opt_serving.text.tokenizer import load_tokenizer
    load_tokenizer(tokenizer).save_pretrained(out_dir)
    return out_dir


def aiperf_command(aiperf: str, url: str, model: str, tokenizer_dir: str, concurrency: int, num_requests: int,
                   prompt_len: int, output_len: int, artifact_dir: str, seed: int = 0,
                   extra: list[str] | None = None) -> list[str]:
    inputs = {"temperature": 0, "ignore_eos": True, "min_tokens": output_len}
    return [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", tokenizer_dir, "--isl", str(prompt_len), "--isl-stddev", "0",
            "--osl", str(output_len), "--osl-stddev", "0", "--extra-inputs", json.dumps(inputs),
            "--use-server-token-count", "--concurrency", str(concurrency), "--request-count", str(num_requests),
            "--random-seed", str(seed), "--artifact-dir", artifact_dir, "--no-auto-plot",
            # one load-generating process, as ours is; no side traffic to the server or the GPU libraries
            "--workers-max", "1", "--record-processors", "1", "--no-server-metrics", "--no-gpu-telemetry",
            "--ui", "none", *(extra or [])]


def parse_aiperf(artifact_dir: str) -> dict:
    """AIPerf's summary (profile_export_aiperf.json) in benchmark_serving.py's units (seconds)."""
    with open(Path(artifact_dir) / "profile_export_aiperf.json") as f:
        d = json.load(f)

    def stat(key, scale=1e-3):
        v = d.get(key) or {}
        return {"mean": v.get("avg", float("nan")) * scale, "median": v.get("p50", float("nan")) * scale,
                "p99": v.get("p99", float("nan")) * scale}

    def total(key):
        v = d.get(key) or {}
        return v.get("avg", 0)

    return {"tool": "aiperf", "completed": int(total("request_count")),
            "failed": int(sum(e.get("count", 0) for e in d.get("error_summary") or [])),
            "total_output_tokens": int(total("total_usage_completion_tokens") or total("total_osl")),
            "total_input_tokens": int(total("total_usage_prompt_tokens") or total("total_isl")),
            "duration_s": total("benchmark_duration"), "output_tokens_per_s": total("output_token_throughput"),
            "ttft_s": stat("time_to_first_token"), "tpot_s": stat("inter_token_latency"),
            "e2e_s": stat("request_latency")}


class TreeCPU(threading.Thread):
    """Samples the CPU time (user + system) used so far by a process and all its descendants, every
    `interval` s, so that the CPU a tool used inside its measured window can be told from its start-up."""

    def __init__(self, pid: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float]] = []  # (wall-clock time, CPU seconds so far)
        self.stop = threading.Event()
        self._cpu: dict[int, float] = {}

    def run(self):
        import psutil
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self.stop.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    t = p.cpu_times()
                    self._cpu[p.pid] = t.user + t.system
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.samples.append((time.time(), sum(self._cpu.values())))
            self.stop.wait(self.interval)

    def between(self, t0: float, t1: float) -> float:
        if len(self.samples) < 2:
            return float("nan")
        import numpy as np
        ts, cpu = zip(*self.samples)
        return float(np.interp(t1, ts, cpu) - np.interp(t0, ts, cpu))


CLIENT_CPUS: set[int] | None = None  # --client-cpus: the load generators run on these CPUs only


def _pin(cpus: set[int] | None):
    """preexec_fn for Popen: the child (and everything it starts) may run on `cpus` only."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def parse_cpus(text: str) -> set[int]:
    """'1' -> {1}; '0,2-3' -> {0, 2, 3}."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def run_tool(cmd: list[str], timeout: float) -> tuple[int, str, TreeCPU, float]:
    """Runs a load generator; returns (exit status, output, its CPU samples, wall-clock time it exited)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_pin(CLIENT_CPUS))
    cpu = TreeCPU(proc.pid)
    cpu.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    t_exit = time.time()
    cpu.stop.set()
    cpu.join()
    return proc.returncode, out, cpu, t_exit


def run_aiperf(cmd: list[str], artifact_dir: str, timeout: float) -> dict:
    rc, out, cpu, t_exit = run_tool(cmd, timeout)
    if rc != 0 or not (Path(artifact_dir) / "profile_export_aiperf.json").is_file():
        raise RuntimeError(f"aiperf failed (exit {rc}):\n{out[-3000:]}")
    s = parse_aiperf(artifact_dir)
    with open(Path(artifact_dir) / "profile_export_aiperf.json") as f:
        d = json.load(f)
    from datetime import datetime
    try:  # its profiling window, in local time
        t0, t1 = (datetime.fromisoformat(d[k]).timestamp() for k in ("start_time", "end_time"))
    except (KeyError, TypeError, ValueError):
        t0, t1 = t_exit - s["duration_s"], t_exit
    s["client_cpu_s"], s["client_cpu_total_s"] = cpu.between(t0, t1), cpu.between(0, t_exit)
    return s


def run_ours(url: str, model: str, concurrency: int, num_requests: int, prompt_len: int, output_len: int,
             out_json: str, timeout: float, seed: int = 0, token_ids: str | None = None) -> dict:
    cmd = [sys.executable, str(OURS), "--url", url, "--model", model, "--concurrency", str(concurrency),
           "--num-requests", str(num_requests), "--prompt-len", f"{prompt_len}:{prompt_len}",
           "--output-len", f"{output_len}:{output_len}", "--ignore-eos", "--seed", str(seed), "--json", out_json]
    cmd += ["--token-ids", token_ids] if token_ids else []  # prompt ids drawn from LO:HI (inside the vocabulary)
    rc, out, cpu, t_exit = run_tool(cmd, timeout)
    if rc != 0:
        raise RuntimeError(f"benchmark_serving.py failed (exit {rc}):\n{out[-3000:]}")
    with open(out_json) as f:
        s = json.load(f)
    s["tool"] = "ours"
    # its window ends as it reports, just before it exits
    s["client_cpu_s"] = cpu.between(t_exit - s["duration_s"], t_exit)
    s["client_cpu_total_s"] = cpu.between(0, t_exit)
    return s


_SERVER_SERIES = {
    "output_tokens": "opt_serving_generation_tokens_total",
    "requests": 'opt_serving_requests_total{endpoint="completions",status="200"}',
    "ttft_sum": "opt_serving_time_to_first_token_seconds_sum",
    "ttft_count": "opt_serving_time_to_first_token_seconds_count",
    "itl_sum": "opt_serving_inter_token_latency_seconds_sum",
    "itl_count": "opt_serving_inter_token_latency_seconds_count",
}


def scrape(url: str) -> dict | None:
    """The server's own counters (our /metrics); None for a server without them."""
    import httpx
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    if "opt_serving_generation_tokens_total" not in text:
        return None
    values = {}
    for key, series in _SERVER_SERIES.items():
        m = re.search(r"^" + re.escape(series) + r" ([0-9.e+-]+)$", text, re.M)
        values[key] = float(m.group(1)) if m else 0.0  # a labelled series appears with its first sample
    return values


def server_view(before: dict | None, after: dict | None) -> dict | None:
    """What the server measured over one run: its TTFT (request received -> first token out) and mean
    inter-token latency (for requests of equal length, the mean TPOT), and the tokens it generated."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in after}
    return {"output_tokens": int(d["output_tokens"]), "requests": int(d["requests"]),
            "ttft_mean_s": d["ttft_sum"] / d["ttft_count"] if d["ttft_count"] else float("nan"),
            "itl_mean_s": d["itl_sum"] / d["itl_count"] if d["itl_count"] else float("nan")}


def measured(run, url: str) -> dict:
    """`run()`'s summary plus the server's own view of the same run."""
    before = scrape(url)
    r = run()
    r["server"] = server_view(before, scrape(url))
    return r


def start_server(argv: list[str], port: int, timeout: float = 600, cpus: set[int] | None = None) -> harness.Server:
    """`opt-serving serve` in a subprocess (a private local Ray, stopped by SIGINT on exit)."""
    return harness.serve(argv, port=port, preexec_fn=_pin(cpus), timeout=timeout)


def model_name(url: str) -> str:
    import httpx
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summarize_runs(runs: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"runs": len(runs), "output_tokens_per_s": med([r["output_tokens_per_s"] for r in runs]),
            "ttft_p50_s": med([r["ttft_s"]["median"] for r in runs]),
            "tpot_p50_s": med([r["tpot_s"]["median"] for r in runs]),
            "ttft_mean_s": med([r["ttft_s"]["mean"] for r in runs]),
            "tpot_mean_s": med([r["tpot_s"]["mean"] for r in runs]),
            "client_cpu_s": med([r.get("client_cpu_s", float("nan")) for r in runs]),
            "client_cpu_total_s": med([r.get("client_cpu_total_s", float("nan")) for r in runs]),
            # the tool's TTFT over the server's own (request received -> first token): the client's share
            "ttft_mean_over_server": med([r["ttft_s"]["mean"] / r["server"]["ttft_mean_s"] for r in runs
                                          if r.get("server")]),
            "tpot_mean_over_server_itl": med([r["tpot_s"]["mean"] / r["server"]["itl_mean_s"] for r in runs
                                              if r.get("server")])}


def print_table(ours: list[dict], theirs: list[dict]) -> dict:
    print(f"{'run':<5}{'tool':<8}{'done':>5}{'out tok':>8}{'in tok':>7}{'tokens/s':>9}{'TTFT p50':>10}"
          f"{'TTFT mean':>11}{'TPOT p50':>10}{'TPOT mean':>11}{'client CPU':>11}"
          f"{'| server: out tok':>18}{'TTFT mean':>11}{'ITL mean':>10}")
    for r in sorted(ours + theirs, key=lambda r: r["order"]):
        sv = r.get("server") or {}
        print(f"{r['order']:<5}{r['tool']:<8}{r['completed']:>5}{r['total_output_tokens']:>8}"
              f"{r['total_input_tokens']:>7}{r['output_tokens_per_s']:>9.1f}"
              f"{1e3 * r['ttft_s']['median']:>8.1f}ms{1e3 * r['ttft_s']['mean']:>9.1f}ms"
              f"{1e3 * r['tpot_s']['median']:>8.1f}ms{1e3 * r['tpot_s']['mean']:>9.1f}ms"
              f"{r.get('client_cpu_s', float('nan')):>10.1f}s"
              f"{sv.get('output_tokens', float('nan')):>18}{1e3 * sv.get('ttft_mean_s', float('nan')):>9.1f}ms"
              f"{1e3 * sv.get('itl_mean_s', float('nan')):>8.1f}ms")
    a, b = summarize_runs(ours), summarize_runs(theirs)
    print(f"\nmedian over runs          {'ours':>12}{'aiperf':>12}{'aiperf/ours':>13}")
    rows = [("output tokens/s", "output_tokens_per_s", 1), ("TTFT p50 (ms)", "ttft_p50_s", 1e3),
            ("TTFT mean (ms)", "ttft_mean_s", 1e3), ("TPOT p50 (ms)", "tpot_p50_s", 1e3),
            ("TPOT mean (ms)", "tpot_mean_s", 1e3), ("client CPU in window (s)", "client_cpu_s", 1),
            ("client CPU in all (s)", "client_cpu_total_s", 1),
            ("TTFT / server's", "ttft_mean_over_server", 1), ("TPOT / server's ITL", "tpot_mean_over_server_itl", 1)]
    ratios = {}
    for label, key, scale in rows:
        ratios[key] = ratio(b[key], a[key])
        print(f"{label:<26}{scale * a[key]:>12.{3 if scale == 1 and a[key] < 10 else 1}f}"
              f"{scale * b[key]:>12.{3 if scale == 1 and b[key] < 10 else 1}f}{ratios[key]:>13.3f}")
    spread = {t: (min(r["output_tokens_per_s"] for r in rs), max(r["output_tokens_per_s"] for r in rs))
              for t, rs in (("ours", ours), ("aiperf", theirs)) if rs}
    print("tokens/s range: " + ", ".join(f"{t} {lo:.1f}-{hi:.1f}" for t, (lo, hi) in spread.items()))
    return {"ours": a, "aiperf": b, "aiperf_over_ours": ratios, "tokens_per_s_range": spread}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (loopback); default: start `opt-serving serve` here")
    p.add_argument("--model", help="server --model (default: the embedded tiny model)")
    p.add_argument("--dummy", action="store_true", help="server --dummy")
    p.add_argument("--tokenizer", help="server --tokenizer, also what AIPerf counts prompt tokens with "
                                       "(default: the embedded model's)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--token-ids", metavar="LO:HI", help="our client's prompt ids (benchmark_serving.py "
                                                          "--token-ids; keep them inside the vocabulary)")
    p.add_argument("--server-cpus", type=parse_cpus, metavar="LIST",
                   help="run the server started here (Ray and the replica) on these CPUs only, e.g. 0")
    p.add_argument("--client-cpus", type=parse_cpus, metavar="LIST",
                   help="run both load generators on these CPUs only, e.g. 1: then neither takes CPU from the "
                        "server, as with a client on another machine")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds: each gives two runs of each tool")
    p.add_argument("--aiperf", help="the aiperf executable (default: $AIPERF, PATH, .venv-bench/bin/aiperf)")
    p.add_argument("--aiperf-arg", action="append", default=[], help="extra argument for aiperf (repeatable)")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if args.url:
        from benchmark.served.benchmark_serving import check_loopback
        check_loopback(p, args.url)
        args.url = args.url.rstrip("/")
    return args


def main(argv=None) -> dict:
    global CLIENT_CPUS
    args = parse_args(argv)
    CLIENT_CPUS = args.client_cpus
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        raise SystemExit("aiperf not found: python -m venv .venv-bench && .venv-bench/bin/pip install -r "
                         "requirements-bench.txt (or give --aiperf)")
    server = None
    tmp = tempfile.mkdtemp(prefix="compare_loadgen_")
    try:
        tokdir = save_hf_tokenizer(args.tokenizer, os.path.join(tmp, "tokenizer"))
        if args.url is None:
            sargs = ["--max-batch-size", str(args.max_batch_size), "--max-seq-len", str(args.max_seq_len)]
            sargs += (["--model", args.model] if args.model else []) + (["--dummy"] if args.dummy else [])
            sargs += ["--tokenizer", args.tokenizer] if args.tokenizer else []
            t0 = time.monotonic()
            server = start_server(sargs, args.port, cpus=args.server_cpus)
            print(f"server up in {time.monotonic() - t0:.1f} s at {server.url}", flush=True)
            url = server.url
        else:
            url = args.url
        model = model_name(url)
        shape = dict(concurrency=args.concurrency, num_requests=args.num_requests, prompt_len=args.prompt_len,
                     output_len=args.output_len)
        # warm-up: the first requests after start-up pay one-off costs (connection set-up, lazy imports)
        run_ours(url, model, args.concurrency, min(args.num_requests, 2 * args.concurrency), args.prompt_len,
                 args.output_len, os.path.join(tmp, "warmup.json"), args.run_timeout, token_ids=args.token_ids)
        ours, theirs = [], []
        order = [t for _ in range(args.rounds) for t in ("ours", "aiperf", "aiperf", "ours")]
        for i, tool in enumerate(order):
            if tool == "ours":
                r = measured(lambda: run_ours(url, model, **shape, out_json=os.path.join(tmp, f"ours{i}.json"),
                                              timeout=args.run_timeout, token_ids=args.token_ids), url)
                ours.append(r)
            else:
                art = os.path.join(tmp, f"aiperf{i}")
                cmd = aiperf_command(aiperf, url, model, tokdir, **shape, artifact_dir=art, extra=args.aiperf_arg)
                r = measured(lambda: run_aiperf(cmd, art, args.run_timeout), url)
                theirs.append(r)
            r["order"] = i
            print(f"run {i} {tool}: {r['output_tokens_per_s']:.1f} tokens/s, {r['completed']} requests, "
                  f"TTFT p50 {1e3 * r['ttft_s']['median']:.1f} ms, TPOT p50 {1e3 * r['tpot_s']['median']:.1f} ms",
                  flush=True)
        pinned = "".join(f"; {who} on CPUs {sorted(c)}" for who, c in (("server", args.server_cpus),
                                                                        ("load generators", args.client_cpus)) if c)
        print(f"\n{machine_description()}; {model} at {url}; concurrency {args.concurrency}, "
              f"{args.num_requests} requests, prompt {args.prompt_len}, output {args.output_len} (ignore_eos)"
              + pinned)
        summary = print_table(ours, theirs)
        out = {"time": now(), "machine": machine_description(), "url": url, "model": model, **shape,
               "server_cpus": sorted(args.server_cpus or []), "client_cpus": sorted(args.client_cpus or []),
               "aiperf": aiperf, "runs": sorted(ours + theirs, key=lambda r: r["order"]), **summary}
        if args.json:
            write_json(args.json, out)
        return out
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    harness.script(main)

"""Benchmark a running server through its OpenAI /v1/completions route, streaming.

Usage:
  opt-serving serve --model jax/opt-125m --dummy ... &     # or any OpenAI-compatible server on this machine
  python benchmark/served/benchmark_serving.py --url http://127.0.0.1:8000 --concurrency 32 --num-requests 128
  python benchmark/served/benchmark_serving.py --request-rate 4 --num-requests 64 --json serving.json
  # ratio to the offline figure at the same batch size
  python benchmark/benchmark_text_gen.py --model jax/opt-125m --dummy --batch-size 32 --json offline.json
  python benchmark/served/benchmark_serving.py --concurrency 32 --compare-offline offline.json
  # shared-prefix traffic: every prompt is one 448-token prefix and a 16-token tail of its own
  python benchmark/served/benchmark_serving.py --concurrency 16 --num-requests 64 --shared-prefix 448 --prompt-len 16 \
      --output-len 32 --ignore-eos

Each request is greedy (temperature 0) with a prompt of random token ids and a max_tokens, both drawn
(seeded) from the given ranges, so a run is repeatable; with --shared-prefix N every prompt starts with the
same N random ids (a system prompt, few-shot examples), and the server's prefix cache, if it has one, can reuse
them (the cached prompt tokens its usage reports, `prompt_tokens_details.cached_tokens`, are summed). Clients either keep --concurrency requests in
flight (closed loop) or start requests at --request-rate per second (Poisson arrivals; both together:
at that rate, at most that many in flight). The run is bounded by --num-requests and --max-duration.

Per request: time to first token (TTFT: request sent -> first non-empty text chunk), time per output
token (TPOT: (end-to-end - TTFT) / (output tokens - 1)), inter-token latencies (ITL: gaps between text
chunks, pooled over requests) and end-to-end latency; output tokens come from the server's usage
chunk (stream_options.include_usage), falling back to the number of text chunks.
Only loopback URLs are accepted: this is a load generator, not something to point at other hosts.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import sys
from pathlib import Path
import time
from urllib.parse import urlparse

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark.common import machine_description, now, summarize, write_json  # noqa: E402


def parse_range(text: str) -> tuple[int, int]:
    """'16:128' -> (16, 128) inclusive; '32' -> (32, 32)."""
    lo, _, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, help="requests kept in flight (default 32 without --request-rate)")
    p.add_argument("--request-rate", type=float, help="requests per second, Poisson arrivals")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-duration", type=float, default=300.0,
                   help="seconds; no request starts after it and unfinished ones are cancelled")
    p.add_argument("--prompt-len", type=parse_range, default=(16, 128), metavar="LO:HI", help="prompt tokens")
    p.add_argument("--output-len", type=parse_range, default=(16, 128), metavar="LO:HI", help="max_tokens")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N random token ids, then its own --prompt-len")
    p.add_argument("--token-ids", type=parse_range, default=(4, 1000), metavar="LO:HI",
                   help="prompt token ids are drawn from this range (keep it inside the model's vocabulary)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="also send min_tokens=max_tokens and ignore_eos=true (vLLM's extensions; servers "
                        "without them ignore them)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-offline", metavar="JSON", help="benchmark_text_gen.py --json output to compare with")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 32
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be positive")
    if args.num_requests < 1 or args.max_duration <= 0:
        p.error("--num-requests and --max-duration must be positive")
    check_loopback(p, args.url)
    args.url = args.url.rstrip("/")
    return args


def check_loopback(p: argparse.ArgumentParser, url: str) -> None:
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        p.error(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    host = u.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        p.error(f"--url {url!r} is not a loopback address: this benchmark only drives a server on this machine")


@dataclasses.dataclass
class Result:
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float = float("nan")
    e2e: float = float("nan")
    chunk_times: list = dataclasses.field(default_factory=list)  # seconds since the request was sent
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def make_requests(args) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(args.token_ids[0], args.token_ids[1] + 1, size=args.shared_prefix).tolist()
    out = []
    for _ in range(args.num_requests):
        n = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        ids = shared + rng.integers(args.token_ids[0], args.token_ids[1] + 1, size=n).tolist()
        out.append((ids, int(rng.integers(args.output_len[0], args.output_len[1] + 1))))
    return out


async def one_request(client, args, model: str, prompt: list[int], max_tokens: int) -> Result:
    res = Result(prompt_len=len(prompt), max_tokens=max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body.update(min_tokens=max_tokens, ignore_eos=True)
    usage = None
    t0 = time.perf_counter()
    try:
        async with client.post(args.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:300].decode(errors='replace')}"
                return res
            async for line in r.content:  # server-sent events, a line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error']}"
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                if any(c.get("text") for c in obj.get("choices", [])):
                    res.chunk_times.append(time.perf_counter() - t0)
    except Exception as e:  # connection refused / reset, timeout, malformed JSON: count it, keep going
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.output_tokens = int(usage["completion_tokens"]) if usage else len(res.chunk_times)
    res.prompt_tokens = int(usage["prompt_tokens"]) if usage else len(prompt)
    res.cached_tokens = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if not res.chunk_times:
        res.error = "no text in the stream"
        return res
    res.ttft = res.chunk_times[0]
    res.ok = True
    return res


async def run_load(args, model: str, requests: list) -> tuple[list[Result], float, int]:
    """Returns (finished results, wall seconds, number cancelled unfinished)."""
    # aiohttp, not httpx: the load generator shares the machine with the server, and httpx's async
    # streaming took about a third more CPU (3.5-4.0 s against 2.6-3.0 s for 128 x 64 streamed tokens)
    import aiohttp
    limit = args.concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    rng = np.random.default_rng(args.seed + 1)
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        t_start = time.perf_counter()
        deadline = t_start + args.max_duration

        async def guarded(prompt, max_tokens):
            async with sem:
                if time.perf_counter() > deadline:
                    return None
                return await one_request(client, args, model, prompt, max_tokens)

        tasks = []
        for prompt, max_tokens in requests:
            if args.request_rate is not None:
                # Poisson arrivals: exponential gaps, seeded so runs repeat
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
            if time.perf_counter() > deadline:
                break
            tasks.append(asyncio.create_task(guarded(prompt, max_tokens)))
        done, pending = set(), set()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t_start
    results = [t.result() for t in done if t.result() is not None]
    return results, wall, len(requests) - len(results)


def get_model_name(url: str) -> str:
    import httpx
    try:
        r = httpx.get(url + "/v1/models", timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:
        raise SystemExit(f"cannot list models at {url}/v1/models ({type(e).__name__}: {e}); "
                         "is the server running? (or give --model)") from None


def report(args, model: str, results: list[Result], wall: float, unfinished: int) -> dict:
    ok = [r for r in results if r.ok]
    # the run ends when the last request finishes; `wall` also covers a deadline's wait
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    s = {
        "time": now(), "machine": machine_description(), "url": args.url, "model": model,
        "concurrency": args.concurrency, "request_rate": args.request_rate,
        "num_requests": args.num_requests, "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
        "shared_prefix": args.shared_prefix,
        "completed": len(ok), "failed": len(results) - len(ok), "unfinished": unfinished,
        "duration_s": wall,
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
        "cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "ttft_s": summarize(r.ttft for r in ok), "tpot_s": summarize(tpot), "itl_s": summarize(itl),
        "e2e_s": summarize(r.e2e for r in ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if args.compare_offline:
        with open(args.compare_offline) as f:
            offline = json.load(f)
        s["offline_tokens_per_s"] = offline["tokens_per_s"]
        s["offline_batch_size"] = offline["batch_size"]
        s["served_over_offline"] = s["output_tokens_per_s"] / offline["tokens_per_s"]
    return s


def print_report(s: dict) -> None:
    load = f"concurrency {s['concurrency']}" if s["request_rate"] is None else f"rate {s['request_rate']}/s"
    print(f"{s['machine']}; {s['model']} at {s['url']}, {load}")
    print(f"requests: {s['completed']} completed, {s['failed']} failed, {s['unfinished']} unfinished "
          f"in {s['duration_s']:.2f} s")
    print(f"request throughput: {s['request_throughput']:.2f} req/s; output: {s['output_tokens_per_s']:.1f} tokens/s "
          f"({s['total_output_tokens']} tokens; input {s['total_input_tokens']} tokens, "
          f"{s['cached_input_tokens']} of them cached as the server reports)")
    for key, label in (("ttft_s", "time to first token"), ("tpot_s", "time per output token"),
                       ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end latency")):
        v = s[key]
        print(f"{label:>22}: mean {1e3 * v['mean']:8.1f} ms, median {1e3 * v['median']:8.1f} ms, "
              f"p99 {1e3 * v['p99']:8.1f} ms")
    if "served_over_offline" in s:
        print(f"served / offline (batch {s['offline_batch_size']}): {s['served_over_offline']:.2f} "
              f"({s['output_tokens_per_s']:.1f} / {s['offline_tokens_per_s']:.1f} tokens/s)")
    for e in s["errors"]:
        print(f"error: {e}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = args.model or get_model_name(args.url)
    results, wall, unfinished = asyncio.run(run_load(args, model, make_requests(args)))
    s = report(args, model, results, wall, unfinished)
    print_report(s)
    if args.json:
        write_json(args.json, s)
    return s


if __name__ == "__main__":
    main()

"""Served speculative decoding by prompt lookup (runner/ngram.py) against the same server without it, the two
taking turns (plain, ngram, ngram, plain, ...), each load through the OpenAI streaming route with
benchmark_serving.py's client, greedy:

- copy-heavy, at each of --streams: an OPT-125m built to copy (offline/bench_speculative.py's CopyingSource: no
  attention output and no position embeddings, so its next token is a function of the current one), each prompt P
  followed by the model's own greedy continuation S of P (asked of the server, `return_token_ids`) and P again:
  the continuation repeats text the prompt holds, as an edit, an extraction or a quoting summary does;
- random, 16 streams: a random OPT-125m (--dummy), random prompts of 16-128 tokens, 64 new tokens each (with
  --ignore-eos), text prompt lookup rarely predicts: where drafts do not pay, the rule must stop them.

Prints each side's output tokens/s, TTFT p50 and the drafts and kept drafts (/metrics), then ngram / plain.

    python benchmark/served/bench_spec_served.py --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark import harness  # noqa: E402
from benchmark.common import machine_description, now  # noqa: E402
from benchmark.served import benchmark_serving as bs  # noqa: E402

OPT_ASSETS = harness.ROOT.parent / "shared" / "opt-assets"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
SPEC = ("drafts", "draft_tokens", "accepted_tokens")


def copying_folder(folder: Path) -> Path:
    """A float32 numpy folder of an OPT-125m built to copy (kept for the next run; config.json last)."""
    if (folder / "config.json").exists():
        return folder
    from benchmark.offline.bench_speculative import CopyingSource
    from opt_serving.config import get_config
    from opt_serving.model import weights
    cfg, source = get_config("opt-125m"), CopyingSource(0)
    folder.mkdir(parents=True, exist_ok=True)
    for key, shape in weights.param_shapes(cfg).items():  # (CopyingSource's weights, as numpy files)
        copying = "embed_positions" in key or key.endswith("self_attn.out_proj.weight")
        host = source.host(key, shape)
        weights.save_array(folder / key, host * 0 if copying else host)
    cfg.save_hf_json(folder)
    return folder


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def copy_heavy(url: str, n: int, tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """n prompts P + S + P, S the server's greedy continuation of P (the same on either side: greedy)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, 2000, 32).tolist() for _ in range(n)]

    def said(p):
        return post(f"{url}/v1/completions", {"prompt": p, "max_tokens": tokens, "temperature": 0,
                                              "return_token_ids": True})["choices"][0]["token_ids"]
    with ThreadPoolExecutor(16) as pool:
        return [(p + s + p, tokens) for p, s in zip(prompts, pool.map(said, prompts))]


def spec_counts(url: str) -> dict:
    """The server's speculative decoding counters (/metrics)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=60).read().decode()
    got = dict.fromkeys(SPEC, 0.0)
    for line in text.splitlines():
        for key in SPEC:
            if line.startswith(f"opt_serving_spec_decode_num_{key}_total "):
                got[key] = float(line.split()[-1])
    return got


def load(url: str, requests, streams: int, ignore_eos: bool) -> dict:
    args = argparse.Namespace(url=url, concurrency=streams, request_rate=None, max_duration=600.0,
                              request_timeout=600.0, seed=0, ignore_eos=ignore_eos)
    before = spec_counts(url)
    results, wall, unfinished = asyncio.run(bs.run_load(args, bs.get_model_name(url), requests))
    after = spec_counts(url)
    if unfinished or not all(r.ok for r in results):
        raise SystemExit(f"{url}: {unfinished} unfinished, errors: {[r.error for r in results if not r.ok][:3]}")
    row = {"tok_s": sum(r.output_tokens for r in results) / wall,
           "ttft_p50_ms": 1e3 * float(np.median([r.ttft for r in results]))}
    row.update({k: after[k] - before[k] for k in SPEC})
    return row


def server_args(model: str, side: str, folder: Path) -> list[str]:
    argv = ["--model", "jax/opt-125m", "--tokenizer", str(OPT_ASSETS), "--max-batch-size", "16"]
    argv += ["--path", str(folder)] if model == "copy" else ["--dummy"]
    return argv + (["--speculative-config", json.dumps(NGRAM)] if side == "ngram" else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", default="1,16", help="copy-heavy streams, comma separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="copy-heavy requests a stream (at least 8 in all)")
    ap.add_argument("--traffic", default="copy,random", help="comma separated: copy, random")
    ap.add_argument("--folder", default="/tmp/opt-serving-spec/copy-125m", help="where the copying model goes")
    ap.add_argument("--log-dir", default="/tmp/opt-serving-spec")
    args = ap.parse_args()
    if not (OPT_ASSETS / "gpt2-vocab.json").exists():
        raise SystemExit(f"the OPT tokenizer is needed: {OPT_ASSETS}")
    folder = copying_folder(Path(args.folder))
    streams = [int(s) for s in args.streams.split(",")]
    print(f"{now()}  {machine_description()}\nngram: --speculative-config '{json.dumps(NGRAM)}'; plain: none; "
          f"{args.tokens} new tokens a request, greedy; {args.rounds} rounds, the sides taking turns", flush=True)
    runs, prompts = [], {}
    for rnd, side in harness.in_turn(["plain", "ngram"], args.rounds):
        for model in args.traffic.split(","):
            log = Path(args.log_dir) / f"{side}-{model}-{rnd}.log"
            with harness.serve(server_args(model, side, folder), log=log) as server:
                url = server.url
                if model == "copy":
                    for s in streams:
                        if s not in prompts:
                            prompts[s] = copy_heavy(url, max(8, args.requests * s), args.tokens, seed=s)
                        row = load(url, prompts[s], s, ignore_eos=False)
                        runs.append({"side": side, "traffic": f"copy-heavy, {s} streams", **row})
                else:
                    reqs = [(ids, args.tokens) for ids, _ in bs.make_requests(argparse.Namespace(
                        seed=0, token_ids=(4, 2000), shared_prefix=0, num_requests=64, prompt_len=(16, 128),
                        output_len=(args.tokens, args.tokens)))]
                    runs.append({"side": side, "traffic": "random, 16 streams",
                                 **load(url, reqs, 16, ignore_eos=True)})
            for r in runs[-len(streams) if model == "copy" else -1:]:
                print(f"round {rnd} {side:5s} {r['traffic']:24s} {r['tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{r['ttft_p50_ms']:6.0f} ms  drafts {r['drafts']:.0f}, drafted {r['draft_tokens']:.0f}, "
                      f"kept {r['accepted_tokens']:.0f}", flush=True)
    print("\nmedians (ngram / plain):")
    for traffic in dict.fromkeys(r["traffic"] for r in runs):
        m = harness.medians([r for r in runs if r["traffic"] == traffic], "side", ["tok_s", "ttft_p50_ms"])
        print(f"  {traffic:24s} plain {m['plain']['tok_s']:7.1f} tok/s, ngram {m['ngram']['tok_s']:7.1f} tok/s "
              f"({harness.ratio(m['ngram']['tok_s'], m['plain']['tok_s']):.2f}x); TTFT p50 "
              f"{m['plain']['ttft_p50_ms']:.0f} / {m['ngram']['ttft_p50_ms']:.0f} ms")
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    harness.script(main)

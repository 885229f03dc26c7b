"""Ours against CTranslate2 (and Hugging Face PyTorch for prefill), side by side on the same weights.

Usage:
  # once: CTranslate2 and its converter in a virtualenv of their own, .venv-peers (torch first, alone: the CPU
  # build), ~30 s from the local wheel cache:
  bash benchmark/peers/setup_peers.sh
  #   = python3.11 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 \
  #       && .venv-peers/bin/pip install -r requirements-peers.txt
  # generation: float32 and int8, batch 1, 16 and 64, prompt 16, 64 new tokens, 3 runs a side
  .venv/bin/python benchmark/peers/benchmark_peers.py
  .venv/bin/python benchmark/peers/benchmark_peers.py --dtypes float32 --batch-sizes 1,16,64 --reps 3 --json peers.json
  # on a machine others use too: start each timed call once other processes use < 0.3 cores
  .venv/bin/python benchmark/peers/benchmark_peers.py --wait-quiet 0.3 --wait-max 60
  # prefill rate: one prompt of 512 and of 1024 tokens, 1 new token (time to first token), ours / CT2 / HF
  .venv/bin/python benchmark/peers/benchmark_peers.py --prefill 512,1024 --dtypes float32

What it does:
- Makes one Hugging Face OPT folder of random weights (the opt-125m shape by default; `--hf-dir` takes an existing
  one instead). The weights are drawn as `transformers` initialises OPT (normal(0, 0.02), zero biases, unit
  norms) and every 2-D weight is then multiplied by `--weight-scale` (3). As drawn (x1) greedy decoding of
  random prompts is degenerate: ~3 distinct tokens in 24, top-2 logit gaps ~0.13. Larger scales give varied
  text (x3: ~15 distinct tokens in 24) but past ~x4 the random network turns chaotic: a small error anywhere
  flips the output, and int8 weights alone (per-channel, fake-quantized in torch) kept the first greedy token of
  only 38% of rows at x8, against 94-100% at x1-x4. At x3 both engines' int8 keep the float32 first token in
  ~90% of rows (16 rows: ours 94%, CTranslate2 88%), so int8 agreement figures mean something. A word-level
  tokenizer of the vocabulary's size is saved beside the weights (CTranslate2's converter reads the vocabulary
  from it; no text is tokenized).
- Converts that folder twice: with CTranslate2's own converter (`ct2-transformers-converter --quantization
  float32|int8`) in the peer virtualenv, and with ours (`python -m opt_serving convert --dtype float32`).
  Everything lands in `--work-dir` and is reused by later runs (`--rebuild` to start over).
- Runs each side in a process of its own (ours in this interpreter's virtualenv, CTranslate2 in
  `--peer-python`'s, Hugging Face in this one with `torch.set_num_threads`), loaded once per dtype, driven over a
  pipe; every call is timed inside its process. For each batch size: `--warmup` untimed calls per side (ours
  compiles there), then `--reps` timed calls interleaved ABAB (ours, CTranslate2, ours, ...) so both see the same
  machine load, after `--pause` seconds of rest (and with `--wait-quiet`, once the machine is quiet). Prompts are
  seeded random ids (4..50264), the same on both sides, no padding. Each call also records the CPU time its side
  used and what every other process on the machine used meanwhile (/proc/stat), printed per call and summed up
  under the table: CTranslate2's figures fall several-fold when another process takes a core (its threads meet
  at a barrier in every operation), so a run that others disturbed shows it.
- Greedy, exactly `--gen-len` new tokens per row on both sides: ours with min_new_tokens = max_new_tokens,
  CTranslate2 with min_length = max_length = gen_len and include_prompt_in_result=False (so the prompt is
  forwarded at once and max_length counts new tokens only). Every output's shape is checked.
- CTranslate2: `Generator(path, device="cpu", compute_type=float32|int8, inter_threads=1,
  intra_threads=--threads)`. Ours uses every core this process may run on (its kernels and XLA's pool); --threads
  defaults to that count. int8 on our side is `get_model(..., quantize="int8")`; where this code has no such
  option the int8 rows say "ours int8: not available" and still show CTranslate2's figures.

Reported: tokens/s of each timed call (batch x gen_len / latency; prefill: prompt tokens / latency), the median
per side (calls during which other processes used more than `--disturbed` cores are starred and left out of
it), ours / CTranslate2 (and ours / HF for prefill) of the medians, and the share of generated tokens (same row,
same position) that agree: between the sides at the same dtype (with the same float32 weights ~100%), and for
int8 each side's against its own float32 output when float32 ran too (once a row diverges the rest of it mostly
differs, so this is close to the share of each row generated before its first difference).
CTranslate2 is a benchmark-only dependency: nothing in opt_serving imports it.

This file is the command line and the run; beside it: peers_build.py (the weights and both conversions),
peers_worker.py (the side processes, one file run alone in each side's interpreter), peers_sides.py (driving the
sides in turn) and peers_report.py (the header, the tables and the bandwidth bound).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving

from benchmark.peers.peers_build import REPO, check_peer_python, prepare  # noqa: E402
from benchmark.peers.peers_report import (_fmt, _ratio, bandwidth_lines, cpu_model, generation_table,  # noqa: E402
                                          header, prefill_table)
from benchmark.peers.peers_sides import (KEEP, SIDES, agreement, default_threads, make_prompts, measure,  # noqa: E402
                                         start_sides)

DEFAULT_PEER_PYTHON = REPO / ".venv-peers" / "bin" / "python"


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _dtypes(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in ("float32", "int8")]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--dtypes takes float32 and/or int8, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ours against CTranslate2 (and HF for --prefill) on the same weights",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hf-dir", help="an existing Hugging Face OPT folder (config.json, weights, tokenizer); "
                                    "default: build one of random weights in --work-dir")
    p.add_argument("--size", default="opt-125m", help="the shape of the random model to build")
    p.add_argument("--weight-scale", type=float, default=3.0,
                   help="multiply every 2-D random weight by this (varied greedy text; past ~4 the network "
                        "turns chaotic and int8 flips most tokens)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--work-dir", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "opt-serving-peers"),
                   help="where the built folder and the conversions are kept (reused by later runs)")
    p.add_argument("--rebuild", action="store_true", help="build and convert again even if --work-dir has them")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--dtypes", type=_dtypes, default=["float32", "int8"], help="float32 and/or int8")
    p.add_argument("--prefill", type=_ints, metavar="LENS",
                   help="prefill mode instead: one prompt of each length, 1 new token; ours, CTranslate2 and "
                        "Hugging Face PyTorch (float32 only)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per side and shape")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per side and shape first")
    p.add_argument("--pause", type=float, default=0.2,
                   help="seconds of rest before each call, so the other side's threads have gone idle")
    p.add_argument("--wait-quiet", type=float, metavar="CORES",
                   help="before each timed call, wait until other processes use less than CORES cores (measured "
                        "over 1 s; at most --wait-max seconds, then it goes on and says so): for a shared machine")
    p.add_argument("--wait-max", type=float, default=120.0, help="see --wait-quiet")
    p.add_argument("--disturbed", type=float, default=0.2, metavar="CORES",
                   help="a timed call during which other processes used more than CORES cores on average is "
                        "starred in the table and left out of the median (all of a side's calls, if every one is)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="CTranslate2's intra_threads, torch's threads, OPT_SERVING_CPU_THREADS for ours")
    p.add_argument("--peer-python", default=str(DEFAULT_PEER_PYTHON),
                   help="the interpreter that has ctranslate2 (and torch + transformers for its converter)")
    p.add_argument("--ours-python", default=sys.executable, help="the interpreter that has opt_serving's dependencies")
    p.add_argument("--ours-src", default=str(REPO),
                   help="the source tree whose opt_serving is measured (put first on PYTHONPATH), e.g. a built "
                        "`git archive` of another commit")
    p.add_argument("--ct2-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the CTranslate2 process (repeatable), e.g. CT2_FORCE_CPU_ISA=AVX512 or "
                        "CT2_USE_MKL=1; its defaults on this CPU are printed with its load line")
    p.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    args = p.parse_args(argv)
    args.dtypes = sorted(set(args.dtypes), key=["float32", "int8"].index)  # float32 first: int8's reference
    for name in ("prompt_len", "gen_len", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.pause < 0:
        p.error("--warmup and --pause must be >= 0")
    for kv in args.ct2_env:
        if "=" not in kv:
            p.error(f"--ct2-env takes KEY=VALUE, got {kv!r}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    check_peer_python(args.peer_python)
    paths = prepare(args)
    cfg = json.loads((Path(paths["hf"]) / "config.json").read_text())
    vocab_size = cfg["vocab_size"]
    longest = max(args.prefill) + 1 if args.prefill else args.prompt_len + args.gen_len
    if longest > cfg.get("max_position_embeddings", longest):
        raise SystemExit(f"prompt + new tokens ({longest}) exceed the model's {cfg['max_position_embeddings']} "
                         "positions")
    log_dir = Path(args.work_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows, infos = [], {}
    float32_out = {}  # (side, batch) -> new ids at float32: int8's reference
    kinds = ["ours", "ct2", "hf"] if args.prefill else ["ours", "ct2"]
    for dtype in args.dtypes:
        sides = start_sides([k for k in kinds if not (k == "hf" and dtype != "float32")], paths, dtype, args,
                            log_dir)
        infos.update({f"{k}-{dtype}": s.info for k, s in sides.items()})
        try:
            if args.prefill:
                for n in args.prefill:
                    ids = make_prompts(1, n, vocab_size, args.seed)
                    res = measure(sides, ids, 1, args, f"{dtype} prefill {n}", unit_tokens=n)
                    rows.append({"dtype": dtype, "prompt": n, **{k: {kk: v[kk] for kk in KEEP}
                                                                 for k, v in res.items()}})
            else:
                for b in args.batch_sizes:
                    ids = make_prompts(b, args.prompt_len, vocab_size, args.seed)
                    res = measure(sides, ids, args.gen_len, args, f"{dtype} batch {b}", unit_tokens=b * args.gen_len,
                                  bandwidth=b == 1)
                    row = {"dtype": dtype, "batch": b,
                           **{k: {kk: v[kk] for kk in KEEP} for k, v in res.items()}}
                    if "ours" in res and "ct2" in res:
                        row["agree"] = agreement(res["ours"]["out"], res["ct2"]["out"])
                    for k, v in res.items():
                        if dtype == "float32":
                            float32_out[k, b] = v["out"]
                        elif (k, b) in float32_out:
                            row.setdefault("vs_float32", {})[k] = agreement(v["out"], float32_out[k, b])
                    rows.append(row)
                    o, c = row.get("ours"), row.get("ct2")
                    vs = row.get("vs_float32", {})
                    print(f"{dtype} batch {b}: ours {_fmt(o and o['median'])}, CT2 {_fmt(c and c['median'])} "
                          f"tokens/s (median), ours / CT2 {_ratio(o and o['median'], c and c['median'])}"
                          + (f", tokens agree {row['agree']:.0%}" if "agree" in row else "")
                          + "".join(f", {SIDES[k]} against its float32 {x:.0%}" for k, x in vs.items()),
                          flush=True)
        finally:
            for s in sides.values():
                s.close()
    total = time.perf_counter() - t_start
    print()
    print(header(args, infos))
    if args.prefill:
        print("Prefill: one prompt, 1 new token (time to first token); prompt tokens / latency.")
        print()
        print(prefill_table(rows))
    else:
        print(f"Greedy, prompt {args.prompt_len}, exactly {args.gen_len} new tokens per row; tokens/s = batch x "
              f"{args.gen_len} / latency; ms/token = latency / {args.gen_len} steps.")
        print()
        print(generation_table(rows))
        for line in bandwidth_lines(rows, cfg, args.threads):
            print(line)
    others = [x for r in rows for k in SIDES if r.get(k) for x in r[k]["others_cores"] if x is not None]
    if others:
        starred = sum(x > args.disturbed for x in others)
        print(f"\nOther processes' CPU during the timed calls: median {statistics.median(others):.2f} cores, "
              f"max {max(others):.2f} (of {default_threads()}; per call in the log above)."
              + (f" * {starred} call(s) during which they used more than {args.disturbed:g} cores: left out of "
                 "the medians." if starred else ""))
    print(f"(whole run {total:.0f} s)")
    summary = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_model(), "args": {
        k: v for k, v in vars(args).items()}, "paths": paths,
        "sides": infos, "mode": "prefill" if args.prefill else "generation", "rows": rows, "total_s": total}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()

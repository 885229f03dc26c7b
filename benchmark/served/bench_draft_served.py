"""Served speculative decoding with a draft model (runner/draft.py) against the same server without it, the sides
taking turns (plain, draft, miss, miss, draft, plain, ...), each load through the OpenAI streaming route with
benchmark_serving.py's client, greedy, random prompts of 32 tokens and --tokens new tokens each (no EOS):

- the target: a random OPT (default OPT-1.3b) whose layers from the second on add nothing (their attention output
  and fc2 zero; offline/bench_speculative.py's AgreeingSource), so it computes what its first two layers and its
  head compute;
- draft: exactly those two layers and the head (same seed and names): every draft lands (full agreement);
- miss: two random layers of another seed and their head: next to no draft lands, so the rule must stop them;
- plain: no speculation.

Both sides serve the same target with --max-batch-size 16 (--max-seq-len 512: sixteen rows of OPT-1.3b's float32
KV fit beside its weights). Prints each side's output tokens/s, TTFT p50 and the drafts and kept drafts
(/metrics) at each of --streams, then each side / plain. The folders are written once (about 5.7 GB for OPT-1.3b).

    python benchmark/served/bench_draft_served.py --rounds 2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark import harness  # noqa: E402
from benchmark.common import machine_description, now  # noqa: E402
from benchmark.served.bench_spec_served import OPT_ASSETS, load  # noqa: E402

DRAFT_LAYERS = 2
SIDES = ("plain", "draft", "miss")


def write_folder(folder: Path, name: str, layers: int, seed: int, zero_from: int | None) -> Path:
    """A float32 numpy folder of random weights from `seed` (the first `layers` layers), the output projections
    of layers from `zero_from` on zero; kept for the next run (config.json last)."""
    if (folder / "config.json").exists():
        return folder
    from benchmark.offline.bench_speculative import LAYER
    from opt_serving.config import get_config
    from opt_serving.model import sources, weights
    cfg = get_config(name).replace(num_hidden_layers=layers)
    source = sources.RandomSource(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for key, shape in weights.param_shapes(cfg).items():
        m = LAYER.search(key)
        host = source.host(key, shape)
        weights.save_array(folder / key, host * 0 if m and zero_from is not None and int(m.group(1)) >= zero_from
                           else host)
    cfg.save_hf_json(folder)
    return folder


def server_args(model: str, target: Path, side: str, drafts: dict, k: int) -> list[str]:
    argv = ["--model", f"jax/{model}", "--path", str(target), "--tokenizer", str(OPT_ASSETS),
            "--max-batch-size", "16", "--max-seq-len", "512"]
    if side == "plain":
        return argv
    config = {"model": f"jax/{model}-draft", "path": str(drafts[side]), "num_speculative_tokens": k}
    return argv + ["--speculative-config", json.dumps(config)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", default="1,16", help="comma separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests a stream (at least 6 in all)")
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--folder", default="/tmp/opt-serving-draft", help="where the models' folders go")
    args = ap.parse_args()
    if not (OPT_ASSETS / "gpt2-vocab.json").exists():
        raise SystemExit(f"the OPT tokenizer is needed: {OPT_ASSETS}")
    from opt_serving.config import get_config
    root, layers = Path(args.folder), get_config(args.model).num_hidden_layers
    target = write_folder(root / f"{args.model}-agreeing", args.model, layers, 0, DRAFT_LAYERS)
    drafts = {"draft": write_folder(root / f"{args.model}-draft", args.model, DRAFT_LAYERS, 0, None),
              "miss": write_folder(root / f"{args.model}-miss", args.model, DRAFT_LAYERS, 1, None)}
    streams = [int(s) for s in args.streams.split(",")]
    sides = args.sides.split(",")
    print(f"{now()}  {machine_description()}\ntarget {args.model} float32 (its layers past {DRAFT_LAYERS} adding "
          f"nothing); draft: its first {DRAFT_LAYERS} layers and head; miss: {DRAFT_LAYERS} random layers; "
          f"num_speculative_tokens {args.k}; {args.tokens} new tokens a request, greedy; {args.rounds} rounds, "
          "the sides taking turns", flush=True)
    rng = np.random.default_rng(0)
    prompts = {s: [(rng.integers(4, 2000, 32).tolist(), args.tokens) for _ in range(max(6, args.requests * s))]
               for s in streams}
    runs = []
    for rnd, side in harness.in_turn(sides, args.rounds):
        log = root / f"{side}-{rnd}.log"
        with harness.serve(server_args(args.model, target, side, drafts, args.k), log=log) as server:
            for s in streams:
                row = load(server.url, prompts[s], s, ignore_eos=True)
                runs.append({"side": side, "streams": s, **row})
                print(f"round {rnd} {side:5s} {s:2d} streams {row['tok_s']:7.1f} tok/s  TTFT p50 "
                      f"{row['ttft_p50_ms']:6.0f} ms  drafts {row['drafts']:.0f}, drafted {row['draft_tokens']:.0f}, "
                      f"kept {row['accepted_tokens']:.0f}", flush=True)
    print("\nmedians (each side / plain):")
    for s in streams:
        m = harness.medians([r for r in runs if r["streams"] == s], "side", ["tok_s", "ttft_p50_ms"])
        kept = {side: sum(r["accepted_tokens"] for r in runs if r["side"] == side and r["streams"] == s)
                / max(1, sum(r["draft_tokens"] for r in runs if r["side"] == side and r["streams"] == s))
                for side in sides}
        print(f"  {s:2d} streams: " + "; ".join(
            f"{side} {m[side]['tok_s']:.1f} tok/s ({harness.ratio(m[side]['tok_s'], m['plain']['tok_s']):.2f}x, "
            f"TTFT p50 {m[side]['ttft_p50_ms']:.0f} ms, drafts kept {kept[side]:.0%})" for side in sides))
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    harness.script(main)

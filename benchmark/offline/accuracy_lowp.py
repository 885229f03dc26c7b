"""How far int8 weights and bfloat16 products move an OPT model from its float32 self, on the same weights.

Usage:
  .venv/bin/python benchmark/offline/accuracy_lowp.py                      # opt-125m shape, both formats
  .venv/bin/python benchmark/offline/accuracy_lowp.py --model jax/opt-350m --formats int8

Weights: random, of the named size: the layers as HF initialises OPT (std 0.02), the tied embedding x8 (std
0.16), so next-token distributions are peaked as a trained model's, not flat (with flat ones every argmax is a
near-tie and agreement means nothing). Every weight x8 (`--std 0.16`) peaks them too, but twelve such random
layers amplify any rounding (benchmark/README.md: top-1 agreement fell to 28% for int8, 55% for bfloat16). Text: this project's README.md through the real OPT tokenizer (../shared/opt-assets).

Reported per format, against float32 (the same params, the same kernels' float32 path):
- the largest logit error over every teacher-forced position of the text (absolute, and relative to the
  largest float32 logit);
- top-1 agreement over those positions;
- greedy agreement over generated tokens: prompts cut from the text, `--gen-len` tokens each; the share of
  positions equal, and the mean number of tokens before the first difference;
- the log-likelihood of the text per token under each, and their difference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving

from benchmark.common import machine_description  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="jax/opt-125m")
    p.add_argument("--formats", default="int8,bfloat16")
    p.add_argument("--std", type=float, default=0.02, help="std of the random layer weights (HF's init: 0.02)")
    p.add_argument("--embed-std", type=float, default=0.16,
                   help="std of the random tied embedding (0.16: peaked next-token distributions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=1024, help="text tokens scored (teacher forced)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "opt-assets"))
    return p.parse_args(argv)


def log_likelihood(logits: np.ndarray, ids: np.ndarray) -> float:
    """Mean log p(ids[t+1] | ids[:t+1]) over the sequence."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(lp[np.arange(len(ids) - 1), ids[1:]].mean())


def main(argv=None) -> dict:
    args = parse_args(argv)
    from opt_serving.config import get_config
    from opt_serving.model import param_tree, quantize
    from opt_serving.model.wrapper import OPTModel
    from opt_serving.runner.generate import Generation
    from opt_serving.text.tokenizer import load_tokenizer

    cfg = get_config(args.model)
    tok = load_tokenizer(args.tokenizer)
    ids = np.asarray(tok((ROOT / "README.md").read_text())["input_ids"][: args.tokens], np.int32)
    p32 = param_tree.init_params(cfg, args.seed, std=args.std)
    p32["embed_tokens"]["embedding"] = p32["embed_tokens"]["embedding"] * (args.embed_std / args.std)
    models = {"float32": Generation.of(OPTModel(cfg, p32))}
    for fmt in args.formats.split(","):
        models[fmt] = Generation.of(OPTModel(cfg, quantize.quantize_params(p32), weights="int8") if fmt == "int8"
                                    else OPTModel(cfg, p32, weights=fmt))
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(ids) - args.prompt_len, args.prompts)
    prompts = np.stack([ids[s:s + args.prompt_len] for s in starts])

    ref_logits = np.asarray(models["float32"](ids[None]))[0]  # [T, V]
    ref_gen = np.asarray(models["float32"].generate(prompts, max_new_tokens=args.gen_len,
                                                    min_new_tokens=args.gen_len))[:, args.prompt_len:]
    ll_ref = log_likelihood(ref_logits, ids)
    print(f"# {machine_description()}")
    print(f"# {args.model} random weights (layers std {args.std}, embedding std {args.embed_std}, seed "
          f"{args.seed}); {len(ids)} tokens of README.md "
          f"teacher forced; {args.prompts} prompts x {args.prompt_len} tokens, {args.gen_len} greedy tokens")
    top_p = 1.0 / np.exp(ref_logits - ref_logits.max(-1, keepdims=True)).sum(-1)  # softmax's largest entry
    print(f"# float32: log-likelihood {ll_ref:.4f} per token, mean top-1 probability {top_p.mean():.3f}")
    print("| weights | backend | max logit error | relative | top-1 agreement | greedy tokens equal | "
          "tokens before first difference | log-likelihood/token | difference |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    for fmt, m in models.items():
        if fmt == "float32":
            continue
        logits = np.asarray(m(ids[None]))[0]
        gen = np.asarray(m.generate(prompts, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len))
        gen = gen[:, args.prompt_len:]
        same = gen == ref_gen
        first = np.where(same.all(1), args.gen_len, np.argmin(same, axis=1))
        err = float(np.abs(logits - ref_logits).max())
        r = dict(max_err=err, rel_err=err / float(np.abs(ref_logits).max()),
                 top1=float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
                 greedy=float(same.mean()), first_diff=float(first.mean()),
                 ll=log_likelihood(logits, ids))
        results[fmt] = r
        be = m.backend
        print(f"| {fmt} | {'packed' if be.products else 'XLA'} | {r['max_err']:.3f} | {100 * r['rel_err']:.2f}% | "
              f"{100 * r['top1']:.1f}% | {100 * r['greedy']:.1f}% | {r['first_diff']:.1f} of {args.gen_len} | "
              f"{r['ll']:.4f} | {r['ll'] - ll_ref:+.4f} |")
    return results


if __name__ == "__main__":
    main()

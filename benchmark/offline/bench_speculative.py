"""Speculative decoding at batch 1 (runner/speculative.py): generate() with and without a draft, on draft/target
pairs whose agreement is known by construction, since random weights make acceptance meaningless otherwise.

The target is a random OPT (default OPT-1.3b) whose layers from `--draft-layers` on add nothing (their attention
output and fc2 projections zero): it computes what its first layers and its head compute. The draft is exactly
that: those first layers (same seed, same names, so the same numbers) and the head. So they always agree. The
"perturbed" targets add random output projections of scale `--perturb` to those layers, so the target's tokens
drift from the draft's: the acceptance printed beside each row is measured, not assumed. Prompt lookup runs on
a target built to copy (no attention output, no position embeddings: its next token is a function of the current
one) with a copy-heavy prompt, its own earlier output followed by the prompt that led to it, so that what comes
next is already in the text, as in an edit, an extraction or a quoting summary.
`--pp 2` runs the full-agreement target as a pipeline of two stages on two simulated Ray nodes.

    python benchmark/offline/bench_speculative.py                       # OPT-1.3b float32 and int8, k = 4
    python benchmark/offline/bench_speculative.py --model opt-125m --tokens 32 --weights float32
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving

from opt_serving.model import loader, sources  # noqa: E402
from opt_serving.config import get_config  # noqa: E402
from opt_serving.runner.generate import Generation  # noqa: E402

LAYER = re.compile(r"decoder\.layers\.(\d+)\.(self_attn\.out_proj|fc2)\.weight$")


class AgreeingSource(sources.RandomSource):
    """RandomSource's weights, with the output projections of every layer from `keep` on scaled by `scale`
    (0: those layers add nothing)."""

    def __init__(self, seed: int, keep: int, scale: float):
        super().__init__(seed)
        self.keep, self.scale = keep, scale

    def _factor(self, name: str):
        m = LAYER.search(name)
        return self.scale if m and int(m.group(1)) >= self.keep else None

    def place(self, name, shape, sharding, dtype):
        out = super().place(name, shape, sharding, dtype)
        f = self._factor(name)
        return out if f is None else out * np.asarray(f, out.dtype)

    def int8(self, name, shape):
        q, s = super().int8(name, shape)
        f = self._factor(name)
        return (q, s) if f is None else (q, s * np.float32(f))


class CopyingSource(sources.RandomSource):
    """A target built to copy: no attention output and no position embeddings, so its next token is a function of
    the current token alone, and a text it has produced once it produces again from the same token on."""

    def place(self, name, shape, sharding, dtype):
        out = super().place(name, shape, sharding, dtype)
        copying = "embed_positions" in name or name.endswith("self_attn.out_proj.weight")
        return out * np.asarray(0.0, out.dtype) if copying else out

    def int8(self, name, shape):
        q, s = super().int8(name, shape)
        return (q, s * np.float32(0.0)) if name.endswith("self_attn.out_proj.weight") else (q, s)


def build(name: str, layers: int | None, source, weights: str) -> Generation:
    cfg = get_config(name)
    if layers is not None:
        cfg = cfg.replace(num_hidden_layers=layers)
    quantize = "int8" if weights == "int8" else None
    dtype, fmt = loader._weights_format(loader.model_dtype("float32"), quantize)
    return Generation.of(loader.load_model(cfg, source, dtype, quantize, fmt))


def save_agreeing_folder(folder: Path, name: str, seed: int, keep: int) -> Path:
    """AgreeingSource(seed, keep, 0)'s target as a float32 numpy folder (a pipeline's stages read it on their
    nodes), config.json last; kept for the next run."""
    from opt_serving.model import weights
    cfg = get_config(name)
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    source = AgreeingSource(seed, keep, 0.0)
    for key, shape in weights.param_shapes(cfg).items():
        host = source.host(key, shape)
        weights.save_array(folder / key, host * 0 if source._factor(key) is not None else host)
    cfg.save_hf_json(folder)
    return folder


def pipelined(args, ids) -> None:
    """The full-agreement target as a pipeline of `--pp` stages on as many simulated Ray nodes, the draft local."""
    from opt_serving.models import get_model
    from opt_serving.testing.ray_cluster import simulated_cluster
    folder = save_agreeing_folder(Path(args.folder), args.model, args.seed, args.draft_layers)
    draft = build(args.model, args.draft_layers, sources.RandomSource(args.seed), "float32")
    with simulated_cluster(nodes=args.pp, cpus_per_node=2):
        target = get_model(f"alpa/{args.model}", folder, pipeline_parallel=args.pp, tensor_parallel=1)
        try:
            runs = {"plain": lambda: target.generate(ids, max_new_tokens=args.tokens),
                    "draft": lambda: target.generate(ids, max_new_tokens=args.tokens, assistant_model=draft,
                                                     num_assistant_tokens=args.k)}
            report(args, target, runs, ids, f"float32 pp={args.pp}", "full agreement")
        finally:
            target.close()


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def report(args, target, runs: dict, ids, weights: str, label: str) -> None:
    """Each way of generating, taking turns, `args.rounds` times: tokens/s against plain decoding."""
    for fn in runs.values():  # compile
        fn()
    times = {n: [] for n in runs}
    stats, outs = {}, {}
    for _ in range(args.rounds):
        for n, fn in runs.items():
            outs[n], dt = timed(fn)
            times[n].append(dt)
            stats[n] = target.last_speculation if n != "plain" else None
    base = float(np.median(times["plain"]))
    for n in runs:
        t = float(np.median(times[n]))
        new = outs[n].shape[1] - ids.shape[1]
        same = "same tokens" if np.array_equal(outs[n], outs["plain"]) else "TOKENS DIFFER"
        st = stats[n]
        extra = "" if st is None else (f", accepted {st.acceptance_rate:.0%} of {st.drafted} drafts, "
                                       f"{st.mean_acceptance_length:.2f} tokens/round, "
                                       f"{st.plain_rounds}/{st.rounds} rounds plain, {same}")
        print(f"  {weights:13s} {label:18s} {n:18s} {new / t:7.2f} tok/s  {base / t:5.2f}x{extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--weights", default="float32,int8", help="comma-separated: float32, int8")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--perturb", default="0.01,1.0", help="output-projection scales of the perturbed targets")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pp", type=int, default=0, help="a pipeline of this many stages on simulated Ray nodes instead")
    ap.add_argument("--folder", default="/tmp/opt-serving-speculative", help="--pp: where the target's folder goes")
    args = ap.parse_args()
    ids = np.random.default_rng(args.seed).integers(4, 2000, (1, args.prompt))
    if args.pp:
        return pipelined(args, ids)
    print(f"{args.model}, batch 1, prompt {args.prompt}, {args.tokens} new tokens, k = {args.k}, greedy; "
          f"draft: its first {args.draft_layers} layers and head; median of {args.rounds} rounds, alternating")
    for weights in args.weights.split(","):
        draft = build(args.model, args.draft_layers, sources.RandomSource(args.seed), weights)
        cases = [("full agreement", 0.0)] + [(f"perturbed {p}", float(p)) for p in args.perturb.split(",") if p]
        for label, scale in cases:
            target = build(args.model, None, AgreeingSource(args.seed, args.draft_layers, scale), weights)
            runs = {"plain": lambda: target.generate(ids, max_new_tokens=args.tokens),
                    "draft": lambda: target.generate(ids, max_new_tokens=args.tokens, assistant_model=draft,
                                                     num_assistant_tokens=args.k),
                    "draft, constant k": lambda: target.generate(ids, max_new_tokens=args.tokens,
                                                                 assistant_model=draft, num_assistant_tokens=args.k,
                                                                 num_assistant_tokens_schedule="constant")}
            report(args, target, runs, ids, weights, label)
            target.close()
            del target
        # a copy-heavy request: the prompt already holds the text its continuation repeats
        target = build(args.model, None, CopyingSource(args.seed), weights)
        said = np.asarray(target.generate(ids, max_new_tokens=args.tokens))
        copy = np.concatenate([said, ids], 1)
        report(args, target, {
            "plain": lambda: target.generate(copy, max_new_tokens=args.tokens),
            "prompt lookup": lambda: target.generate(copy, max_new_tokens=args.tokens,
                                                     prompt_lookup_num_tokens=args.k)},
            copy, weights, "copy-heavy prompt")
        target.close()
        del target


if __name__ == "__main__":
    main()

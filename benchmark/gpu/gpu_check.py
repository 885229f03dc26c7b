"""The prepared GPU check: our numbers and speed against Hugging Face torch on the same card, one section a process.

`benchmark/gpu_check.sh` runs the sections in order under one deadline and prints the report; each section can
also run alone:

  python benchmark/gpu/gpu_check.py env                         the card and the versions
  python benchmark/gpu/gpu_check.py tiny                        tiny models (pre-LN and OPT-350m's post-LN shape),
      float32: generate()'s greedy and beam tokens equal HF's, the engine's greedy tokens equal generate()'s
  python benchmark/gpu/gpu_check.py model --size 1.3b --dtype float16
      random weights drawn once by torch and shared with JAX: logits of both against torch's float32 logits,
      tokens/s of HF generate() (SDPA), our generate() and our continuous-batching engine at each --batches,
      and the card's memory against the planner's estimate
  python benchmark/gpu/gpu_check.py compile --size 1.3b --dtype float16   HF generate() with a static cache under
      torch.compile, where it works
  python benchmark/gpu/gpu_check.py report                      the table of every result in --out

Every measurement is one JSON line appended to --out the moment it is taken, so a section stopped by the deadline
(--deadline, seconds since the epoch) keeps what it measured. The same script runs on a CPU (rehearsal: small
sizes, few tokens), so a GPU's short lease is spent measuring.

This file is the command line, the deadline and the output; the sections are in gpu_check_sections.py, the
report in gpu_check_report.py, and what they share (the same weights on both sides, the engine's drivers, compile
counts, memory) in gpu_check_tools.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving

from benchmark.gpu.gpu_check_report import section_report  # noqa: E402
from benchmark.gpu.gpu_check_sections import section_compile, section_env, section_model, section_tiny  # noqa: E402


class Deadline(Exception):
    """The section's time is up: what it measured so far stays in --out."""


class Run:
    """The section's output file, its deadline and what every row says of where it ran."""

    def __init__(self, args):
        self.out, self.deadline, self.args = Path(args.out), args.deadline, args
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time() if self.deadline else float("inf")

    def check(self, need_s: float = 0.0, what: str = "") -> None:
        if self.left() < need_s:
            raise Deadline(f"{what}: {self.left():.0f} s left, {need_s:.0f} s needed")

    def write(self, **row) -> None:
        row = {"time": round(time.time(), 1), **row}
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print("  " + json.dumps(row), flush=True)


SECTIONS = {"env": section_env, "tiny": section_tiny, "model": section_model, "compile": section_compile,
            "report": section_report}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("section", choices=list(SECTIONS))
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "gpu_check.jsonl"))
    p.add_argument("--deadline", type=float, default=0.0, help="seconds since the epoch; 0: none")
    p.add_argument("--size", default="1.3b")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--logit-len", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="model: int8 weights (model/quantize.py) beside activations in --dtype")
    p.add_argument("--ttft-batch", type=int, default=64, help="model: prompts of the TTFT wave (0: none)")
    p.add_argument("--ttft-prompt-len", type=int, default=512)
    p.add_argument("--ttft-new-tokens", type=int, default=16)
    p.add_argument("--hf-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                   help="model: HF eager generate()'s batches (default --batches; empty: none)")
    p.add_argument("--engine-steps", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="model: the engine's decode steps a call, each measured (default: the engine's default)")
    p.add_argument("--engine-ahead", action="store_true",
                   help="model: the engine sends each call before the one in flight is read (Engine(ahead=True))")
    p.add_argument("--parts", type=lambda s: set(s.split(",")), default={"engine", "generate", "ttft", "hf"},
                   help="model: what it times after the logits (engine, generate, ttft, hf; default all)")
    p.add_argument("--variant", default="", help="model: a name written into every row (engine_variants.sh)")
    p.add_argument("--profile", default="", help="model: a folder for JAX profiler traces of one engine run a batch")
    p.add_argument("--copy-mib", type=int, default=2048, help="the copy bandwidth probe's array (MiB)")
    p.add_argument("--reps", type=int, default=1, help="timed runs after the first (compiling) one")
    p.add_argument("--engine-reps", type=int, default=2, help="the engine's timed runs after the first")
    args = p.parse_args(argv)
    run = Run(args)
    try:
        SECTIONS[args.section](run)
    except Deadline as e:
        run.write(section=args.section, check="stopped", what=f"{args.section} {args.size} {args.dtype}"
                  f"{'+' + args.quantize if args.quantize else ''}: {e}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

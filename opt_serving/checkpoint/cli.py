"""`opt-serving convert`: metaseq / Hugging Face checkpoints -> the per-layer numpy folder."""
from __future__ import annotations

import argparse
import sys

from opt_serving.checkpoint.formats import FORMATS, CheckpointError
from opt_serving.errors import MissingExtra, require

DTYPES = ("float16", "float32", "bfloat16")  # checkpoint/writer.py's, which needs torch to import


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True,
                        help="a checkpoint file, a folder, or a quoted glob such as "
                             "'ckpt/checkpoint_last-model_part-*-shard*.pt'")
    parser.add_argument("--output", required=True, help="the numpy folder to create")
    parser.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    parser.add_argument("--dtype", default="float16", choices=DTYPES)
    parser.add_argument("--md5", metavar="CSV", help="verify every input first ('shard,md5sum' CSV)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="copy tokenizer files (vocab.json/merges.txt or gpt2-vocab.json/gpt2-merges.txt)")
    parser.add_argument("--config", help="preset name (e.g. 175b) or config.json, where the checkpoint "
                                         "lacks a usable cfg")
    parser.add_argument("--quantize", choices=("int8",), default=None,
                        help="store every weight matrix as int8 with a scale per output channel "
                             "(a quarter of float32's bytes; the model loads them as they are)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:  # checkpoints are read (and written) through torch: an optional extra, imported only to convert
        require("torch", "torch", "opt-serving convert")
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from opt_serving.checkpoint.convert import convert
    try:
        convert(args.input, args.output, format=args.format, dtype=args.dtype, md5_csv=args.md5,
                tokenizer=args.tokenizer, config=args.config, overwrite=args.overwrite, quantize=args.quantize,
                log=lambda msg: print(msg, file=sys.stderr), progress=not args.no_progress)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0

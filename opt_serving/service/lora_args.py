"""The `serve` command's LoRA flags, vLLM's names (model/lora_config.py says what they become):

    --enable-lora                     serve LoRA adapters (implied by the two below)
    --lora-modules NAME=PATH ...      PEFT adapter folders served from the start (or JSON {"name", "path"})
    --max-loras N                     adapters on the device at once (default: as many as --lora-modules, >= 1);
                                      more are kept on the host and take a slot, least recently used first
    --max-lora-rank R                 the largest adapter rank served (default 16)
    --lora-target-modules M ...       the layers adapters may target (default: those of --lora-modules, or all)
    --enable-lora-runtime-updates     /v1/load_lora_adapter and /v1/unload_lora_adapter answer (vLLM's
                                      VLLM_ALLOW_RUNTIME_LORA_UPDATING; an explicit flag here, the environment
                                      variable is not read)
"""
from __future__ import annotations

import argparse
import os

from opt_serving.model.lora_config import LoraOptions, parse_module
from opt_serving.model.peft import TARGETS, targets_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters, each a model a request may name (implied by --lora-modules)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapter folders served from the start, as vLLM's flag: name=path, or JSON "
                        '{"name": ..., "path": ...}')
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapters on the device at once, each step computing for all (default: as many as "
                        "--lora-modules, at least 1); others wait on the host, least recently used evicted")
    p.add_argument("--max-lora-rank", type=int, default=16, metavar="R", help="the largest adapter rank (default 16)")
    p.add_argument("--lora-target-modules", nargs="+", default=None, choices=TARGETS, metavar="MODULE",
                   help=f"the layers adapters may target, of {', '.join(TARGETS)} (default: those of "
                        "--lora-modules, or all of them)")
    p.add_argument("--enable-lora-runtime-updates", action="store_true",
                   help="answer /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING, as a flag)")


def serve_args(args: argparse.Namespace) -> dict:
    """The flags as ServeArgs fields (adapter folders absolute: the replica reading them is another process)."""
    modules = []
    for spec in args.lora_modules:
        name, path = parse_module(spec)
        modules.append(f"{name}={os.path.abspath(path)}")
    return dict(enable_lora=args.enable_lora, lora_modules=modules, max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, lora_target_modules=args.lora_target_modules,
                enable_lora_runtime_updates=args.enable_lora_runtime_updates)


def options(enable: bool, modules, max_loras, max_lora_rank: int, targets, runtime_updates: bool):
    """ServeArgs' LoRA fields -> LoraOptions (None: no adapters served); ValueError naming the flag at fault."""
    modules = modules.split(",") if isinstance(modules, str) else list(modules or [])
    parsed = tuple(parse_module(m) for m in modules if m.strip())
    if not (enable or parsed or runtime_updates):
        return None
    if max_loras is not None and max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
    if max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be at least 1, got {max_lora_rank}")
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name given twice ({', '.join(names)})")
    for name, path in parsed:
        if not os.path.isdir(path):
            raise ValueError(f"--lora-modules {name}={path}: no such folder")
        targets_of(path)  # a folder with no PEFT weights fails here, before Ray starts
    targets = targets.split(",") if isinstance(targets, str) else targets
    return LoraOptions(parsed, max_loras, max_lora_rank, tuple(targets) if targets else None)

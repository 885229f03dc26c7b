"""`opt-serving` (also `python -m opt_serving`): one command, several subcommands.

Each subcommand lives in its own module with `add_arguments(parser)` and
`run(args) -> int`; only the chosen one is imported, so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from opt_serving import jax_env

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("opt_serving.checkpoint.cli",
                "convert metaseq / Hugging Face checkpoints into the per-layer numpy folder"),
    "plan": ("opt_serving.parallel.cli",
             "derive (or dry-run) the data x pipeline x tensor parallel plan for a model and cluster"),
    "serve": ("opt_serving.service.cli",
              "start the HTTP server (Ray Serve) for a model"),
    "batch": ("opt_serving.batch",
              "run an OpenAI-format jsonl file of requests offline, resumably"),
    "tiny": ("opt_serving.model.embedded",
             "write (once) the embedded tiny random-weight OPT and print its folder"),
}
# the commands that run a model in this process; the others plan, convert or route (the model of `serve` runs in
# its replicas) and take no GPU memory ahead
RUN_MODEL_HERE = {"batch"}


def build_parser(chosen: str | None) -> tuple[argparse.ArgumentParser, object | None]:
    parser = argparse.ArgumentParser(
        prog="opt-serving",
        description="Serve Meta's OPT language models on JAX/Flax, parallelised over Ray.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    if chosen not in RUN_MODEL_HERE:
        jax_env.apply(jax_env.route_only())
    parser, module = build_parser(chosen)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        return 0 if not argv else 2
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

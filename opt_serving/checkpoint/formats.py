"""Which checkpoint format an input is, and which files belong to it.

Four formats reach the converter:
  metaseq-fsdp       raw training shards `<prefix>-model_part-{p}-shard{s}.pt` (OPT-175B: 8 x 124 files)
  metaseq-mp-parts   unflattened model-parallel parts `reshard-model_part-{p}.pt` (fused qkv per part)
  metaseq-singleton  one unflattened file, e.g. Alpa's `restored.pt` (separate q/k/v)
  hf                 a Hugging Face `save_pretrained` folder (safetensors or pytorch_model.bin)
Shard numbers are compared as integers: lexical order puts shard10 before shard2.
"""
from __future__ import annotations

import dataclasses
import glob as globlib
import re
from pathlib import Path

FORMATS = ("metaseq-fsdp", "metaseq-mp-parts", "metaseq-singleton", "hf")

# `-model_part-{p}` is absent when a model was trained without tensor parallelism
FSDP_SHARD_RE = re.compile(r"^(?P<prefix>.+?)(?:-model_part-(?P<part>\d+))?-shard(?P<shard>\d+)\.pt$")
MP_PART_RE = re.compile(r"^(?P<prefix>.+?)-model_part-(?P<part>\d+)\.pt$")
HF_WEIGHT_GLOBS = ("model.safetensors", "model-*-of-*.safetensors",
                   "pytorch_model.bin", "pytorch_model-*-of-*.bin")


class CheckpointError(Exception):
    """A bad input: the message names the file and what is wrong with it."""


@dataclasses.dataclass
class Detected:
    format: str
    # files[p][s]: the shard s of model-parallel part p (one shard per part for unflattened
    # formats; for hf, files[0] lists the weight files)
    files: list[list[Path]]
    root: Path

    @property
    def all_files(self) -> list[Path]:
        return [f for part in self.files for f in part]

    def describe(self) -> str:
        n = len(self.all_files)
        if self.format == "metaseq-fsdp":
            return (f"metaseq-fsdp: {len(self.files)} model-parallel part(s) x {len(self.files[0])} "
                    f"FSDP shard(s) = {n} files in {self.root}")
        if self.format == "metaseq-mp-parts":
            return f"metaseq-mp-parts: {len(self.files)} model-parallel part(s) in {self.root}"
        if self.format == "metaseq-singleton":
            return f"metaseq-singleton: {self.files[0][0]}"
        return f"hf: Hugging Face folder {self.root} ({', '.join(f.name for f in self.files[0])})"


def parse_shard_name(name: str) -> tuple[str, int, int] | None:
    """'checkpoint_last-model_part-3-shard12.pt' -> ('checkpoint_last', 3, 12); None if not a shard."""
    m = FSDP_SHARD_RE.match(Path(name).name)
    if m is None:
        return None
    return m["prefix"], int(m["part"] or 0), int(m["shard"])


def group_shards(paths: list[Path]) -> list[list[Path]]:
    """Sort FSDP shard files into [part][shard] numerically, insisting on a complete grid."""
    grid: dict[int, dict[int, Path]] = {}
    prefixes = set()
    for path in paths:
        parsed = parse_shard_name(path.name)
        if parsed is None:
            raise CheckpointError(f"{path}: not an FSDP shard name (<prefix>-model_part-P-shardS.pt)")
        prefix, p, s = parsed
        prefixes.add(prefix)
        grid.setdefault(p, {})[s] = path
    if len(prefixes) > 1:
        raise CheckpointError(f"shards of several checkpoints mixed together ({sorted(prefixes)}); "
                              f"pass a glob that selects one, e.g. '{sorted(prefixes)[0]}-*.pt'")
    folder = paths[0].parent
    prefix = prefixes.pop()
    num_parts = max(grid) + 1
    num_shards = max(max(shards) for shards in grid.values()) + 1
    for p in range(num_parts):
        for s in range(num_shards):
            if s not in grid.get(p, {}):
                name = (f"{prefix}-model_part-{p}-shard{s}.pt" if num_parts > 1 or p > 0
                        else f"{prefix}-shard{s}.pt")
                raise CheckpointError(f"missing shard {folder / name}: found {num_parts} part(s) with "
                                      f"up to {num_shards} shards each")
    return [[grid[p][s] for s in range(num_shards)] for p in range(num_parts)]


def group_parts(paths: list[Path]) -> list[list[Path]]:
    parts: dict[int, Path] = {}
    for path in paths:
        m = MP_PART_RE.match(path.name)
        if m is None:
            raise CheckpointError(f"{path}: not a model-parallel part name (<prefix>-model_part-P.pt)")
        parts[int(m["part"])] = path
    for p in range(max(parts) + 1):
        if p not in parts:
            raise CheckpointError(f"missing model-parallel part {p}: "
                                  f"no *-model_part-{p}.pt beside {paths[0]}")
    return [[parts[p]] for p in range(len(parts))]


def _expand(input_: str) -> tuple[Path, list[Path]]:
    path = Path(input_)
    if path.is_dir():
        return path, sorted(p for p in path.iterdir() if p.is_file())
    if path.is_file():
        return path.parent, [path]
    matches = sorted(Path(m) for m in globlib.glob(input_) if Path(m).is_file())
    if not matches:
        raise CheckpointError(f"no checkpoint files at {input_}")
    return matches[0].parent, matches


def _hf_weight_files(folder: Path) -> list[Path]:
    for pattern in HF_WEIGHT_GLOBS:
        found = sorted(folder.glob(pattern))
        if found:
            return found
    return []


def detect(input_: str, fmt: str = "auto") -> Detected:
    """Find the checkpoint format and its files; `fmt` other than 'auto' insists on one."""
    if fmt != "auto" and fmt not in FORMATS:
        raise CheckpointError(f"unknown format {fmt!r}; choose auto or one of {', '.join(FORMATS)}")
    root, files = _expand(input_)
    if fmt in ("auto", "hf") and Path(input_).is_dir():
        weights = _hf_weight_files(root)
        if weights and (root / "config.json").exists():
            return Detected("hf", [weights], root)
        if fmt == "hf":
            raise CheckpointError(f"{root}: not a Hugging Face folder (needs config.json and "
                                  f"model.safetensors or pytorch_model.bin)")
    pt = [f for f in files if f.suffix == ".pt"]
    shards = [f for f in pt if parse_shard_name(f.name)]
    parts = [f for f in pt if MP_PART_RE.match(f.name) and not parse_shard_name(f.name)]
    if fmt == "metaseq-fsdp" or (fmt == "auto" and shards):
        if not shards:
            raise CheckpointError(f"no FSDP shard files (*-shardN.pt) at {input_}")
        return Detected("metaseq-fsdp", group_shards(shards), root)
    if fmt == "metaseq-mp-parts" or (fmt == "auto" and len(parts) > 1):
        if not parts:
            raise CheckpointError(f"no model-parallel part files (*-model_part-N.pt) at {input_}")
        return Detected("metaseq-mp-parts", group_parts(parts), root)
    if fmt == "metaseq-singleton" or (fmt == "auto" and len(pt) == 1):
        if len(pt) != 1:
            raise CheckpointError(f"a singleton checkpoint is one .pt file; found {len(pt)} at {input_}")
        return Detected("metaseq-singleton", [pt], root)
    raise CheckpointError(f"could not tell the checkpoint format of {input_} "
                          f"({len(files)} file(s), {len(pt)} .pt); pass --format")

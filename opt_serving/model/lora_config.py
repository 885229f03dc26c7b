"""What a served model holds for LoRA adapters, in plain values (no JAX: the `serve` command parses and checks its
flags with these before a replica loads the model): `LoraOptions` (the command line's: the adapters served from
the start and the slots, vLLM's names), `LoraConfig` (the slots every stage makes) and `LoraLayout` (one stage's).
model/lora.py holds the transform, runner/lora.py the registry."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

import numpy as np

from opt_serving.model.peft import TARGETS, AdapterError, LoraAdapter, targets_of


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What a served model holds for adapters: `max_loras` of them on the device at once, each of rank up to
    `max_lora_rank` (vLLM's --max-loras, --max-lora-rank), on the decoder layers `targets`. Every step computes
    max_loras x max_lora_rank columns on each target, so the targets are the union of the adapters' own."""
    max_loras: int = 1
    max_lora_rank: int = 16
    targets: tuple[str, ...] = TARGETS

    def layout(self, start: int, stop: int, fused: bool, dtype) -> "LoraLayout":
        """The layout of a stage holding the model's layers [start, stop)."""
        targets = tuple(t for t in TARGETS if t in self.targets)
        return LoraLayout(self.max_loras, self.max_lora_rank, targets, start, stop, fused,
                          np.dtype(dtype).name)


@dataclasses.dataclass(frozen=True)
class LoraLayout:
    """How a stage holds adapters: `slots` of them, of rank up to `rank`, on `targets`, for the model's layers
    [start, stop) (numbered from 0 in the stage's tree, as its params are); `fused`: its q/k/v are one qkv_proj;
    `dtype`: its activations' (the adapters run in it)."""
    slots: int
    rank: int
    targets: tuple[str, ...]
    start: int
    stop: int
    fused: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"LoRA targets must be some of {', '.join(TARGETS)}, got {list(self.targets)}")
        if self.slots < 1 or self.rank < 1:
            raise ValueError(f"LoRA needs at least one slot of rank >= 1, got {self.slots} of rank {self.rank}")

    def check(self, adapter: LoraAdapter) -> None:
        """AdapterError where the adapter does not fit these slots (its rank, its targets)."""
        if adapter.rank > self.rank:
            raise AdapterError(f"LoRA adapter {adapter.path}: rank {adapter.rank} is above the largest rank the "
                               f"server holds, {self.rank} (--max-lora-rank)")
        extra = [t for t in adapter.targets if t not in self.targets]
        if extra:
            raise AdapterError(f"LoRA adapter {adapter.path}: targets {', '.join(extra)}, which this server's "
                               f"adapters do not cover ({', '.join(self.targets)}; --lora-target-modules)")



@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """A served model's LoRA adapters as the command line gives them (vLLM's names): `modules` (name, folder)
    served from the start, `max_loras` on the device at once (default: as many as `modules`, at least one),
    each of rank up to `max_lora_rank`, on `targets` (default: every target of `modules`, or every decoder
    linear layer where none is given)."""
    modules: tuple = ()
    max_loras: Optional[int] = None
    max_lora_rank: int = 16
    targets: Optional[tuple[str, ...]] = None

    def config(self) -> LoraConfig:
        targets = self.targets
        if not targets:
            found = {t for _, path in self.modules for t in targets_of(path)}
            targets = tuple(t for t in TARGETS if t in found) or TARGETS
        return LoraConfig(self.max_loras or max(1, len(self.modules)), self.max_lora_rank, tuple(targets))


def parse_module(spec: str) -> tuple[str, str]:
    """vLLM's --lora-modules entry: `name=path`, or JSON `{"name": ..., "path": ...}` -> (name, path)."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            d = json.loads(spec)
            return str(d["name"]), str(d["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--lora-modules {spec!r}: a JSON entry needs \"name\" and \"path\"") from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: give name=path (or JSON with name and path)")
    return name, path

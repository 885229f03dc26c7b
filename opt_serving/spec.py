"""A model's identity, parsed once where a user's name and options come in (get_model, `serve`, `batch`, the
Serve deployment): `ModelSpec`. Below that edge nothing reads a name's prefix; it asks the spec.

    jax/opt-125m        the Flax model on one device (or the engine's one-device runner)
    facebook/opt-125m   Hugging Face's PyTorch OPTForCausalLM in get_model() (the reference); the engine runs
                        its weights on the Flax model, as jax/ (`for_engine`)
    alpa/opt-125m       the planner's plan over the Ray cluster or this process's devices: a tensor-parallel
                        mesh here, or pipeline stages as Ray actors
The part after the prefix is a preset size (config.OPT_CONFIGS: opt-125m, opt-iml-max-30b, ...) or, with a
folder that has a config.json, any label ("jax/my-finetune").
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from opt_serving.config import size_from_name

JAX, TORCH, PARALLEL = "jax", "torch", "parallel"
BACKENDS = {"jax/": JAX, "facebook/": TORCH, "alpa/": PARALLEL}
PREFIXES = tuple(BACKENDS)
# names that mean the embedded tiny model where no weights folder is given (model/embedded.py builds it)
EMBEDDED_NAMES = ("opt-tiny", "tiny", "jax/opt-tiny")
EMBEDDED = "jax/opt-tiny"


@dataclasses.dataclass(frozen=True)
class Weights:
    """Where a model's weights come from: a folder (numpy, or for facebook/ a Hugging Face one; a parent
    holding `<size>-np/` works too), or random weights drawn from `seed` (`dummy`)."""
    folder: Optional[Path] = None
    seed: Optional[int] = None

    @property
    def random(self) -> bool:
        return self.seed is not None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """family/size, backend, the plan asked for and the weights source of one model (see the module docstring).
    `size` is None where the name is only a label for a folder's config.json."""
    name: str
    backend: str
    size: Optional[str]
    weights: Weights
    tensor_parallel: Optional[int] = None
    pipeline_parallel: Optional[int] = None
    quantize: Optional[str] = None
    family: str = "opt"

    @classmethod
    def parse(cls, name: str, path=None, dummy: bool = False, seed: int = 0, tensor_parallel: Optional[int] = None,
              pipeline_parallel: Optional[int] = None, quantize: Optional[str] = None) -> "ModelSpec":
        """The spec of `name` with its options; ValueError naming what does not go together."""
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"unknown model {name!r}: the name must start with one of "
                             f"{', '.join(PREFIXES)} (e.g. 'jax/opt-125m')")
        backend = BACKENDS[prefix]
        try:  # unknown sizes fail here, naming the known ones (a folder's config.json wins)
            size = size_from_name(name)
        except ValueError as e:
            if path is None:
                raise
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"{e}; any name works with a folder that has a config.json, and {path} has "
                                 "none") from None
            size = None
        if backend != PARALLEL and (tensor_parallel not in (None, 1) or pipeline_parallel not in (None, 1)):
            raise ValueError(f"{name} runs on one device; use alpa/ for parallelism")
        weights = Weights(seed=int(seed)) if dummy else Weights(folder=None if path is None else Path(path))
        return cls(name, backend, size, weights, tensor_parallel, pipeline_parallel, quantize)

    @property
    def label(self) -> str:
        """The name without its prefix ("opt-125m"): what plans and logs call the model."""
        return self.name.rsplit("/", 1)[-1]

    @property
    def parallel(self) -> bool:
        """An alpa/ model: planned over the Ray cluster (tensor-parallel mesh or pipeline stages)."""
        return self.backend == PARALLEL

    def for_engine(self) -> "ModelSpec":
        """What the engine runs: facebook/ weights on the Flax model (the engine has no PyTorch runner)."""
        return dataclasses.replace(self, backend=JAX) if self.backend == TORCH else self

    def plan(self) -> dict:
        """The plan's degrees asked for (none: the planner's choice)."""
        return dict(tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel)


def is_parallel(name: Optional[str]) -> bool:
    """Whether a name (perhaps None: the embedded model) is an alpa/ model, for the edge's checks before a full
    parse (a deployment's placement, `batch`'s plan options)."""
    return name is not None and name.startswith("alpa/")

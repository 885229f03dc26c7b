"""A model spec (spec.py) -> the slot runner the engine drives, for every plan.

jax/ and facebook/ models run on one device (the engine runs facebook/ weights on the Flax model). alpa/ ones
take the planner's plan for the Ray cluster this process is connected to (or, with no cluster running, for this
process's devices):
pp = 1 runs the tensor-parallel stage in this process (GSPMD shards the KV cache by heads); pp > 1 runs
one Ray actor per stage (`parallel/pipeline.py`), each holding its layers and their KV cache.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import jax

from opt_serving.backend import Backend
from opt_serving.config import SpeculativeConfig, config_for
from opt_serving.model import kv_cache, loader, opt
from opt_serving.parallel import backend as parallel
from opt_serving.parallel.pipeline import RayStages
from opt_serving.parallel.stage_memory import DraftModel
from opt_serving.runner.generate import Generation
from opt_serving.runner.prefix import default_blocks
from opt_serving.runner.slots import Slots
from opt_serving.runner.stage import LocalStages, StageSlots
from opt_serving.runner.types import ModelCosts
from opt_serving.spec import ModelSpec

log = logging.getLogger(__name__)


def load_slots(spec: ModelSpec, dtype: str = "auto", num_slots: int = 16, max_seq_len: Optional[int] = None,
               device_memory=None, micro_batches: Optional[int] = None, prefix_caching: bool = True,
               handoff: str = "auto", lora=None, draft: Optional[DraftModel] = None) -> Slots:
    """Slots over the spec's weights: a numpy folder (or its parent holding `<size>-np/`), or random weights
    of its size drawn from its seed. `micro_batches`: decode slot groups of a pipelined plan (default: pp, at
    most one per slot). `spec.quantize="int8"`: int8 weights (model/quantize.py; an alpa/ plan's are split as
    its float ones, each pipeline stage quantizing its own). `prefix_caching`: keep prompts' KV for the prompts
    that start the same way (runner/prefix.py; every stage keeps its layers'). `handoff`: how a pipelined plan's
    stages hand hidden states on (pipeline.RayStages: "auto", "cgraph", "refs"). `lora`: the LoRA adapters
    (runner/lora.py's LoraOptions: their slots, every stage holding its layers' share, and those served from the
    start; Slots.loras serves them). `draft`: a served draft model the plan makes room for (draft_model's).
    """
    options, lora = lora, (None if lora is None else lora.config())
    slots = _load_slots(spec.for_engine(), dtype, num_slots, max_seq_len, device_memory, micro_batches,
                        prefix_caching, handoff, lora, draft)
    for name, path in () if options is None else options.modules:
        try:
            slots.loras.add(name, path)
        except BaseException:
            slots.close()
            raise
    return slots


def _load_slots(spec, dtype, num_slots, max_seq_len, device_memory, micro_batches, prefix_caching, handoff,
                lora, draft) -> Slots:
    dtype = resolve_dtype(dtype, cluster=spec.parallel)
    if not spec.parallel:
        m = loader.local_model(spec, dtype)
    else:
        loader.check_quantize_dtype(spec.quantize, dtype)
        plan, cfg, source = parallel.plan_model(spec, dtype, device_memory=device_memory, batch_size=num_slots,
                                                max_seq_len=max_seq_len, draft=draft)
        if prefix_caching and not plan.prefix_pool:
            log.warning("prefix caching is off: the plan %s has no room for its pool beside %d slots of %s tokens",
                        plan.name, num_slots, max_seq_len or cfg.max_position_embeddings)
            prefix_caching = False
        if plan.pp > 1:
            groups = micro_batches or plan.pp
            groups = max(g for g in range(1, min(groups, num_slots) + 1) if num_slots % g == 0)
            blocks = prefix_blocks(cfg, num_slots, max_seq_len, prefix_caching)
            stages = RayStages(cfg, plan, source, dtype=dtype, seed=spec.weights.seed or 0, rows=num_slots // groups,
                               groups=groups, max_seq_len=max_seq_len, quantize=spec.quantize, prefix_blocks=blocks,
                               handoff=handoff, lora=lora)
            width = 2 if spec.quantize == "int8" or dtype != "float32" else 4  # kv_cache.cache_dtype's rule
            costs = ModelCosts.of(cfg, spec.quantize or dtype, width)
            return Slots(cfg, stages, num_slots, groups, max_seq_len, plan=plan, prefix_blocks=blocks, costs=costs)
        m = parallel.tensor_parallel_model(cfg, plan, source, dtype, spec.weights.seed or 0, spec.quantize)
    return local_slots(m.config, m.fused_params, num_slots, max_seq_len, plan=m.plan, backend=m.backend,
                       prefix_blocks=prefix_blocks(m.config, num_slots, max_seq_len, prefix_caching), lora=lora)


def draft_model(spec: ModelSpec, speculative: SpeculativeConfig) -> DraftModel:
    """What a plan holds for the served draft model of a speculative_config (runner/draft.py's caches), read from
    its config alone."""
    spec = spec.for_engine()
    return DraftModel.of(config_for(spec.name, spec.weights.folder), speculative, spec.quantize or "float32")


def load_draft(spec: ModelSpec, dtype: str = "auto", quantize: Optional[str] = None):
    """A draft model for served speculative decoding (runner/draft.py): a Generation of the spec's weights on one
    device, in the target's dtype and weight format."""
    spec = dataclasses.replace(spec.for_engine(), quantize=quantize)
    return Generation.of(loader.local_model(spec, resolve_dtype(dtype)))


def prefix_blocks(cfg, num_slots: int, max_seq_len: Optional[int], on: bool = True) -> int:
    """The prefix cache's pool blocks for these slots (prefix.default_blocks), or 0 when it is off."""
    if not on:
        return 0
    return default_blocks(num_slots, min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings))


def resolve_dtype(dtype: str, cluster: bool = False) -> str:
    """"auto": float16 where the model runs on GPUs, float32 on CPUs (where the CPU kernels run float32
    products). Where it runs: this process, or with `cluster` (an alpa/ model) the Ray cluster when one runs,
    decided from Ray's resources without starting JAX here (a process that only plans takes no GPU)."""
    if dtype != "auto":
        return dtype
    if cluster:
        return parallel.cluster_dtype(dtype)
    return "float16" if jax.default_backend() == "gpu" else "float32"


def local_slots(cfg, params, num_slots: int = 8, max_seq_len: Optional[int] = None, plan=None,
                backend: Optional[Backend] = None, prefix_blocks: int = 0, lora=None) -> Slots:
    """Slots over a whole model's params in this process (one device, or a tensor-parallel mesh): in the
    checkpoint's layout, or with `backend` already in its runtime layout (an OPTModel's fused_params).
    `prefix_blocks`: the prefix cache's blocks (0: none); `lora`: slots for LoRA adapters (LoraConfig)."""
    stage = StageSlots(cfg, params, opt.StageSpec.whole(cfg), num_slots, 1, max_seq_len, backend, prefix_blocks,
                       lora)
    weights = stage.backend.weights if stage.backend.weights != "float32" else str(opt.param_dtype(stage.params))
    costs = ModelCosts.of(cfg, weights, jax.numpy.dtype(kv_cache.cache_dtype(stage.params, stage.backend)).itemsize)
    return Slots(cfg, LocalStages([stage]), num_slots, 1, max_seq_len, plan=plan, prefix_blocks=prefix_blocks,
                 costs=costs)

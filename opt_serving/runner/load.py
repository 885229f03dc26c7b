"""A model name and weights -> the slot runner the engine drives, for every plan.

`jax/` and `facebook/` names run on one device. `alpa/` names take the planner's plan for the Ray
cluster this process is connected to (or, with no cluster running, for this process's devices):
pp = 1 runs the tensor-parallel stage in this process (GSPMD shards the KV cache by heads); pp > 1 runs
one Ray actor per stage (`parallel/pipeline.py`), each holding its layers and their KV cache.
"""
from __future__ import annotations

from typing import Optional

from opt_serving.backend import Backend
from opt_serving.model import opt
from opt_serving.runner.prefix import default_blocks
from opt_serving.runner.slots import LocalStages, Slots
from opt_serving.runner.stage import StageSlots


def load_slots(model_name: str, path=None, dtype: str = "auto", num_slots: int = 16,
               max_seq_len: Optional[int] = None, dummy: bool = False, seed: int = 0,
               tensor_parallel: Optional[int] = None, pipeline_parallel: Optional[int] = None,
               device_memory=None, micro_batches: Optional[int] = None, quantize: Optional[str] = None,
               prefix_caching: bool = True, handoff: str = "auto") -> Slots:
    """Slots over the named model's weights: a numpy folder (or its parent holding `<size>-np/`), or
    random weights of the named size (`dummy`, drawn from `seed`). `micro_batches`: decode slot groups
    of a pipelined plan (default: pp, at most one per slot). `quantize="int8"`: int8 weights (model/quantize.py;
    an alpa/ plan's are split as its float ones, each pipeline stage quantizing its own). `prefix_caching`:
    keep prompts' KV for the prompts that start the same way (runner/prefix.py; every stage keeps its layers').
    `handoff`: how a pipelined plan's stages hand hidden states on (pipeline.RayStages: "auto", "cgraph", "refs").
    """
    from opt_serving.model.loader import check_quantize_dtype, get_model
    dtype = resolve_dtype(dtype, cluster=model_name.startswith("alpa/"))
    if model_name.startswith("alpa/"):
        check_quantize_dtype(quantize, dtype)
        from opt_serving.parallel import backend
        plan, cfg, source = backend.plan_model(model_name, path, dtype, dummy=dummy,
                                               tensor_parallel=tensor_parallel,
                                               pipeline_parallel=pipeline_parallel,
                                               device_memory=device_memory, batch_size=num_slots,
                                               max_seq_len=max_seq_len, quantize=quantize)
        if plan.pp > 1:
            from opt_serving.parallel.pipeline import RayStages
            groups = micro_batches or plan.pp
            groups = max(g for g in range(1, min(groups, num_slots) + 1) if num_slots % g == 0)
            blocks = prefix_blocks(cfg, num_slots, max_seq_len, prefix_caching)
            stages = RayStages(cfg, plan, source, dtype=dtype, seed=seed, rows=num_slots // groups,
                               groups=groups, max_seq_len=max_seq_len, quantize=quantize, prefix_blocks=blocks,
                               handoff=handoff)
            return Slots(cfg, stages, num_slots, groups, max_seq_len, plan=plan, prefix_blocks=blocks)
        m = backend.tensor_parallel_model(cfg, plan, source, dtype, seed, quantize)
    else:
        if tensor_parallel not in (None, 1) or pipeline_parallel not in (None, 1):
            raise ValueError(f"{model_name} runs on one device; use alpa/ for parallelism")
        if model_name.startswith("facebook/"):
            model_name = "jax/" + model_name[len("facebook/"):]
        m = get_model(model_name, path, dtype=dtype, dummy=dummy, seed=seed, quantize=quantize)
    return local_slots(m.config, m.fused_params, num_slots, max_seq_len, plan=getattr(m, "plan", None),
                       backend=m.backend, prefix_blocks=prefix_blocks(m.config, num_slots, max_seq_len, prefix_caching))


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
        from opt_serving.parallel.backend import cluster_dtype
        return cluster_dtype(dtype)
    import jax
    return "float16" if jax.default_backend() == "gpu" else "float32"


def local_slots(cfg, params, num_slots: int = 8, max_seq_len: Optional[int] = None, plan=None,
                backend: Optional[Backend] = None, prefix_blocks: int = 0) -> Slots:
    """Slots over a whole model's params in this process (one device, or a tensor-parallel mesh): in the
    checkpoint's layout, or with `backend` already in its runtime layout (an OPTModel's fused_params).
    `prefix_blocks`: the prefix cache's blocks (0: none)."""
    stage = StageSlots(cfg, params, opt.StageSpec.whole(cfg), num_slots, 1, max_seq_len, backend, prefix_blocks)
    return Slots(cfg, LocalStages([stage]), num_slots, 1, max_seq_len, plan=plan, prefix_blocks=prefix_blocks)

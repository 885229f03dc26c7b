"""`alpa/opt-*`: the planner picks the degrees for the Ray cluster, sharding.py and pipeline.py run them.

    model = get_model("alpa/opt-tiny", folder, tensor_parallel=2)      # one tp group, this process
    model = get_model("alpa/opt-tiny", folder, pipeline_parallel=2)    # two Ray stage actors
    model.generate(input_ids, max_new_tokens=8)

The plan comes from the Ray cluster this process is connected to, or joins (`address="auto"`) when
one is running; with none, from this process's devices. `device_memory` ("16GB") overrides what each
device may hold (CPU nodes, GPU kinds Ray does not name), so a model too big for one device gets
pp > 1 from the planner itself. Explicit degrees override the planner; any left out is still chosen
by it. One call builds one replica: data parallelism is more replicas (e.g. Ray Serve deployments).

This module plans and builds; it defines no model of its own. Either way generate() is runner/generate.py's
`Generation`, over the stages the engine steps. With pp = 1 its one stage, in this process, holds jax/'s
`wrapper.OPTModel` params sharded on a tp mesh (sharding.py: tensor parallelism is a layout of the params, and
generate() is the same compiled loop, which GSPMD partitions). With pp > 1 its stages are the stage actors
(pipeline.RayStages), and generate() is a host loop over them.
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

from opt_serving import jax_env
from opt_serving.config import OPTConfig, config_for, get_config
from opt_serving.model import layout, loader, sources, wrapper
from opt_serving.parallel import cluster as clusters
from opt_serving.parallel import ray_address
from opt_serving.parallel.cluster import Cluster, parse_bytes
from opt_serving.parallel.pipeline import RayStages
from opt_serving.parallel.planner import Plan, search
from opt_serving.parallel.sharding import make_mesh, sharded_parts
from opt_serving.model.peft import read_peft
from opt_serving.runner.generate import Generation, one_adapter, use_adapter
from opt_serving.spec import ModelSpec


def connect_ray(start: bool = True):
    """Join the Ray cluster of the last `ray start --head` on this machine, or RAY_ADDRESS's, if it answers (a
    stale address file is skipped, saying so: parallel/ray_address.py); with none, start a local one when
    `start`, else return None."""
    import ray  # Ray is imported where a cluster is joined: planning for this process's devices needs none
    up, _ = ray_address.init(start=start, include_dashboard=False, logging_level="ERROR")
    return ray if up else None


def cluster_dtype(dtype) -> str:
    """"auto" for a model planned over the Ray cluster: float16 where the cluster has GPUs, float32 on CPUs,
    read from Ray's resources without starting JAX in this process (which may only plan and drive); with no
    cluster running, the model runs here and this process's devices decide."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return jnp.dtype(loader.model_dtype(dtype)).name
    ray = connect_ray(start=False)
    if ray is not None:
        return "float16" if ray.cluster_resources().get("GPU", 0) > 0 else "float32"
    return jnp.dtype(loader.model_dtype(dtype)).name


def _memory(device_memory) -> float | None:
    if device_memory is None or isinstance(device_memory, (int, float)):
        return device_memory
    return parse_bytes(str(device_memory))


def plan_cluster(tensor_parallel=None, pipeline_parallel=None, device_memory=None) -> Cluster:
    """What the planner plans for: the Ray cluster when one runs (joined if need be), else this
    process's devices; `device_memory` (bytes or "16GB") overrides each device's memory."""
    memory = _memory(device_memory)
    ray = connect_ray(start=pipeline_parallel not in (None, 1))
    if ray is not None:
        cluster = clusters.cluster_from_ray(device_memory=memory)
        if cluster.spec.kind == "cpu" and (tensor_parallel or 1) > 1:
            # a CPU node's stage process makes its own tp host devices (XLA_FLAGS)
            cluster = dataclasses.replace(cluster, devices_per_node=tensor_parallel,
                                          device_memory=cluster.device_memory / tensor_parallel)
    else:
        cluster = clusters.cluster_from_jax()
        if memory is not None:
            cluster = dataclasses.replace(cluster, device_memory=memory)
    want = (tensor_parallel or 1) * (pipeline_parallel or 1)
    if cluster.spec.kind == "cpu" and cluster.num_devices < want:
        # CPU stages are processes that make their own host devices, so the devices an explicit CPU
        # plan asks for exist once its actors start
        cluster = dataclasses.replace(cluster, num_nodes=1, devices_per_node=want,
                                      device_memory=cluster.total_memory / want)
    return cluster


def plan_model(spec: ModelSpec, dtype="float32", device_memory=None, batch_size: int = 1, max_seq_len=None,
               cluster: Cluster | None = None, use: str = "serve", draft=None):
    """(plan, config, weights folder or None) of an alpa/ model: the planner's best plan with the spec's
    degrees fixed (`spec.quantize="int8"`: planned for int8 weights), its caches sized for `use` (planner.search:
    "serve", the slot runner's; "generate", get_model's), room for a served draft model beside the first stage
    (`draft`: stage_memory.DraftModel). Raises planner.NoFeasiblePlan with `opt-serving plan`'s message when
    nothing fits."""
    dtype = loader.model_dtype(dtype)
    folder = None
    if spec.weights.random:
        cfg = get_config(spec.name)
    else:
        if spec.weights.folder is None:
            raise ValueError(f"{spec.name}: give path= (the numpy weights folder) or dummy=True")
        folder = loader.resolve_numpy_folder(spec.weights.folder, spec.name)
        cfg = config_for(spec.name, folder)
    cluster = cluster or plan_cluster(spec.tensor_parallel, spec.pipeline_parallel, device_memory)
    plan = search(cfg, cluster, model=spec.label, batch_size=batch_size,
                  max_seq_len=max_seq_len, dtype=jnp.dtype(dtype).name, tensor_parallel=spec.tensor_parallel,
                  pipeline_parallel=spec.pipeline_parallel, weights=spec.quantize or "float32", use=use,
                  draft=draft).best
    return plan, cfg, folder


def tensor_parallel_model(cfg: OPTConfig, plan: Plan, folder, dtype, seed: int = 0,
                          quantize: str | None = None, merge=None) -> wrapper.OPTModel:
    """A pp = 1 plan in this process: params sharded over the first tp devices, each device reading its slice
    of the folder or drawing its slice of the random weights (model/sources.py) (`quantize="int8"`: int8
    weights, model/quantize.py's, split as the float ones are; `merge`: a LoRA adapter merged into them)."""
    if len(jax.devices()) < plan.tp:
        raise ValueError(f"the plan {plan.name} needs {plan.tp} devices in this process, it sees "
                         f"{len(jax.devices())} (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = make_mesh(jax.devices()[:plan.tp], plan.tp)
    dtype = loader.model_dtype(dtype)
    source = sources.RandomSource(seed) if folder is None else sources.FolderSource(folder, quantize)
    # tp = 1: the one device's runtime layout built a layer at a time (a mesh keeps the checkpoint's)
    parts = loader.lora_merged(sharded_parts(source, cfg, mesh, dtype=dtype, quantize=quantize), merge)
    backend, params = layout.runtime_parts(parts, mesh.devices.flat, dtype, weights=quantize or "float32")
    return wrapper.OPTModel(cfg, params, backend=backend, mesh=mesh, plan=plan)


def get_alpa_model(spec: ModelSpec, dtype="auto", batch_size: int = 1, max_seq_len: int | None = None,
                   cluster: Cluster | None = None, device_memory=None, micro_batches: int | None = None,
                   handoff: str = "auto", lora=None, merge_lora: bool = False, **unused):
    """An alpa/ model: a plan (the spec's explicit degrees kept) for the Ray cluster, then sharded or pipelined
    (`spec.quantize="int8"`: int8 weights, each stage quantizing its own, or reading them from a quantized
    folder; `handoff`: how pipeline stages hand hidden states on, pipeline.RayStages). The plan has room for
    generate() calls of `batch_size` rows of `max_seq_len` tokens (planner.search's use="generate"). `lora`: a PEFT
    LoRA adapter folder every row runs with, beside the base weights, or merged into them (`merge_lora`)."""
    if unused:
        raise TypeError(f"get_model() got unsupported arguments: {sorted(unused)}")
    dtype = cluster_dtype(dtype)
    seed, quantize = spec.weights.seed or 0, spec.quantize
    plan, cfg, folder = plan_model(spec, dtype, device_memory, batch_size, max_seq_len, cluster, use="generate")
    adapter = None if lora is None else read_peft(lora, cfg)
    merge, adapter = (adapter, None) if merge_lora else (None, adapter)
    if plan.pp == 1:
        return Generation.of(tensor_parallel_model(cfg, plan, folder, dtype, seed, quantize, merge), adapter)
    # this process only drives the stages (each holds its GPUs' share): no device memory taken ahead of need
    jax_env.apply(jax_env.route_only())
    connect_ray()
    # generate() uses only the stages' whole-sequence caches; their one decode slot as short as the plan counts it
    stages = RayStages(cfg, plan, folder, dtype=jnp.dtype(loader.model_dtype(dtype)).name, seed=seed,
                       max_seq_len=plan.max_seq_len, quantize=quantize, handoff=handoff,
                       lora=None if adapter is None else one_adapter(adapter), merge_lora=merge)
    if adapter is not None:
        use_adapter(stages, cfg, adapter)
    return Generation(cfg, stages, plan, micro_batches)

"""A pipeline stage's Ray actor: a `runner.stage.StageSlots` over the stage's layers, tensor-parallel over its node's
devices, with the weights it loads itself (stage_weights.py), the time it spends busy, and its process's memory.
"""
from __future__ import annotations

import os
import resource
import sys
import time

import numpy as np

from opt_serving import jax_env
from opt_serving.parallel.stage_weights import load_stage, node_name
from opt_serving.runner.types import STAGE_CALLS

# JAX, the model and Ray are imported in the functions that use them: a stage actor sets its devices (XLA_FLAGS,
# jax_env) before JAX loads in its process, and a machine without Ray (benchmark/gpu/gpu_check.py's) imports this module


def stage_runtime_env(tp: int, gpus: bool, cpus_per_stage: float) -> dict:
    """A stage process's Ray runtime_env: a GPU stage takes the share of its GPUs the planner counted on; a CPU stage
    makes its tp host devices, its kernels use its CPUs."""
    if gpus:
        return {"env_vars": jax_env.keep_users(jax_env.runs_model(tp))}
    return {"env_vars": {**jax_env.host_devices(tp), "JAX_PLATFORMS": "cpu",
                         "OPT_SERVING_CPU_THREADS": str(max(1, int(cpus_per_stage)))}}


class StageActor:
    """Runs inside a Ray worker: a `StageSlots` over this stage's layers, tensor-parallel over the node's tp
    devices, from `source` (model/sources.py): the numpy folder on this node, read a layer at a time, or
    random weights drawn here from the seed (the whole model's numbers for these layers). `quantize`: int8
    weights."""

    def __init__(self, cfg, spec, source, dtype, tp, rows, groups, max_seq_len, name="", quantize=None,
                 prefix_blocks=0, lora=None, merge_lora=None):

        import jax

        from opt_serving import xla_cache
        # a stage compiles its steps unless OPT_SERVING_COMPILE_CACHE names a cache: loaded from one they hold more
        # memory, which a pipeline is short of (xla_cache.py)
        xla_cache.enable(default=False)
        self.name = name
        from opt_serving.runner.stage import StageSlots
        mesh = None
        if tp > 1:
            from opt_serving.parallel.sharding import _check_divisible, make_mesh
            if len(jax.devices()) < tp:
                raise ValueError(f"a tp={tp} stage needs {tp} devices, node {node_name()} gives it "
                                 f"{len(jax.devices())}")
            _check_divisible(cfg, tp)
            mesh = make_mesh(jax.devices()[:tp], tp)
        before, t0 = process_memory(), time.perf_counter()
        # each stage chooses its own backend, for where its params lie, and builds its runtime layout a layer
        # at a time (load_stage)
        backend, params = load_stage(source, cfg, spec, dtype, mesh, quantize, merge_lora)
        self._loaded = {"load_s": time.perf_counter() - t0, "before": before, **process_memory()}
        self.slots = StageSlots(cfg, params, spec, rows, groups, max_seq_len, backend=backend,
                                prefix_blocks=prefix_blocks, lora=lora)
        self.reset_stats()

    def memory(self) -> dict:
        """This stage process's memory (process_memory), and the same right after its weights were loaded
        (`loaded`: before the steps were compiled; its `before`: when the load began, the libraries
        imported)."""
        return {"stage": self.name, "pid": os.getpid(), **process_memory(), "loaded": self._loaded}

    def reset_stats(self) -> None:
        self._since, self._busy, self._calls = time.perf_counter(), 0.0, 0

    def stats(self) -> dict:
        """Seconds spent in prefill and decode calls since reset_stats, against the wall clock: the
        stage's busy fraction (1 - its share of the pipeline bubble)."""
        wall = time.perf_counter() - self._since
        return {"stage": self.name, "busy_s": self._busy, "wall_s": wall, "calls": self._calls,
                "busy_fraction": self._busy / wall if wall else 0.0}

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = _host(fn(*args))  # synchronous: the result is on the host when the call ends
        self._busy += time.perf_counter() - t0
        self._calls += 1
        return out

    # for tests and benchmarks
    def where(self) -> dict:
        import jax
        import ray
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "devices": len(jax.devices()), "stage": self.name}

    def echo(self, x):
        return x

    # the compiled graph's one method (handoff.py): an execution's calls for this stage, in order
    def run_calls(self, payload):
        from opt_serving.parallel import handoff
        return handoff.run_calls(self, payload)


def _forward(name: str, step: bool):
    """StageActor's method `name`: the stage's own call, timed as busy where it is a step of the model."""
    def call(self, *args):
        fn = getattr(self.slots, name)
        return self._timed(fn, *args) if step else fn(*args)
    call.__name__ = call.__qualname__ = name
    return call


# the StageSlots calls the driver makes (runner.types.STAGE_CALLS); what leaves the actor from a step is numpy
for _name, _step in STAGE_CALLS.items():
    setattr(StageActor, _name, _forward(_name, _step))


def process_memory() -> dict:
    """This process's resident memory in bytes: now (`rss`, split into anonymous memory and file pages
    mapped in, `rss_anon`, `rss_file`) and its peak since it started (`peak_rss`, the kernel's high-water
    mark, which counts memory-mapped weight pages while they are mapped)."""
    fields = {"VmHWM": "peak_rss", "VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:  # not Linux: the peak from getrusage (kilobytes on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss"] = peak if sys.platform == "darwin" else peak * 1024
    return out


def describe_stage(i: int, spec) -> str:
    return f"stage {i} (layers {spec.start}-{spec.stop - 1})"


def _host(out):
    """Device arrays (a tp stage's sharded hidden states among them) as numpy, for the object store."""
    import jax
    return jax.tree_util.tree_map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, out)

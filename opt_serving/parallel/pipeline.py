"""Pipeline parallelism: one Ray actor per stage, each a `runner.stage.StageSlots` over its layers.

A stage actor holds its contiguous slice of layers (the model's own modules, `opt.OPT` with a
`StageSpec`), the KV cache of every decode slot for those layers, and, on the last stage, the LM head
and the sampling state. It runs the tensor-parallel jitted steps of its layers over its own node's
devices (tp GPUs, or on a CPU tp host devices it makes itself through XLA_FLAGS). The driver
(`runner.slots.Slots`, or `runner.generate.Generation.generate`) chains calls: stage i's output ref is
stage i+1's argument, so hidden states move between stages through Ray's object store without
coming back to the driver, and several micro-batches are in the stages at once. Or (`handoff`,
`choose_handoff`) every call goes through one Ray Compiled Graph compiled per pipeline (handoff.py), the
hidden states handed from stage to stage over its channels.

Placement: one placement-group bundle per stage (its tp GPUs and a CPU: a bundle always lies on one
node). Under Ray Serve the replica's own placement group holds them (bundle i is stage i's, the replica
in bundle 0 with stage 0; `stage_bundles`), so Serve starting, stopping or restarting a replica does the
same to its stages; elsewhere
the pipeline makes its own group and removes it on `close()` (or when the object owning it is
collected). Each stage reads only its slice of the numpy folder, from its own node's disk, a layer at a
time (or, for random weights, draws only its slice from the seed: model/sources.py), and puts each layer in
its runtime layout before reading the next: a stage process holds its share once, and nothing the size of
the model passes through the driver or the object store.
"""
from __future__ import annotations

import gc
import logging
import os
import resource
import socket
import sys
import threading
import time
import weakref

import numpy as np

from opt_serving import jax_env
from opt_serving.config import OPTConfig
from opt_serving.parallel.handoff import FIRE_AND_FORGET
from opt_serving.runner.types import STAGE_CALLS, StageDied

# JAX, the model and Ray are imported in the functions that use them: a stage actor sets its devices (XLA_FLAGS,
# jax_env) before JAX loads in its process, and a machine without Ray (benchmark/gpu_check.py's) imports this module

STAGE_NAME_PREFIX = "opt-serving-stage-"

__all__ = ["RayStages", "StageActor", "StageDied", "split_layers", "stage_specs", "measure_handoff_latency"]


def split_layers(num_layers: int, pp: int, layer_split: list[int] | None = None) -> list[range]:
    split = layer_split or [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
    if len(split) != pp or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"layer split {split} does not cover {num_layers} layers in {pp} stages")
    starts = np.cumsum([0, *split])
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def stage_specs(cfg: OPTConfig, pp: int, layer_split: list[int] | None = None):
    from opt_serving.model.opt import StageSpec
    ranges = split_layers(cfg.num_hidden_layers, pp, layer_split)
    return [StageSpec(r.start, r.stop, i == 0, i == pp - 1) for i, r in enumerate(ranges)]


def load_stage_params(source, cfg: OPTConfig, spec, dtype="float32", mesh=None, quantize=None) -> dict:
    """One stage's tensors in the checkpoint layout, its Flax tree (layers numbered from 0), over `mesh`
    (default: this process's first device): from a numpy folder, memory-mapped, each device reading only its
    own slice of each file, or drawn from a seed (model/sources.py's RandomSource: the whole model's numbers,
    each device drawing its slice). `quantize="int8"`: int8 weights, quantized as they are read or read from a
    quantized folder. A node without the files gets an error naming the node and the path."""
    from opt_serving.model import sources
    return sources.merged(_stage_parts(source, cfg, spec, dtype, mesh, quantize))


def load_stage(source, cfg: OPTConfig, spec, dtype="float32", mesh=None, quantize=None, merge_lora=None):
    """load_stage_params in the runtime layout of the backend chosen for where the stage lies ->
    (backend, params): each group (the tensors outside the layers, then each layer) is put in that layout as it
    is read and its host and checkpoint-layout copies dropped, so the stage never holds its share twice.
    `merge_lora`: a LoRA adapter (model/peft.py's) merged into the stage's layers as they are read."""
    import jax
    from opt_serving.model import layout
    where = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    return layout.runtime_parts(_stage_parts(source, cfg, spec, dtype, mesh, quantize, merge_lora), where,
                                jax.numpy.dtype(dtype), weights=quantize or "float32", head=spec.last)


def _stage_parts(source, cfg, spec, dtype, mesh, quantize, merge_lora=None):
    import jax
    from opt_serving.model import param_tree
    from opt_serving.model import sources
    from opt_serving.parallel.sharding import make_mesh, sharded_parts
    if not hasattr(source, "place"):
        source = sources.FolderSource(source, quantize)
    if isinstance(source, sources.FolderSource):
        folder = source.folder
        if not (folder / "decoder.embed_tokens.weight").exists() and not (folder / "config.json").exists():
            raise FileNotFoundError(f"node {_node_name()} has no numpy weights folder at {folder}: every node "
                                    "that runs a pipeline stage reads its layers from the same path (copy the "
                                    "folder there, or use a shared file system)")
    mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], 1)
    # int8: the first and last stages read the embedding (the lookup's table, the head's int8 copy); each
    # keeps only its own part of the two (param_tree.stage_part)
    parts = sharded_parts(source, cfg, mesh, dtype=dtype, names=stage_param_names(cfg, spec), quantize=quantize)
    if merge_lora is not None:  # (the layers numbered as the model's, before the stage's own numbering)
        from opt_serving.model.lora import merge_part
        parts = (merge_part(part, merge_lora) for part in parts)
    try:
        for part in parts:
            yield param_tree.stage_part(part, spec)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"node {_node_name()}: {e}") from None


def stage_param_names(cfg: OPTConfig, spec) -> set[str]:
    """The checkpoint names a stage holds: param_tree.stage_params's cut of the model, applied to a tree of names."""
    import jax
    from opt_serving.model import param_tree
    from opt_serving.model.weights import flax_path, param_shapes
    from opt_serving.parallel.sharding import _tree_set
    tree: dict = {}
    for name in param_shapes(cfg):
        _tree_set(tree, flax_path(name)[0], name)
    return set(jax.tree_util.tree_leaves(param_tree.stage_params(tree, spec)))


def _node_name() -> str:
    import ray
    if not ray.is_initialized():  # get_runtime_context() would start a Ray of its own
        return socket.gethostname()
    return f"{socket.gethostname()} (Ray node {ray.get_runtime_context().get_node_id()[:12]})"


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
                raise ValueError(f"a tp={tp} stage needs {tp} devices, node {_node_name()} gives it "
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


def _describe(i: int, spec) -> str:
    return f"stage {i} (layers {spec.start}-{spec.stop - 1})"


def _host(out):
    """Device arrays (a tp stage's sharded hidden states among them) as numpy, for the object store."""
    import jax
    return jax.tree_util.tree_map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, out)


def stage_bundles(plan, gpus: bool, cpus_per_stage: float = 1, extra_cpus: float = 0) -> tuple[list[dict], str]:
    """The placement group of a pipelined plan: one bundle per stage (`extra_cpus` more in the first, for
    the replica that drives them) and its strategy. GPU stages (tp GPUs each) fill nodes; a CPU node is
    one of the planner's devices, so CPU stages go one a node where the cluster has enough nodes."""
    import ray
    bundles = [{"CPU": float(cpus_per_stage), **({"GPU": float(plan.tp)} if gpus else {})} for _ in range(plan.pp)]
    bundles[0]["CPU"] += extra_cpus
    if gpus:
        return bundles, "PACK"
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return bundles, "STRICT_SPREAD" if nodes >= plan.pp else "SPREAD"


def never_placed(bundles: list[dict], strategy: str, nodes: list[dict]) -> str | None:
    """Why the cluster's nodes (ray.nodes()) could never hold `bundles`, even with nothing else running on them
    (None: they could): each bundle must fit one node's total resources, on a node of its own under
    STRICT_SPREAD. First fit, largest bundle first, which decides these few equal-sized stage bundles."""
    free = [dict(n.get("Resources", {})) for n in nodes if n.get("Alive")]
    have = "; ".join(", ".join(f"{k} {v:g}" for k, v in sorted(r.items()) if k in ("CPU", "GPU")) or "nothing"
                     for r in free) or "no live node"
    used = [False] * len(free)
    for b in sorted(bundles, key=lambda b: -sum(b.values())):
        for i, r in enumerate(free):
            if (strategy != "STRICT_SPREAD" or not used[i]) and all(r.get(k, 0) >= v for k, v in b.items()):
                for k, v in b.items():
                    r[k] -= v
                used[i] = True
                break
        else:
            return (f"{len(bundles)} bundles need {_totals(bundles)} in all; the live nodes have: [{have}] "
                    f"(give the plan fewer stages, or start the cluster with more nodes or CPUs)")
    return None


def _totals(bundles: list[dict]) -> str:
    keys = sorted({k for b in bundles for k in b})
    return ", ".join(f"{k} {sum(b.get(k, 0) for b in bundles):g}" for k in keys)


class RayStages:
    """`runner.slots.Stages` over pp Ray actors placed as the plan says (see the module docstring)."""

    def __init__(self, cfg: OPTConfig, plan, folder=None, dtype="float32", seed: int = 0, rows: int = 1,
                 groups: int = 1, max_seq_len: int | None = None, cpus_per_stage: float = 1,
                 placement_timeout_s: float = 120, quantize: str | None = None, prefix_blocks: int = 0,
                 handoff: str = "auto", lora=None, merge_lora=None):
        import ray
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, not {handoff!r}")
        from ray.util import get_current_placement_group
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.cfg, self.plan, self.tp = cfg, plan, plan.tp
        self.specs = stage_specs(cfg, plan.pp, plan.layer_split)
        self.n = len(self.specs)
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        pg, own = get_current_placement_group(), False
        if pg is None or len(pg.bundle_specs) != self.n:  # not a replica of ours (app._placement): our own group
            bundles, strategy = stage_bundles(plan, gpus, cpus_per_stage=cpus_per_stage)
            never = never_placed(bundles, strategy, ray.nodes())
            if never:  # refused now, not after the placement timeout
                raise RuntimeError(f"the Ray cluster cannot place {self.n} stages ({bundles}, {strategy}): {never}")
            pg, own = placement_group(bundles, strategy=strategy), True
            try:
                _wait_or_make_room(pg, placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)
                raise RuntimeError(
                    f"the Ray cluster cannot place {self.n} stages ({bundles}, {strategy}) within "
                    f"{placement_timeout_s:.0f} s; "
                    f"available: {ray.available_resources()}") from None
        self.pg, self._own_pg = pg, own
        # a GPU stage takes the share of its GPUs the planner counted on; a CPU stage makes its tp host devices,
        # its kernels use its CPUs
        env = {"env_vars": jax_env.keep_users(jax_env.runs_model(plan.tp))} if gpus else {"env_vars": {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={plan.tp}", "JAX_PLATFORMS": "cpu",
            "OPT_SERVING_CPU_THREADS": str(max(1, int(cpus_per_stage)))}}
        import jax
        from opt_serving.model import sources
        dtype = jax.numpy.dtype(dtype).name
        # each stage reads its layers from the folder on its node, or draws them there from the seed: nothing
        # of the model's size passes through this process or the object store
        source = sources.RandomSource(seed) if folder is None else sources.FolderSource(folder, quantize)
        actor = ray.remote(StageActor)
        self.actors = []
        tag = os.urandom(4).hex()  # named (ray.util.list_named_actors finds them), owned by this process
        for i, spec in enumerate(self.specs):
            self.actors.append(actor.options(
                num_cpus=cpus_per_stage, num_gpus=plan.tp if gpus else 0, runtime_env=env, max_restarts=0,
                name=f"{STAGE_NAME_PREFIX}{tag}-{i}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote(
                    cfg, spec, source, dtype, plan.tp, rows, groups, max_seq_len, _describe(i, spec), quantize,
                    prefix_blocks, lora, merge_lora))
        # replies nobody waits for (insert, free, drop): their errors surface later. The engine thread and a
        # beam search's thread (generation_model) both call in: the list has a lock
        self._sent: list = []
        self._lock = threading.Lock()
        self.dead: str | None = None
        self._chain = None  # the compiled graph the calls go through (handoff.py), or None: object refs
        self._graphs: list = []  # (for the finalizer, which must not hold self)
        self._finalizer = weakref.finalize(self, _shutdown, list(self.actors), pg if own else None, self._graphs)
        if own:
            _LIVE.append(weakref.ref(self))
        self.get([a.ready.remote() for a in self.actors])
        self.handoff, self.handoff_reason = self._start_handoff(handoff, gpus)

    def _start_handoff(self, handoff: str, gpus: bool) -> tuple[str, str]:
        """Compile the stages' graph where `handoff` asks for it (choose_handoff) -> (the hand-off used, why)."""
        log = logging.getLogger(__name__)
        choice, why = choose_handoff(handoff, len({w["node"] for w in self.where()}), gpus)
        if choice == "cgraph":
            from opt_serving.parallel.handoff import CompiledChain
            try:
                self._chain = CompiledChain(self.actors, max_inflight=max(16, 4 * self.n))
            except Exception as e:
                log.warning("pipeline stage hand-off: the compiled graph failed to start (%s: %s); using object "
                            "refs", type(e).__name__, e)
                return "refs", f"the compiled graph failed to start ({type(e).__name__}: {e})"
            self._graphs.append(self._chain.dag)
        log.info("pipeline stage hand-off: %s, %s", "Ray Compiled Graph" if choice == "cgraph" else "object refs", why)
        return choice, why

    def describe(self, i: int) -> str:
        return _describe(i, self.specs[i])

    def call(self, i: int, method: str, *args):
        if self._chain is not None:
            return self._chained(self._chain.call, i, method, args)
        ref = getattr(self.actors[i], method).remote(*args)
        if method in FIRE_AND_FORGET:
            with self._lock:
                self._sent.append(ref)
        return ref

    def get(self, futures):
        import ray
        if self.dead is not None:
            raise StageDied(self.dead)
        if self._chain is not None:
            return self._chained(self._get_chained, futures)
        try:
            with self._lock:  # check the replies nobody waited for, so their errors are not lost
                done, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0) if self._sent \
                    else ([], [])
            ray.get(done)
            return ray.get(futures)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            which = [self.describe(i) for i in self._dead()]
            self.dead = (f"pipeline {', '.join(which) or 'stage'} died ({type(e).__name__}); "
                         "the model must be loaded again")
            raise StageDied(self.dead) from None

    def _get_chained(self, futures):
        self._chain.flush()  # the calls this thread left waiting go first
        if isinstance(futures, (list, tuple)):
            return [self._chain.get(f) for f in futures]
        return self._chain.get(futures)

    def _chained(self, fn, *args):
        """fn(*args) on the compiled graph; a broken graph (a stage gone, or the pipeline closed) -> StageDied."""
        from ray.exceptions import RayTaskError
        if self.dead is not None:
            raise StageDied(self.dead)
        try:
            return fn(*args)
        except RayTaskError:  # a stage's call raised (as the cause's type): the stages live on
            raise
        except Exception as e:
            if self._chain.broken is None and not _is_ray_error(e):
                raise  # a bug here, not a broken graph
            if self.dead is None:
                which = [self.describe(i) for i in self._dead()]
                self.dead = (f"pipeline {', '.join(which) or 'stage'} died ({type(e).__name__}); "
                             "the model must be loaded again")
            raise StageDied(self.dead) from None

    def _dead(self, timeout_s: float = 10) -> list[int]:
        """The stages whose actor does not answer a ping because it is gone (a busy one is not dead)."""
        import ray
        refs = [a.ready.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for i, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception:
                    dead.append(i)
        return dead

    def check_health(self) -> None:
        """Raises StageDied naming the stages that are gone."""
        if self.dead is None:
            which = [self.describe(i) for i in self._dead()]
            if which:
                self.dead = f"pipeline {', '.join(which)} died; the model must be loaded again"
        if self.dead is not None:
            raise StageDied(self.dead)

    def where(self) -> list[dict]:
        import ray
        return ray.get([a.where.remote() for a in self.actors])

    def close(self, why: str = "the model was closed") -> None:
        if self.dead is None:
            self.dead = why
        self._finalizer()


HANDOFFS = ("auto", "cgraph", "refs")


def choose_handoff(handoff: str, nodes: int, gpus: bool) -> tuple[str, str]:
    """The hand-off a pipeline uses ("cgraph" or "refs") and why, for the `handoff` asked, the nodes its stages
    lie on and whether they run on GPUs. `auto` is object refs, the one measured faster: across nodes Ray 2.60's
    raylet failed a check (experimental_mutable_object_provider.cc) at a compiled graph's first write, and on CPU
    stages a compiled graph's stage waiting for its input polls its channel, taking CPU from the stages' kernels
    (the pipelined decode loop ran 0.74-0.76x as fast as with refs on one CPU node, benchmark/README.md). On one
    node of GPUs a compiled graph was never measured: `handoff="cgraph"` asks for it."""
    if handoff != "auto":
        return handoff, f"asked for (handoff={handoff!r})"
    if nodes > 1:
        return "refs", f"the stages span {nodes} nodes, where compiled graphs are not used (handoff='auto')"
    if not gpus:
        return "refs", ("the stages run on CPUs, where a compiled graph's waiting stages poll and slow the others' "
                        "kernels (handoff='auto')")
    return "refs", ("a compiled graph on GPUs is not measured yet (handoff='auto'; handoff='cgraph' asks for "
                    "one)")


def _is_ray_error(e: BaseException) -> bool:
    import ray
    return isinstance(e, (ray.exceptions.RayError, ray.exceptions.RayChannelError)) or \
        type(e).__module__.startswith("ray.")


# pipelines this process placed itself, oldest first (a notebook's `m = get_model(...)` run again)
_LIVE: list = []


def _wait_or_make_room(pg, timeout_s: float) -> None:
    """Wait for a new pipeline's placement group. `m = get_model(...)` run again builds the new model
    while `m` still holds the old one: when the cluster has no room, a dropped pipeline still awaiting
    collection is collected, then the older pipelines this process placed are closed, oldest first (using
    one afterwards raises StageDied saying so), before waiting the full timeout."""
    import ray
    try:
        return ray.get(pg.ready(), timeout=5)
    except ray.exceptions.GetTimeoutError:
        gc.collect()
    while True:
        older = [p for p in (r() for r in _LIVE) if p is not None and p._finalizer.alive]
        try:
            return ray.get(pg.ready(), timeout=5 if older else timeout_s)
        except ray.exceptions.GetTimeoutError:
            if not older:
                raise
            logging.getLogger(__name__).warning(
                "the Ray cluster has no room for the new pipeline: closing an older one this process placed")
            older[0].close("closed to make room for a newer pipelined model in this process; load it again")


def _shutdown(actors, pg, graphs=()) -> None:
    """Stop the stages' compiled graph, kill the stage actors and remove the placement group this pipeline
    made (if Ray is still up)."""
    try:
        import ray
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group
        from opt_serving.parallel.handoff import teardown
        for dag in graphs:
            teardown(dag)
        for a in actors:
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)
    except Exception:  # interpreter shutdown, Ray already gone: nothing left to free
        pass


class _Echo:
    def echo(self, x):
        return x


def measure_handoff_latency(repeat: int = 30, nbytes: int = 4096) -> float:
    """Seconds one stage-to-stage hand-off costs through Ray (actor call + object ref), for
    calibrating the cost model's `handoff_latency_s`. Needs ray.init() first."""
    import ray
    a, b = ray.remote(num_cpus=0)(_Echo).remote(), ray.remote(num_cpus=0)(_Echo).remote()
    x = np.zeros(nbytes // 4, np.float32)
    ray.get(b.echo.remote(a.echo.remote(x)))          # start both workers
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ray.get(b.echo.remote(a.echo.remote(x)))
        times.append(time.perf_counter() - t0)
    for actor in (a, b):
        ray.kill(actor)
    # two calls in the chain: the hand-off between them plus the final return
    return float(np.median(times)) / 2

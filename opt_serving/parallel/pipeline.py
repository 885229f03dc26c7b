"""Pipeline parallelism: one Ray actor per stage (stage_actor.py), each a `runner.stage.StageSlots` over its layers;
this module is the driver's side, `RayStages`.

A stage actor holds its contiguous slice of layers (the model's own modules, `opt.OPT` with a
`StageSpec`), the KV cache of every decode slot for those layers, and, on the last stage, the LM head
and the sampling state. It runs the tensor-parallel jitted steps of its layers over its own node's
devices (tp GPUs, or on a CPU tp host devices it makes itself through XLA_FLAGS). The driver
(`runner.slots.Slots`, or `runner.generate.Generation.generate`) chains calls: stage i's output ref is
stage i+1's argument, so hidden states move between stages through Ray's object store without
coming back to the driver, and several micro-batches are in the stages at once. Or (`handoff`,
handoff_choice.py) every call goes through one Ray Compiled Graph compiled per pipeline (handoff.py), the
hidden states handed from stage to stage over its channels.

Placement (placement.py): one placement-group bundle per stage, the replica's own under Ray Serve; elsewhere
the pipeline makes its own group and removes it on `close()` (or when the object owning it is
collected). Each stage reads only its slice of the weights, on its own node (stage_weights.py): nothing the size of
the model passes through the driver or the object store.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref

from opt_serving.config import OPTConfig
from opt_serving.parallel.handoff import FIRE_AND_FORGET
from opt_serving.parallel.handoff_choice import HANDOFFS, choose_handoff, measure_handoff_latency
from opt_serving.parallel.placement import place_stages, placed_here
from opt_serving.parallel.stage_actor import StageActor, describe_stage, stage_runtime_env
from opt_serving.parallel.stage_weights import split_layers, stage_specs
from opt_serving.runner.types import StageDied

# Ray is imported in the functions that use it: a machine without Ray (benchmark/gpu/gpu_check.py's) imports this module

STAGE_NAME_PREFIX = "opt-serving-stage-"

# the pipeline's API, as users import it from here (the stage actor, the layer split and the hand-off's cost have
# modules of their own)
__all__ = ["RayStages", "StageActor", "StageDied", "split_layers", "stage_specs", "measure_handoff_latency"]


class RayStages:
    """`runner.slots.Stages` over pp Ray actors placed as the plan says (see the module docstring)."""

    def __init__(self, cfg: OPTConfig, plan, folder=None, dtype="float32", seed: int = 0, rows: int = 1,
                 groups: int = 1, max_seq_len: int | None = None, cpus_per_stage: float = 1,
                 placement_timeout_s: float = 120, quantize: str | None = None, prefix_blocks: int = 0,
                 handoff: str = "auto", lora=None, merge_lora=None):
        import ray
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, not {handoff!r}")
        self.cfg, self.plan, self.tp = cfg, plan, plan.tp
        self.specs = stage_specs(cfg, plan.pp, plan.layer_split)
        self.n = len(self.specs)
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        pg, own = place_stages(plan, gpus, cpus_per_stage, placement_timeout_s)
        self.pg, self._own_pg = pg, own
        import jax
        from opt_serving.model import sources
        dtype = jax.numpy.dtype(dtype).name
        # each stage reads its layers from the folder on its node, or draws them there from the seed: nothing
        # of the model's size passes through this process or the object store
        source = sources.RandomSource(seed) if folder is None else sources.FolderSource(folder, quantize)
        self.actors = _start_stages([(cfg, spec, source, dtype, plan.tp, rows, groups, max_seq_len,
                                      describe_stage(i, spec), quantize, prefix_blocks, lora, merge_lora)
                                     for i, spec in enumerate(self.specs)], pg, plan.tp, gpus, cpus_per_stage)
        # replies nobody waits for (insert, free, drop): their errors surface later. The engine thread and a
        # beam search's thread (generation_model) both call in: the list has a lock
        self._sent: list = []
        self._lock = threading.Lock()
        self.dead: str | None = None
        self._chain = None  # the compiled graph the calls go through (handoff.py), or None: object refs
        self._graphs: list = []  # (for the finalizer, which must not hold self)
        self._finalizer = weakref.finalize(self, _shutdown, list(self.actors), pg if own else None, self._graphs)
        if own:
            placed_here(self)
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
        return describe_stage(i, self.specs[i])

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

    @property
    def closed(self) -> bool:
        """Whether its stages are gone: closed, or the pipeline collected (its placement group removed)."""
        return not self._finalizer.alive


def _start_stages(args: list[tuple], pg, tp: int, gpus: bool, cpus_per_stage: float) -> list:
    """A StageActor for each stage's constructor `args`, in its bundle of `pg`: named (ray.util.list_named_actors
    finds them), owned by this process."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    actor, env = ray.remote(StageActor), stage_runtime_env(tp, gpus, cpus_per_stage)
    tag = os.urandom(4).hex()
    return [actor.options(num_cpus=cpus_per_stage, num_gpus=tp if gpus else 0, runtime_env=env, max_restarts=0,
                          name=f"{STAGE_NAME_PREFIX}{tag}-{i}",
                          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote(*stage_args)
            for i, stage_args in enumerate(args)]


def _is_ray_error(e: BaseException) -> bool:
    import ray
    return isinstance(e, (ray.exceptions.RayError, ray.exceptions.RayChannelError)) or \
        type(e).__module__.startswith("ray.")


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

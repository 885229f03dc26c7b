"""Where a pipeline's stages go: one placement-group bundle per stage (its tp GPUs and a CPU: a bundle always lies
on one node). Under Ray Serve the replica's own placement group holds them (bundle i is stage i's, the replica in
bundle 0 with stage 0; `stage_bundles`), so Serve starting, stopping or restarting a replica does the same to its
stages; elsewhere the pipeline makes its own group, refused at once where the cluster could never hold it, and
makes room by closing older pipelines this process placed.
"""
from __future__ import annotations

import gc
import logging
import weakref

# pipelines this process placed itself, oldest first (a notebook's `m = get_model(...)` run again)
_LIVE: list = []


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


def place_stages(plan, gpus: bool, cpus_per_stage: float, timeout_s: float) -> tuple:
    """The placement group of a pipeline's stages -> (the group, whether the pipeline made it and removes it): the
    replica's own where it has a bundle per stage (app._placement), else a new one."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.placement_group import placement_group, remove_placement_group
    pg = get_current_placement_group()
    if pg is not None and len(pg.bundle_specs) == plan.pp:
        return pg, False
    bundles, strategy = stage_bundles(plan, gpus, cpus_per_stage=cpus_per_stage)
    never = never_placed(bundles, strategy, ray.nodes())
    if never:  # refused now, not after the placement timeout
        raise RuntimeError(f"the Ray cluster cannot place {plan.pp} stages ({bundles}, {strategy}): {never}")
    pg = placement_group(bundles, strategy=strategy)
    try:
        _wait_or_make_room(pg, timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"the Ray cluster cannot place {plan.pp} stages ({bundles}, {strategy}) within "
                           f"{timeout_s:.0f} s; available: {ray.available_resources()}") from None
    return pg, True


def placed_here(pipeline) -> None:
    """Count `pipeline` (a RayStages that made its own placement group) among those _wait_or_make_room may close."""
    _LIVE.append(weakref.ref(pipeline))


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
        older = [p for p in (r() for r in _LIVE) if p is not None and not p.closed]
        try:
            return ray.get(pg.ready(), timeout=5 if older else timeout_s)
        except ray.exceptions.GetTimeoutError:
            if not older:
                raise
            logging.getLogger(__name__).warning(
                "the Ray cluster has no room for the new pipeline: closing an older one this process placed")
            older[0].close("closed to make room for a newer pipelined model in this process; load it again")

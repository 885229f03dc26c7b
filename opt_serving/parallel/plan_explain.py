"""Why a plan lost to the best one: the part of a token's path (compute, all-reduces, overheads, hand-offs) it
spends most more time in, or the stage that bottlenecks its micro-batches (`opt-serving plan`'s runners-up).
"""
from __future__ import annotations

from opt_serving.parallel.plan import Plan


def _path_parts(plan: Plan) -> dict[str, float]:
    """Seconds per token by kind, along the stages a token passes."""
    st = plan.stages
    return {"compute": sum(s.time.compute_s for s in st),
            "tensor-parallel all-reduces": sum(s.time.comm_s for s in st),
            "per-step and per-layer overheads": sum(s.time.overhead_s for s in st),
            # and, for a latency plan, the caller's hop into and out of the stage actors
            "pipeline hand-offs": sum(s.handoff_s for s in st) + (
                max(0.0, plan.step_s - sum(s.busy_s for s in st)) if plan.objective == "latency" else 0.0)}


def why_lost(plan: Plan, best: Plan) -> str:
    if plan is best or plan.degrees == best.degrees:
        return "chosen"
    if plan.objective == "latency":
        head = f"{plan.step_s / best.step_s:.2f}x the time per token ({plan.step_s * 1e3:.2f} ms)"
    else:
        head = f"{plan.throughput / best.throughput:.2f}x the throughput ({plan.throughput:.1f} tok/s)"
    mine, theirs = _path_parts(plan), _path_parts(best)
    deltas = {k: mine[k] - theirs[k] for k in mine}
    kind, worst = max(deltas.items(), key=lambda kv: kv[1])
    if plan.objective == "throughput" and plan.micro_batches * max(s.busy_s for s in plan.stages) >= plan.step_s:
        slow = max(plan.stages, key=lambda s: s.busy_s)
        why = (f"bottleneck stage {slow.index} ({slow.num_layers} layers) takes "
               f"{slow.busy_s * 1e3:.2f} ms for each of {plan.micro_batches} micro-batches "
               f"of {plan.micro_batch_size}")
    elif worst > 0:
        why = f"+{worst * 1e3:.2f} ms in {kind}"
        if kind == "pipeline hand-offs":
            n_inter = sum(s.inter_node_handoff for s in plan.stages)
            why += f" ({plan.pp - 1} hand-offs, {n_inter} across nodes)"
    else:
        why = "no faster on any part"
    return f"{head}: {why}"

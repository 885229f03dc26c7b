"""Search data x pipeline x tensor parallel degrees; slice layers into stages by Alpa's DP.

For every (tp, pp) that the cluster allows (tp inside a node and dividing heads and ffn;
dp = as many replicas as the devices hold), a dynamic programme assigns contiguous layers
to the pp stages so that the slowest stage is as fast as possible and every device stays
under its memory limit. The winner follows the workload: at batch 1 the shortest time per
token (latency), at a serving batch the most tokens per second (throughput), with
`pp` micro-batches in flight so no stage waits.

    result = search(get_config("opt-175b"), parse_cluster("4x8x16GB"), batch_size=1)
    result.best.stages[0].layers        # (0, 12)
"""
from __future__ import annotations

import dataclasses

from opt_serving.config import OPTConfig
from opt_serving.jax_env import DEFAULT_HEADROOM
from opt_serving.parallel import cost
from opt_serving.parallel.candidate import evaluate
from opt_serving.parallel.cluster import GB, Cluster
from opt_serving.parallel.plan import USES, NoFeasiblePlan, Plan, Rejected
from opt_serving.parallel.plan_explain import why_lost
from opt_serving.parallel.slicing import slice_layers  # noqa: F401  (re-exported)
from opt_serving.parallel.stage_memory import DraftModel


@dataclasses.dataclass
class SearchResult:
    plans: list[Plan]                # feasible, best first
    rejected: list[Rejected]

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def why_lost(self, plan: Plan) -> str:
        return why_lost(plan, self.best)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_search_args(cfg: OPTConfig, cluster: Cluster, model: str, batch_size: int,
                       max_seq_len: int | None, dtype: str, headroom: float,
                       objective: str | None, weights: str = "float32", use: str = "serve",
                       draft: DraftModel | None = None) -> tuple[int, str]:
    """Reject bad arguments and models too big for the whole cluster before searching;
    returns max_seq_len and objective with their defaults filled in."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    max_seq_len = max_seq_len or cfg.max_position_embeddings
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len {max_seq_len} is outside 1..{cfg.max_position_embeddings} "
                         f"(the model's position embeddings)")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a fraction of device memory in [0, 1), got {headroom}")
    objective = objective or ("latency" if batch_size == 1 else "throughput")
    if objective not in ("latency", "throughput"):
        raise ValueError(f"objective must be 'latency' or 'throughput', got {objective!r}")
    if use not in USES:
        raise ValueError(f"use must be one of {', '.join(USES)}, got {use!r}")
    cost.dtype_bytes(dtype)
    if draft is not None and use != "serve":
        raise ValueError("a draft model is planned for serving (use='serve'), not for generate()")
    need = cost.weight_bytes(cfg, dtype, weights)
    draft_need = 0 if draft is None else cost.weight_bytes(draft.cfg, dtype, draft.weights)
    if need + draft_need > cluster.total_memory:
        beside = f" and its draft model {draft_need / GB:.1f} GB" if draft_need else ""
        raise NoFeasiblePlan(
            f"{model or 'the model'} needs {need / GB:.1f} GB of {_weights_name(dtype, weights)} weights{beside}, "
            f"the cluster has {cluster.total_memory / GB:.1f} GB ({cluster.describe()})")
    return max_seq_len, objective


def _weights_name(dtype: str, weights: str) -> str:
    return "int8" if weights == "int8" else dtype


def _no_plan(model: str, cluster: Cluster, rejected: list[Rejected]) -> NoFeasiblePlan:
    """The error for a search with no feasible plan: the closest miss on memory, if any."""
    mem = [r for r in rejected if r.need_bytes]
    if mem:
        closest = min(mem, key=lambda r: r.need_bytes)
        msg = (f"no plan fits {model or 'the model'} on {cluster.describe()}: the closest, "
               f"{closest.name}, {closest.reason}")
    else:
        msg = (f"no plan fits {model or 'the model'} on {cluster.describe()}: "
               + "; ".join(f"{r.name}: {r.reason}" for r in rejected[:4]))
    return NoFeasiblePlan(msg, rejected)


def _degrees(cluster: Cluster, tensor_parallel: int | None, pipeline_parallel: int | None,
             data_parallel: int | None, rejected: list[Rejected]) -> list[tuple[int, int, int]]:
    """The (dp, pp, tp) the cluster allows, degrees given kept; why the others cannot be, into `rejected`."""
    N, D = cluster.num_devices, cluster.devices_per_node
    out = []
    for tp in [tensor_parallel] if tensor_parallel else _divisors(D):
        if tp < 1 or D % tp:
            rejected.append(Rejected(data_parallel or 1, pipeline_parallel or 1, tp,
                                     f"tp={tp} must divide the {D} devices of a node "
                                     f"(tensor parallelism stays inside a node)"))
            continue
        for pp in [pipeline_parallel] if pipeline_parallel else range(1, N // tp + 1):
            dp = data_parallel or N // (pp * tp)
            if dp < 1 or dp * pp * tp > N:
                rejected.append(Rejected(dp, pp, tp, f"needs {max(dp, 1) * pp * tp} devices, "
                                                     f"the cluster has {N}"))
                continue
            out.append((dp, pp, tp))
    return out


def search(cfg: OPTConfig, cluster: Cluster, *, model: str = "", batch_size: int = 1,
           max_seq_len: int | None = None, dtype: str = "float16", headroom: float = DEFAULT_HEADROOM,
           tensor_parallel: int | None = None, pipeline_parallel: int | None = None,
           data_parallel: int | None = None, objective: str | None = None,
           prefill_batch: int = 1, weights: str = "float32", prefix_pool: bool = True,
           use: str = "serve", draft: DraftModel | None = None) -> SearchResult:
    """Every candidate plan, feasible ones best first. Raises NoFeasiblePlan when none fits.

    Each plan has room for the prefix cache's pool beside the slots' cache; where no plan has, the plans without
    it (Plan.prefix_pool False: the runner serves without prefix caching) rather than none.

    Degrees given explicitly are kept; the others are searched. `headroom` is the fraction
    of each device's memory left free for the runtime and fragmentation. `prefill_batch`:
    prompts prefilled at once (the engine prefills one request, then inserts it into a slot). `weights`:
    "int8" for int8 weights (model/quantize.py; activations and the KV cache stay `dtype`).

    `use`: what the stages' caches are for. "serve": `batch_size` decode slots of `max_seq_len` and the prefix
    cache's pool, prompts prefilled `prefill_batch` at a time. "generate": get_model's generate() calls of up to
    `batch_size` rows of up to `max_seq_len` (the prompt's width and the new tokens, each rounded up to a power of
    two: runner.generate.Generation), each micro-batch's prompts prefilled together; no pool.

    `draft`: a served draft model (runner/draft.py), held with its rows' caches beside the first stage's first device
    (the serving process's).
    """
    max_seq_len, objective = _check_search_args(cfg, cluster, model, batch_size, max_seq_len,
                                                dtype, headroom, objective, weights, use, draft)
    prefix_pool = prefix_pool and use == "serve"
    limit = cluster.device_memory * (1 - headroom)
    plans: list[Plan] = []
    rejected: list[Rejected] = []
    for dp, pp, tp in _degrees(cluster, tensor_parallel, pipeline_parallel, data_parallel, rejected):
        r = evaluate(cfg, cluster, model, dp, pp, tp, batch_size=batch_size, max_seq_len=max_seq_len, dtype=dtype,
                     limit=limit, objective=objective, prefill_batch=prefill_batch, weights=weights,
                     pool=prefix_pool, use=use, draft=draft)
        (plans if isinstance(r, Plan) else rejected).append(r)
    if not plans and prefix_pool:
        try:
            return search(cfg, cluster, model=model, batch_size=batch_size, max_seq_len=max_seq_len, dtype=dtype,
                          headroom=headroom, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                          data_parallel=data_parallel, objective=objective, prefill_batch=prefill_batch,
                          weights=weights, prefix_pool=False, use=use, draft=draft)
        except NoFeasiblePlan:
            pass  # the reasons given with the pool counted
    if not plans:
        raise _no_plan(model, cluster, rejected)
    plans.sort(key=lambda p: p.score)
    return SearchResult(plans, rejected)


def best_plan(cfg: OPTConfig, cluster: Cluster, **kwargs) -> Plan:
    return search(cfg, cluster, **kwargs).best


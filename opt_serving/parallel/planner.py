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
import math

import numpy as np

from opt_serving.config import OPTConfig
from opt_serving.jax_env import DEFAULT_HEADROOM
from opt_serving.parallel import cost
from opt_serving.parallel.cluster import GB, Cluster
from opt_serving.parallel.slicing import slice_layers  # noqa: F401  (re-exported)
from opt_serving.runner import prefix


# what a plan's stages hold caches for: "serve", the slot runner's decode slots and prefix pool (runner/slots.py: the
# engine, `opt-serving serve`); "generate", get_model's generate() (its whole-sequence caches: runner/generate.py)
USES = ("serve", "generate")


class NoFeasiblePlan(ValueError):
    """Nothing fits; the message says by how much."""

    def __init__(self, message: str, rejected: list["Rejected"] | None = None):
        super().__init__(message)
        self.rejected = rejected or []


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    layers: tuple[int, int]          # [start, end) decoder layers
    devices: tuple[int, ...]         # device ids of replica 0 (node-major numbering)
    node: int
    has_embed: bool                  # first stage: token/position embeddings
    has_head: bool                   # last stage: final LN + logits
    param_bytes: int                 # per device
    kv_bytes: int                    # per device, all micro-batches
    act_bytes: int                   # per device, transient peak
    time: cost.StageTime             # one decode step of one micro-batch
    handoff_s: float                 # sending hidden states to the next stage (0 for the last)
    inter_node_handoff: bool
    runtime_bytes: int = 0           # per device, the runtime layout beyond the params (cost.runtime_extra_bytes)
    load_bytes: int = 0              # per device, transient while the stage loads (cost.load_bytes)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def memory_bytes(self) -> int:
        """The stage's peak on one device: its params in their runtime layout, then the larger of what
        loading them passes through (before any cache exists) and its KV cache with the activations."""
        return _peak(self.param_bytes, self.kv_bytes, self.act_bytes, self.runtime_bytes, self.load_bytes)

    @property
    def busy_s(self) -> float:
        return self.time.total_s + self.handoff_s


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    dp: int
    pp: int
    tp: int
    stages: tuple[Stage, ...]
    objective: str                   # "latency" or "throughput"
    batch_size: int                  # sequences served at once, all replicas
    micro_batches: int               # in flight per replica
    micro_batch_size: int
    max_seq_len: int
    dtype: str
    memory_limit: float              # usable bytes per device (after headroom)
    device_memory: float             # bytes per device
    step_s: float                    # seconds between two tokens of one sequence
    throughput: float                # tokens/s, all replicas
    prefill_s: float                 # one prompt of max_seq_len/2 tokens, first token
    idle_devices: int
    weights: str = "float32"         # "int8": int8 weights, activations and KV cache in `dtype`
    prefix_pool: bool = True         # room for the prefix cache's pool (runner/prefix.py) beside the slots' cache
    use: str = "serve"               # what the caches are sized for (USES)

    @property
    def name(self) -> str:
        return f"dp{self.dp} x pp{self.pp} x tp{self.tp}"

    @property
    def degrees(self) -> tuple[int, int, int]:
        return self.dp, self.pp, self.tp

    @property
    def layer_split(self) -> list[int]:
        return [s.num_layers for s in self.stages]

    @property
    def max_memory_bytes(self) -> int:
        return max(s.memory_bytes for s in self.stages)

    @property
    def score(self) -> tuple[float, float]:
        """Smaller is better."""
        if self.objective == "latency":
            return (self.step_s, -self.throughput)
        return (-self.throughput, self.step_s)

    def axis_rules(self) -> tuple[tuple[str, str | None], ...]:
        """Logical axis -> mesh axis of a stage's mesh (1-D, named "tp"); see sharding.py."""
        tp = "tp" if self.tp > 1 else None
        return (("batch", None), ("length", None), ("embed", None), ("head_dim", None),
                ("heads", tp), ("kv_heads", tp), ("mlp", tp), ("vocab", tp))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["name"] = self.name
        d["layer_split"] = self.layer_split
        for s, stage in zip(d["stages"], self.stages):
            s["memory_bytes"] = stage.memory_bytes
            s["time_s"] = stage.time.total_s
        return d


@dataclasses.dataclass(frozen=True)
class Rejected:
    dp: int
    pp: int
    tp: int
    reason: str
    need_bytes: float = 0.0          # per-device need of the best split, when memory was the problem

    @property
    def name(self) -> str:
        return f"dp{self.dp} x pp{self.pp} x tp{self.tp}"


@dataclasses.dataclass
class SearchResult:
    plans: list[Plan]                # feasible, best first
    rejected: list[Rejected]

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def why_lost(self, plan: Plan) -> str:
        return why_lost(plan, self.best)


# ---- one (dp, pp, tp) candidate ----

def _stage_kinds(pp: int) -> list[tuple[bool, bool]]:
    return [(s == 0, s == pp - 1) for s in range(pp)]


def _peak(params: int, kv: int, act: int, runtime: int = 0, load: int = 0) -> int:
    return params + runtime + max(load, kv + act)


def _stage_memory(cfg: OPTConfig, n: int, first: bool, last: bool, tp: int, batch: int,
                  micro: int, max_seq_len: int, prefill_batch: int, dtype: str,
                  weights: str = "float32", cpu: bool = False, pool: bool = True,
                  use: str = "serve") -> tuple[int, int, int, int, int]:
    """(params, KV cache, activations, runtime layout beyond the params, loading overhead) bytes per device, for
    the caches `use` keeps (USES)."""
    params = cost.stage_param_bytes(cfg, n, first, last, tp, dtype, weights)
    if use == "generate":
        # every row's whole-sequence cache, the rows prefilled a micro-batch at a time; a pipeline stage also keeps
        # the one decode slot its StageSlots is made with (RayStages' rows=1, at most max_seq_len entries), idle
        rows = batch if first and last else batch + 1
        kv = n * cost.kv_cache_bytes(cfg, rows, max_seq_len, dtype, tp)
        prefill_batch = micro
    else:
        # the decode slots' cache, and the prefix cache's pool beside it (runner/prefix.py; counted even where it is
        # turned off, unless no plan has room for it: search)
        pool = prefix.default_blocks(batch, max_seq_len) * prefix.BLOCK_SIZE if pool else 0
        kv = n * (cost.kv_cache_bytes(cfg, batch, max_seq_len, dtype, tp)
                  + cost.kv_cache_bytes(cfg, 1, pool, dtype, tp))
    act = max(cost.activation_bytes(cfg, prefill_batch, max_seq_len, dtype, tp),
              cost.activation_bytes(cfg, micro, 1, dtype, tp))
    if last:
        act += cost.logits_bytes(cfg, max(micro, prefill_batch), tp)
    runtime = cost.runtime_extra_bytes(cfg, last, tp, dtype, weights, cpu, first)
    return params, kv, act, runtime, cost.load_bytes(cfg, n, first, last, tp, dtype, weights)


def _degree_problem(cfg: OPTConfig, dp: int, pp: int, tp: int) -> Rejected | None:
    if cfg.num_attention_heads % tp or cfg.ffn_dim % tp:
        return Rejected(dp, pp, tp, f"tp={tp} does not divide {cfg.num_attention_heads} heads "
                                    f"and ffn {cfg.ffn_dim}")
    if pp > cfg.num_hidden_layers:
        return Rejected(dp, pp, tp, f"pp={pp} exceeds the {cfg.num_hidden_layers} layers")
    return None


@dataclasses.dataclass
class _Tables:
    """What the DP needs for one (pp, tp): time and memory of every stage at every layer count."""
    nodes: list[int]                 # node of each stage (replica 0)
    cost_of: np.ndarray              # [pp, L + 1] seconds, hand-off included
    mem_of: np.ndarray               # [pp, L + 1] bytes per device
    times: dict                      # (first, last, n) -> cost.StageTime
    mems: dict                       # (first, last, n) -> _stage_memory's bytes
    handoffs: list[tuple[float, bool]]   # per stage: (seconds, crosses nodes)


def _stage_tables(cfg: OPTConfig, cluster: Cluster, pp: int, tp: int, batch: int, mb: int,
                  max_seq_len: int, prefill_batch: int, dtype: str, weights: str = "float32",
                  pool: bool = True, use: str = "serve") -> _Tables:
    L = cfg.num_hidden_layers
    # stage s sits on devices [s*tp, (s+1)*tp) of replica 0; tp divides a node, so no straddling
    nodes = [cluster.node_of(s * tp) for s in range(pp)]
    t = _Tables(nodes, np.full((pp, L + 1), np.inf), np.full((pp, L + 1), np.inf), {}, {}, [])
    for s, (first, last) in enumerate(_stage_kinds(pp)):
        inter = not last and nodes[s + 1] != nodes[s]
        h = 0.0 if last else cost.handoff_time(cfg, cluster, mb, 1, inter, dtype)
        t.handoffs.append((h, inter))
        for n in range(1, L + 1):
            # stages of the same kind (first / middle / last) cost the same for n layers
            key = (first, last, n)
            if key not in t.times:
                t.times[key] = cost.stage_time(cfg, cluster.spec, n, first, last, tp, mb, 1,
                                               max_seq_len, dtype, pipelined=pp > 1, weights=weights)
                t.mems[key] = _stage_memory(cfg, n, first, last, tp, batch, mb, max_seq_len,
                                            prefill_batch, dtype, weights, cpu=cluster.spec.kind == "cpu",
                                            pool=pool, use=use)
            t.cost_of[s, n] = t.times[key].total_s + h
            t.mem_of[s, n] = _peak(*t.mems[key])
    return t


def _memory_rejection(t: _Tables, dp: int, pp: int, tp: int, limit: float) -> Rejected:
    need, split = slice_layers(t.mem_of, t.mem_of, np.inf)   # the least memory any split needs
    worst = int(np.argmax([t.mem_of[s, n] for s, n in enumerate(split)]))
    p, k, a, r, ld = t.mems[(*_stage_kinds(pp)[worst], split[worst])]
    runtime = f" + runtime layout {r / GB:.1f}" if r else ""
    return Rejected(dp, pp, tp,
                    f"needs {need / GB:.1f} GB per device (stage {worst}: {split[worst]} layers, "
                    f"weights {p / GB:.1f}{runtime} + the larger of KV cache {k / GB:.1f} + activations "
                    f"{a / GB:.1f} and loading {ld / GB:.1f} GB), usable {limit / GB:.1f} GB", need_bytes=need)


def _step_time(cluster: Cluster, stages: list[Stage], pp: int, tp: int, micro: int,
               active: int) -> float:
    busy = [st.busy_s for st in stages]
    # a micro-batch passes every stage in turn; each stage serves all micro-batches per cycle
    step = max(sum(busy), micro * max(busy))
    if pp > 1:
        step += cluster.spec.remote_call_s
    spec = cluster.spec
    if spec.shared_compute:
        # host devices: every stage of every replica runs on the same `pool` of cores
        pool = max(spec.pool, 1.0)
        step = max(step, active * micro * sum(st.time.compute_s * min(tp, pool) / pool
                                              for st in stages))
    return step


def _prefill_time(cfg: OPTConfig, cluster: Cluster, stages: list[Stage], tp: int,
                  max_seq_len: int, dtype: str) -> float:
    prompt = max(1, max_seq_len // 2)
    return sum(cost.stage_time(cfg, cluster.spec, st.num_layers, st.has_embed, st.has_head, tp,
                               1, prompt, prompt, dtype).total_s
               + (0.0 if st.has_head else cost.handoff_time(cfg, cluster, 1, prompt,
                                                            st.inter_node_handoff, dtype))
               for st in stages)


def _evaluate(cfg: OPTConfig, cluster: Cluster, model: str, dp: int, pp: int, tp: int, *,
              batch_size: int, max_seq_len: int, dtype: str, limit: float, objective: str,
              prefill_batch: int, weights: str = "float32", pool: bool = True,
              use: str = "serve") -> Plan | Rejected:
    problem = _degree_problem(cfg, dp, pp, tp)
    if problem is not None:
        return problem
    active = min(dp, batch_size)                 # replicas with work to do
    batch = math.ceil(batch_size / active)       # per replica
    micro = min(pp, batch) if objective == "throughput" else 1
    mb = math.ceil(batch / micro)
    t = _stage_tables(cfg, cluster, pp, tp, batch, mb, max_seq_len, prefill_batch, dtype, weights, pool, use)
    found = slice_layers(t.cost_of, t.mem_of, limit)
    if found is None:
        return _memory_rejection(t, dp, pp, tp, limit)
    _, split = found
    stages, start = [], 0
    for s, n in enumerate(split):
        first, last = _stage_kinds(pp)[s]
        p, k, a, r, ld = t.mems[first, last, n]
        stages.append(Stage(s, (start, start + n), tuple(range(s * tp, (s + 1) * tp)), t.nodes[s],
                            first, last, p, k, a, t.times[first, last, n], *t.handoffs[s], r, ld))
        start += n
    step = _step_time(cluster, stages, pp, tp, micro, active)
    throughput = active * batch / step
    prefill = _prefill_time(cfg, cluster, stages, tp, max_seq_len, dtype)
    return Plan(model, dp, pp, tp, tuple(stages), objective, batch_size, micro, mb, max_seq_len,
                dtype, limit, cluster.device_memory, step, throughput, prefill,
                cluster.num_devices - dp * pp * tp, weights, pool, use)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_search_args(cfg: OPTConfig, cluster: Cluster, model: str, batch_size: int,
                       max_seq_len: int | None, dtype: str, headroom: float,
                       objective: str | None, weights: str = "float32", use: str = "serve") -> tuple[int, str]:
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
    need = cost.weight_bytes(cfg, dtype, weights)
    if need > cluster.total_memory:
        raise NoFeasiblePlan(
            f"{model or 'the model'} needs {need / GB:.1f} GB of {_weights_name(dtype, weights)} weights, the cluster "
            f"has {cluster.total_memory / GB:.1f} GB ({cluster.describe()})")
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


def search(cfg: OPTConfig, cluster: Cluster, *, model: str = "", batch_size: int = 1,
           max_seq_len: int | None = None, dtype: str = "float16", headroom: float = DEFAULT_HEADROOM,
           tensor_parallel: int | None = None, pipeline_parallel: int | None = None,
           data_parallel: int | None = None, objective: str | None = None,
           prefill_batch: int = 1, weights: str = "float32", prefix_pool: bool = True,
           use: str = "serve") -> SearchResult:
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
    """
    max_seq_len, objective = _check_search_args(cfg, cluster, model, batch_size, max_seq_len,
                                                dtype, headroom, objective, weights, use)
    prefix_pool = prefix_pool and use == "serve"
    limit = cluster.device_memory * (1 - headroom)
    N, D = cluster.num_devices, cluster.devices_per_node
    tps = [tensor_parallel] if tensor_parallel else _divisors(D)
    plans: list[Plan] = []
    rejected: list[Rejected] = []
    for tp in tps:
        if tp < 1 or D % tp:
            rejected.append(Rejected(data_parallel or 1, pipeline_parallel or 1, tp,
                                     f"tp={tp} must divide the {D} devices of a node "
                                     f"(tensor parallelism stays inside a node)"))
            continue
        pps = [pipeline_parallel] if pipeline_parallel else range(1, N // tp + 1)
        for pp in pps:
            dp = data_parallel or N // (pp * tp)
            if dp < 1 or dp * pp * tp > N:
                rejected.append(Rejected(dp, pp, tp, f"needs {max(dp, 1) * pp * tp} devices, "
                                                     f"the cluster has {N}"))
                continue
            r = _evaluate(cfg, cluster, model, dp, pp, tp, batch_size=batch_size,
                          max_seq_len=max_seq_len, dtype=dtype, limit=limit,
                          objective=objective, prefill_batch=prefill_batch, weights=weights, pool=prefix_pool,
                          use=use)
            (plans if isinstance(r, Plan) else rejected).append(r)
    if not plans and prefix_pool:
        try:
            return search(cfg, cluster, model=model, batch_size=batch_size, max_seq_len=max_seq_len, dtype=dtype,
                          headroom=headroom, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                          data_parallel=data_parallel, objective=objective, prefill_batch=prefill_batch,
                          weights=weights, prefix_pool=False, use=use)
        except NoFeasiblePlan:
            pass  # the reasons given with the pool counted
    if not plans:
        raise _no_plan(model, cluster, rejected)
    plans.sort(key=lambda p: p.score)
    return SearchResult(plans, rejected)


def best_plan(cfg: OPTConfig, cluster: Cluster, **kwargs) -> Plan:
    return search(cfg, cluster, **kwargs).best


# ---- explaining ----

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

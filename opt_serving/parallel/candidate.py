"""One (dp, pp, tp) candidate of the planner's search: the time and memory of every stage at every layer count,
Alpa's DP over them (slicing.py) for the split whose slowest stage is fastest within the memory limit, and the
plan's step, throughput and prefill times -> a Plan, or why it was rejected.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from opt_serving.config import OPTConfig
from opt_serving.parallel import cost
from opt_serving.parallel.cluster import GB, Cluster
from opt_serving.parallel.plan import Plan, Rejected, Stage
from opt_serving.parallel.slicing import slice_layers
from opt_serving.parallel.stage_memory import DraftModel, peak_bytes, stage_memory


def _stage_kinds(pp: int) -> list[tuple[bool, bool]]:
    return [(s == 0, s == pp - 1) for s in range(pp)]


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
    mems: dict                       # (first, last, n) -> stage_memory's bytes
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
                t.mems[key] = stage_memory(cfg, n, first, last, tp, batch, mb, max_seq_len,
                                           prefill_batch, dtype, weights, cpu=cluster.spec.kind == "cpu",
                                           pool=pool, use=use)
            t.cost_of[s, n] = t.times[key].total_s + h
            t.mem_of[s, n] = peak_bytes(*t.mems[key])
    return t


def _memory_rejection(t: _Tables, dp: int, pp: int, tp: int, limit: float, draft: int) -> Rejected:
    need, split = slice_layers(t.mem_of, t.mem_of, np.inf)   # the least memory any split needs
    worst = int(np.argmax([t.mem_of[s, n] for s, n in enumerate(split)]))
    p, k, a, r, ld = t.mems[(*_stage_kinds(pp)[worst], split[worst])]
    runtime = f" + runtime layout {r / GB:.1f}" if r else ""
    beside = f" + the draft model {draft / GB:.1f}" if draft and worst == 0 else ""
    return Rejected(dp, pp, tp,
                    f"needs {need / GB:.1f} GB per device (stage {worst}: {split[worst]} layers, "
                    f"weights {p / GB:.1f}{runtime} + the larger of KV cache {k / GB:.1f} + activations "
                    f"{a / GB:.1f} and loading {ld / GB:.1f} GB{beside}), usable {limit / GB:.1f} GB",
                    need_bytes=need)


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


def evaluate(cfg: OPTConfig, cluster: Cluster, model: str, dp: int, pp: int, tp: int, *,
             batch_size: int, max_seq_len: int, dtype: str, limit: float, objective: str,
             prefill_batch: int, weights: str = "float32", pool: bool = True,
             use: str = "serve", draft: DraftModel | None = None) -> Plan | Rejected:
    problem = _degree_problem(cfg, dp, pp, tp)
    if problem is not None:
        return problem
    active = min(dp, batch_size)                 # replicas with work to do
    batch = math.ceil(batch_size / active)       # per replica
    micro = min(pp, batch) if objective == "throughput" else 1
    mb = math.ceil(batch / micro)
    t = _stage_tables(cfg, cluster, pp, tp, batch, mb, max_seq_len, prefill_batch, dtype, weights, pool, use)
    draft_bytes = 0 if draft is None else draft.peak_bytes(batch, max_seq_len, dtype, cluster.spec.kind == "cpu")
    t.mem_of[0] += draft_bytes  # (a served draft model runs in the serving process, beside the first stage)
    found = slice_layers(t.cost_of, t.mem_of, limit)
    if found is None:
        return _memory_rejection(t, dp, pp, tp, limit, draft_bytes)
    _, split = found
    stages, start = [], 0
    for s, n in enumerate(split):
        first, last = _stage_kinds(pp)[s]
        p, k, a, r, ld = t.mems[first, last, n]
        stages.append(Stage(s, (start, start + n), tuple(range(s * tp, (s + 1) * tp)), t.nodes[s],
                            first, last, p, k, a, t.times[first, last, n], *t.handoffs[s], r, ld,
                            draft_bytes if s == 0 else 0))
        start += n
    step = _step_time(cluster, stages, pp, tp, micro, active)
    throughput = active * batch / step
    prefill = _prefill_time(cfg, cluster, stages, tp, max_seq_len, dtype)
    return Plan(model, dp, pp, tp, tuple(stages), objective, batch_size, micro, mb, max_seq_len,
                dtype, limit, cluster.device_memory, step, throughput, prefill,
                cluster.num_devices - dp * pp * tp, weights, pool, use)


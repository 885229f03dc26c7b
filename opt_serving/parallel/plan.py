"""What a parallel plan is: its stages (layers, devices, memory and time each), its degrees and figures, and the
candidates the search turned down. The planner (planner.py) builds these; the backend, the deployment and
`opt-serving plan` read them.
"""
from __future__ import annotations

import dataclasses

from opt_serving.parallel import cost
from opt_serving.parallel.stage_memory import peak_bytes

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
    draft_bytes: int = 0             # the first stage's first device: a served draft model beside it

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def memory_bytes(self) -> int:
        """The stage's peak on one device: its params in their runtime layout, then the larger of what
        loading them passes through (before any cache exists) and its KV cache with the activations; and a
        served draft model's peak where one runs beside it."""
        return (peak_bytes(self.param_bytes, self.kv_bytes, self.act_bytes, self.runtime_bytes, self.load_bytes)
                + self.draft_bytes)

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


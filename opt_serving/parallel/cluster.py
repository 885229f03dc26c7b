"""What the planner plans for: nodes, devices per node, and how fast each part is.

Three sources, one `Cluster`:
  * text for a dry run:  `parse_cluster("4x8x16GB")`
  * the local JAX devices: `cluster_from_jax()`
  * a running Ray cluster: `cluster_from_ray()`

Text syntax (whitespace ignored, case-insensitive):

    NODESxDEVICESxMEMORY[:KIND][@key=value,key=value,...]

    4x8x16GB                       4 nodes x 8 devices x 16 GB (GB = 1e9 bytes, GiB = 2**30)
    4x8x16GB:v100                  device kind picks FLOP/s, memory and NVLink defaults
    4x8x16GB@ib=100Gbps,nvlink=300GBps,flops=125TFLOPS,hbm=900GBps

Keys: `inter` (aliases `ib`, `net`) and `intra` (alias `nvlink`) link bandwidth per device,
`flops` peak FLOP/s per device, `membw` (alias `hbm`) memory bandwidth per device, `kind`.
Bandwidth units: `Gbps`/`Mbps`/`Tbps` are bits per second, `GBps`/`GB/s`/`MBps`/`TBps` bytes.
A device kind not given is guessed from its memory size (16 or 32 GB -> v100, 40 or 80 GB -> a100 ...).
"""
from __future__ import annotations

import dataclasses
import re
import time
from opt_serving.config import OPTConfig
from opt_serving.parallel.profile import DecodeProfile, profile_decode

GB = 1e9
GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Speeds of one device kind. Peaks are datasheet numbers; `*_eff` is the fraction reached."""
    kind: str
    flops: float            # peak FLOP/s at the serving dtype (float16 tensor cores on GPUs)
    mem_bw: float           # bytes/s of device memory
    intra_bw: float         # bytes/s per device to a peer in the same node (NVLink / PCIe)
    flops_eff: float = 0.5
    mem_bw_eff: float = 0.7
    # fixed costs the bandwidth terms miss: one collective's latency, one jitted step's dispatch,
    # one pipeline hand-off between Ray actors (object store put/get + scheduling)
    collective_latency_s: float = 10e-6
    launch_overhead_s: float = 100e-6
    handoff_latency_s: float = 1e-3
    # the small ops of one layer (norms, cache write, softmax): kernel launches on a GPU,
    # per-op dispatch on a CPU; what a decode step of a small model mostly is
    layer_overhead_s: float = 30e-6
    # host "devices" (XLA_FLAGS=--xla_force_host_platform_device_count) share one pool of
    # cores: splitting work over more than `pool` of them adds no speed
    shared_compute: bool = False
    pool: float = 1.0
    # a pipeline's stages are other processes (Ray actors): the caller's call into the first
    # and the last one's reply cost one more hop than the pp - 1 hand-offs between them
    remote_call_s: float = 0.0
    # measured decode-step times of one model's stages at each tp (profile.py); when it
    # matches the stage being costed, cost.stage_time uses it instead of the roofline
    profile: DecodeProfile | None = None

    @property
    def flops_achieved(self) -> float:
        return self.flops * self.flops_eff

    @property
    def mem_bw_achieved(self) -> float:
        return self.mem_bw * self.mem_bw_eff


# Datasheet numbers (dense float16/bfloat16 tensor-core FLOP/s, HBM bandwidth, NVLink per direction).
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "v100": DeviceSpec("v100", 125e12, 900e9, 150e9),
    "a100": DeviceSpec("a100", 312e12, 1.6e12, 300e9),
    "a100-80gb": DeviceSpec("a100-80gb", 312e12, 2.0e12, 300e9),
    "h100": DeviceSpec("h100", 989e12, 3.35e12, 450e9),
    "h200": DeviceSpec("h200", 989e12, 4.8e12, 450e9),
    "a10g": DeviceSpec("a10g", 125e12, 600e9, 16e9),
    "t4": DeviceSpec("t4", 65e12, 320e9, 12e9),
    "gpu": DeviceSpec("gpu", 100e12, 1e12, 100e9),
    # a small multi-core host; calibrate() replaces these with measurements
    "cpu": DeviceSpec("cpu", 100e9, 20e9, 10e9, flops_eff=1.0, mem_bw_eff=1.0,
                      collective_latency_s=50e-6, launch_overhead_s=50e-6,
                      handoff_latency_s=2e-3, layer_overhead_s=200e-6, shared_compute=True,
                      pool=1.0),
}

_KIND_BY_MEMORY_GB = {16: "v100", 32: "v100", 40: "a100", 80: "a100-80gb", 141: "h200",
                      24: "a10g", 15: "t4"}

# 100 Gbps InfiniBand / Ethernet per node, shared by its devices' traffic
DEFAULT_INTER_BW = 100e9 / 8


@dataclasses.dataclass(frozen=True)
class Cluster:
    num_nodes: int
    devices_per_node: int
    device_memory: float    # bytes per device
    spec: DeviceSpec
    inter_bw: float = DEFAULT_INTER_BW   # bytes/s between nodes
    source: str = ""

    def __post_init__(self):
        if self.num_nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"a cluster needs at least one node and one device per node, "
                             f"got {self.num_nodes} nodes x {self.devices_per_node} devices")
        if self.device_memory <= 0:
            raise ValueError(f"device memory must be positive, got {self.device_memory} bytes")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def total_memory(self) -> float:
        return self.num_devices * self.device_memory

    def node_of(self, device: int) -> int:
        """Devices are numbered node-major: 0..D-1 on node 0, D..2D-1 on node 1, ..."""
        return device // self.devices_per_node

    def describe(self) -> str:
        return (f"{self.num_nodes}x{self.devices_per_node}x{self.device_memory / GB:g}GB "
                f"({self.spec.kind}, {self.num_devices} devices)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_spec(self, **changes) -> "Cluster":
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, **changes))


# ---- text ----

_BYTES_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_NUM = r"(\d+(?:\.\d*)?|\.\d+)"


def parse_bytes(text: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([kmgt]i?b|b)", text.strip().lower())
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 16GB or 16GiB")
    return float(m.group(1)) * _BYTES_UNITS[m.group(2)]


def parse_bandwidth(text: str) -> float:
    """'100Gbps' (bits) / '300GBps' or '300GB/s' (bytes) -> bytes per second."""
    m = re.fullmatch(_NUM + r"\s*([kKmMgGtT])(bps|B/s|Bps|b/s)", text.strip())
    if not m:
        raise ValueError(f"cannot read a bandwidth from {text!r}; write e.g. 100Gbps (bits/s) "
                         f"or 300GBps / 300GB/s (bytes/s)")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    bits = m.group(3) in ("bps", "b/s")
    return float(m.group(1)) * scale / (8 if bits else 1)


def parse_flops(text: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([kmgtp]?)(?:flops?(?:/s)?)?", text.strip().lower())
    if not m:
        raise ValueError(f"cannot read FLOP/s from {text!r}; write e.g. 125TFLOPS")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}[m.group(2)]
    return float(m.group(1)) * scale


def guess_kind(device_memory: float) -> str:
    return _KIND_BY_MEMORY_GB.get(round(device_memory / GB), "gpu")


def parse_cluster(text: str) -> Cluster:
    """`4x8x16GB[:kind][@inter=100Gbps,intra=300GBps,flops=125TFLOPS,membw=900GBps]`."""
    src = text
    text = "".join(text.split())
    head, _, opts = text.partition("@")
    head, _, kind = head.partition(":")
    m = re.fullmatch(r"(\d+)[xX](\d+)[xX](.+)", head)
    if not m:
        raise ValueError(f"cannot read cluster {src!r}: expected NODESxDEVICESxMEMORY such as "
                         f"4x8x16GB (4 nodes, 8 devices per node, 16 GB each)")
    nodes, per_node, memory = int(m.group(1)), int(m.group(2)), parse_bytes(m.group(3))
    settings: dict[str, str] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"cluster option {item!r} in {src!r} is not key=value")
        key = {"ib": "inter", "net": "inter", "nvlink": "intra", "hbm": "membw"}.get(key.lower(), key.lower())
        if key not in ("inter", "intra", "flops", "membw", "kind"):
            raise ValueError(f"unknown cluster option {key!r} in {src!r}; "
                             f"known: inter (ib), intra (nvlink), flops, membw (hbm), kind")
        settings[key] = value
    kind = (settings.pop("kind", None) or kind or guess_kind(memory)).lower()
    if kind not in DEVICE_SPECS:
        raise ValueError(f"unknown device kind {kind!r}; known: {', '.join(DEVICE_SPECS)}")
    spec = DEVICE_SPECS[kind]
    if "intra" in settings:
        spec = dataclasses.replace(spec, intra_bw=parse_bandwidth(settings["intra"]))
    if "flops" in settings:
        spec = dataclasses.replace(spec, flops=parse_flops(settings["flops"]))
    if "membw" in settings:
        spec = dataclasses.replace(spec, mem_bw=parse_bandwidth(settings["membw"]))
    inter = parse_bandwidth(settings["inter"]) if "inter" in settings else DEFAULT_INTER_BW
    return Cluster(nodes, per_node, memory, spec, inter_bw=inter, source=src)


# ---- local JAX devices ----

def _kind_from_device(device) -> str:
    name = str(getattr(device, "device_kind", "")).lower()
    if device.platform == "cpu":
        return "cpu"
    for kind in ("h200", "h100", "a100", "v100", "a10g", "t4"):
        if kind in name:
            return "a100-80gb" if kind == "a100" and "80" in name else kind
    return "gpu"


def cluster_from_jax(devices=None, spec: DeviceSpec | None = None) -> Cluster:
    """The devices this process sees, grouped into nodes by process (host)."""
    import jax
    devices = list(devices if devices is not None else jax.devices())
    by_host: dict[int, int] = {}
    for d in devices:
        by_host[d.process_index] = by_host.get(d.process_index, 0) + 1
    per_node = min(by_host.values())
    first = devices[0]
    stats = first.memory_stats() if hasattr(first, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        memory = float(stats["bytes_limit"])
    else:
        # host devices share the machine's RAM
        import psutil
        memory = psutil.virtual_memory().total / per_node
    spec = spec or DEVICE_SPECS[_kind_from_device(first)]
    return Cluster(len(by_host), per_node, memory, spec, source=f"jax:{first.platform}")


# ---- a running Ray cluster ----

def cluster_from_ray(device_memory: float | None = None, spec: DeviceSpec | None = None) -> Cluster:
    """Alive nodes of the Ray cluster this process is connected to (ray.init first).

    GPU memory is not a Ray resource, so it comes from `device_memory`, else from the
    node's accelerator type. A CPU-only cluster counts each node as one device.
    """
    import ray
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        raise RuntimeError("the Ray cluster has no alive nodes")
    gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
    if max(gpus) == 0:
        memory = device_memory or min(n["Resources"].get("memory", 0) for n in nodes)
        return Cluster(len(nodes), 1, memory, spec or DEVICE_SPECS["cpu"], source="ray:cpu")
    gpu_nodes = [n for n, g in zip(nodes, gpus) if g]
    per_node = min(g for g in gpus if g)
    accel = [k.split(":", 1)[1].lower() for k in gpu_nodes[0]["Resources"]
             if k.startswith("accelerator_type:")]
    kind = accel[0] if accel and accel[0] in DEVICE_SPECS else "gpu"
    if device_memory is None:
        defaults = {"v100": 16, "a100": 40, "a100-80gb": 80, "h100": 80, "h200": 141,
                    "a10g": 24, "t4": 16}
        if kind not in defaults:
            raise ValueError(f"cannot tell the memory of Ray's {accel or 'unnamed'} GPUs; "
                             f"pass device_memory (bytes) or use a text cluster")
        device_memory = defaults[kind] * GB
    return Cluster(len(gpu_nodes), per_node, device_memory, spec or DEVICE_SPECS[kind],
                   source="ray:gpu")


# ---- calibration ----

def _best_time(fn, *args, repeat: int = 5) -> float:
    fn(*args).block_until_ready()   # compile and warm
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def _layer_overhead(device, layers=(2, 10)) -> float:
    """Seconds per layer of a decode step whose arithmetic is negligible (hidden 64): the
    slope between a shallow and a deep narrow model is the per-layer fixed cost."""
    import jax
    import jax.numpy as jnp
    from opt_serving.model import kv_cache, param_tree, steps  # JAX: measuring only (the planner imports none)
    times = []
    for n in layers:
        cfg = OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
                        ffn_dim=256, max_position_embeddings=64, word_embed_proj_dim=64)
        params = jax.device_put(param_tree.init_params(cfg), device)
        state = {"cache": jax.device_put(kv_cache.init_cache(cfg, 1, 32), device)}
        tok = jax.device_put(jnp.zeros((1,), jnp.int32), device)

        def step():
            out, state["cache"] = steps.decode(cfg, params, state["cache"], tok, tok, tok)
            return out
        times.append(_best_time(step, repeat=20))
    return max(0.0, (times[1] - times[0]) / (layers[1] - layers[0]))


def _single_device_rates(dev, size: int) -> tuple[dict, tuple]:
    """FLOP/s, memory bandwidth, dispatch and per-layer overhead of one device. Also returns
    the matrix-vector product and its timing, which the host-pool measurement reruns split."""
    import jax
    import jax.numpy as jnp
    a = jax.device_put(jnp.ones((size, size), jnp.float32), dev)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * size ** 3 / _best_time(matmul, a)
    # a decode step's product: one token's row [1, 1, d] times a weight [d, f] reads the
    # weight once, memory bound; shaped as the model's Dense layers are
    big = jax.device_put(jnp.ones((4 * size, 4 * size), jnp.float32), dev)
    vec = jax.device_put(jnp.ones((1, 1, 4 * size), jnp.float32), dev)
    rowvec = jax.jit(lambda v, w: jnp.einsum("bsd,df->bsf", v, w))
    t1 = _best_time(rowvec, vec, big, repeat=20)
    mem_bw = big.size * 4 / t1
    tiny = jax.device_put(jnp.ones((8,), jnp.float32), dev)
    launch = _best_time(jax.jit(lambda x: x + 1), tiny, repeat=50)
    changes = dict(flops=flops, mem_bw=mem_bw, flops_eff=1.0, mem_bw_eff=1.0,
                   launch_overhead_s=launch, layer_overhead_s=_layer_overhead(dev))
    return changes, (big, vec, rowvec, t1)


def _multi_device_rates(devices, matvec: tuple) -> dict:
    """All-reduce latency and bandwidth over `devices` and, on host devices, `pool`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    big, vec, rowvec, t1 = matvec
    changes = {}
    mesh = Mesh(np.array(devices), ("x",))
    n = len(devices)
    if devices[0].platform == "cpu":
        # the same product column-split over k host devices at once (what tp does): how
        # many devices' worth of speed the shared cores give
        speedups = []
        for k in sorted({2, n} & set(range(2, n + 1))):
            sub = Mesh(np.array(devices[:k]), ("x",))
            w = jax.device_put(big, NamedSharding(sub, P(None, "x")))
            v = jax.device_put(vec, NamedSharding(sub, P()))
            speedups.append(t1 / _best_time(rowvec, v, w, repeat=20))
        changes["pool"] = float(min(n, max(1.0, *speedups)))

    def allreduce_time(elems: int) -> float:
        x = jax.device_put(jnp.ones((n, elems), jnp.float32), NamedSharding(mesh, P("x")))
        f = jax.jit(lambda v: jnp.broadcast_to(v.sum(0), v.shape),
                    out_shardings=NamedSharding(mesh, P("x")))
        return _best_time(f, x)
    small, large = allreduce_time(8), allreduce_time(1 << 20)
    # ring all-reduce moves 2(n-1)/n of the buffer per device
    moved = 2 * (n - 1) / n * (1 << 20) * 4
    changes.update(collective_latency_s=small,
                   intra_bw=moved / max(large - small, 1e-9))
    return changes


def calibrate(devices=None, base: DeviceSpec | None = None, size: int = 1024,
              model: "OPTConfig | None" = None, batch: int = 1, context: int = 256,
              dtype: str = "float32", tps: list[int] | None = None,
              stage_actors: bool = False) -> DeviceSpec:
    """Measure FLOP/s (a matmul), memory bandwidth (a matrix-vector product), dispatch
    overhead (an empty step), per-layer overhead (decode steps of narrow models), all-reduce
    cost and, on host devices, how much splitting over them speeds things up (`pool`).

    With `model`, also profile its decode stages at each tp degree (profile.py) for
    `batch` sequences and a `context`-long KV cache: the planner then costs those stages
    from what they measured, not from the rates above; `stage_actors` (Ray running) also
    times them inside pipeline-stage actors, for pp > 1 plans. The result has efficiencies of 1:
    the measured rates are what is reached.
    """
    import jax
    devices = list(devices if devices is not None else jax.devices())
    base = base or DEVICE_SPECS[_kind_from_device(devices[0])]
    changes, matvec = _single_device_rates(devices[0], size)
    if len(devices) > 1:
        changes.update(_multi_device_rates(devices, matvec))
    if model is not None:
        prof = profile_decode(model, tps, batch=batch, context=context, dtype=dtype,
                              stage_actors=stage_actors)
        changes["profile"] = prof
        if devices[0].platform == "cpu":
            # the measured split of a real layer says how far the shared cores go
            one = dict(prof.by_tp).get(1)
            if one is not None:
                best = max(one.layer_s / max(t.layer_s, 1e-12) for _, t in prof.by_tp)
                changes["pool"] = float(min(len(devices), max(changes.get("pool", 1.0), best)))
    return dataclasses.replace(base, **changes)


# A CPU stage process's own resident memory beside its params, cache and activations, by the plan's use
# (plan.USES): the interpreter, JAX and XLA and Ray's worker (0.23 GB before a stage loads), and what it compiles.
# Served, the steps of a warmed-up engine and the heap they keep (backend/cpu/heap.py): 0.70 and 0.90 GB in all in the
# two stages of OPT-1.3b at pp = 2. Through get_model, only generate()'s few whole-sequence steps: 0.31-0.34 GB in all
# in the last stage of OPT-1.3b at pp = 2 after a generate() of 8 rows x 256
# (benchmark/scale/benchmark_pipeline_memory.py; benchmark/README.md). Reported beside the planner's per-device estimate, not charged to the device's memory: on
# GPUs it is host memory.
CPU_PROCESS_BYTES = {"serve": 0.8e9, "generate": 0.35e9}


def default_process_bytes(use: str = "serve") -> float:
    return CPU_PROCESS_BYTES[use]

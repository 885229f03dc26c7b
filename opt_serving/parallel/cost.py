"""Bytes, FLOPs and seconds for pieces of an OPT model under tensor parallelism.

Everything counts from the parameter shapes of the numpy folder (`weights.param_shapes`),
so the byte counts are the real parameter counts of each size. Times follow a roofline:
a decode step is bound by reading the weights and the KV cache, a prefill by FLOPs; on
top come tensor-parallel all-reduces, pipeline hand-offs and fixed per-step overheads.
When the device spec carries a measured profile of this model's stages (profile.py,
calibrate(model=...)), a decode stage costs what it measured instead: the roofline is
for clusters this process cannot run on. No jax import here: the planner runs anywhere.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from opt_serving.config import OPTConfig
from opt_serving.model.weights import global_param_shapes, layer_param_shapes
from opt_serving.parallel.cluster import Cluster, DeviceSpec

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

# Megatron layout, in torch [out, in] terms: which dim of each parameter tensor parallelism
# splits (None = replicated). q/k/v and fc1 are column-parallel (split the output, and their
# bias), out_proj and fc2 row-parallel (split the input; bias added once after the all-reduce),
# embed_tokens vocab-parallel (also the tied logits). sharding.py must agree; a test checks.
TENSOR_PARALLEL_DIM: dict[str, int | None] = {
    "self_attn.q_proj.weight": 0, "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.weight": 0, "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.weight": 0, "self_attn.v_proj.bias": 0,
    "self_attn.out_proj.weight": 1, "self_attn.out_proj.bias": None,
    "fc1.weight": 0, "fc1.bias": 0,
    "fc2.weight": 1, "fc2.bias": None,
    "self_attn_layer_norm.weight": None, "self_attn_layer_norm.bias": None,
    "final_layer_norm.weight": None, "final_layer_norm.bias": None,
    "decoder.embed_tokens.weight": 0,
    "decoder.embed_positions.weight": None,
    "decoder.layer_norm.weight": None, "decoder.layer_norm.bias": None,
    "decoder.project_in_dim.weight": None, "decoder.project_out_dim.weight": None,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype)]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def tp_dim(name: str) -> int | None:
    """The split dim of a metaseq key (`decoder.layers.3.fc1.weight` -> 0)."""
    if name.startswith("decoder.layers."):
        name = name.split(".", 3)[3]
    return TENSOR_PARALLEL_DIM[name]


def shard_elems(name: str, shape: tuple[int, ...], tp: int) -> int:
    """Elements one device of a tp group holds (ceil: uneven splits are padded)."""
    dim = tp_dim(name)
    n = 1
    for i, d in enumerate(shape):
        n *= math.ceil(d / tp) if i == dim else d
    return n


# ---- parameters ----

@functools.lru_cache(maxsize=None)
def layer_params(cfg: OPTConfig, tp: int = 1) -> int:
    """Parameters of one decoder layer held by one device of a tp group."""
    return sum(shard_elems(k, s, tp) for k, s in layer_param_shapes(cfg, 0).items())


@functools.lru_cache(maxsize=None)
def embed_params(cfg: OPTConfig, tp: int = 1) -> int:
    """What the first stage holds besides its layers: token + position embeddings, project_in."""
    names = ("decoder.embed_tokens.weight", "decoder.embed_positions.weight",
             "decoder.project_in_dim.weight")
    g = global_param_shapes(cfg)
    return sum(shard_elems(k, g[k], tp) for k in names if k in g)


@functools.lru_cache(maxsize=None)
def head_params(cfg: OPTConfig, tp: int = 1, with_embed_tokens: bool = True) -> int:
    """What the last stage holds: final LN, project_out and (tied logits) embed_tokens."""
    names = ["decoder.layer_norm.weight", "decoder.layer_norm.bias", "decoder.project_out_dim.weight"]
    if with_embed_tokens:
        names.append("decoder.embed_tokens.weight")
    g = global_param_shapes(cfg)
    return sum(shard_elems(k, g[k], tp) for k in names if k in g)


def total_params(cfg: OPTConfig) -> int:
    """Distinct parameters: embed_tokens counted once (the logits are tied to it)."""
    return (embed_params(cfg) + head_params(cfg, with_embed_tokens=False)
            + cfg.num_hidden_layers * layer_params(cfg))


# int8 weights (model/quantize.py): every matrix but the learned positions in int8 with a float32 scale per
# output channel; the embedding stays in the model's dtype for the lookup, the tied head is an int8 copy of it
WEIGHT_FORMATS = ("float32", "int8")  # "float32": the params' own dtype
EMBED = "decoder.embed_tokens.weight"


def check_weights(weights: str) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unsupported weights {weights!r}; use one of {', '.join(WEIGHT_FORMATS)}")
    return weights


def _tensor_bytes(name: str, shape: tuple[int, ...], tp: int, b: int, int8: bool) -> int:
    """Bytes of one device's share of a tensor: `b` an element, or int8 and a float32 scale per output row."""
    n = shard_elems(name, shape, tp)
    if not int8 or len(shape) != 2 or name in (EMBED, "decoder.embed_positions.weight"):
        return n * b
    rows = math.ceil(shape[0] / tp) if tp_dim(name) == 0 else shape[0]
    return n + 4 * rows


@functools.lru_cache(maxsize=None)
def layer_bytes(cfg: OPTConfig, tp: int = 1, dtype: str = "float16", weights: str = "float32") -> int:
    """Bytes of one decoder layer's params on one device of a tp group."""
    b, int8 = dtype_bytes(dtype), check_weights(weights) == "int8"
    return sum(_tensor_bytes(k, s, tp, b, int8) for k, s in layer_param_shapes(cfg, 0).items())


@functools.lru_cache(maxsize=None)
def stage_param_bytes(cfg: OPTConfig, n_layers: int, first: bool, last: bool, tp: int = 1,
                      dtype: str = "float16", weights: str = "float32") -> int:
    """Bytes of a stage's params on one device of its tp group: its layers, the embeddings on the first stage,
    the final norm, projection and tied embedding on the last (held once by a stage that is both; with int8
    weights the last stage's head is an int8 copy, the float embedding only on the first stage)."""
    b, int8 = dtype_bytes(dtype), check_weights(weights) == "int8"
    g = global_param_shapes(cfg)
    names = set()
    if first:
        names |= {EMBED, "decoder.embed_positions.weight", "decoder.project_in_dim.weight"}
    if last:
        names |= {"decoder.layer_norm.weight", "decoder.layer_norm.bias", "decoder.project_out_dim.weight"}
        if not int8:
            names.add(EMBED)
    total = n_layers * layer_bytes(cfg, tp, dtype, weights)
    total += sum(_tensor_bytes(k, g[k], tp, b, int8) for k in names if k in g)
    if last and int8:  # the tied head's int8 copy [D, V/tp] and its scales
        v = math.ceil(cfg.vocab_size / tp)
        total += v * cfg.word_embed_proj_dim + 4 * v
    return total


def weight_bytes(cfg: OPTConfig, dtype: str = "float16", weights: str = "float32") -> int:
    """Bytes of the whole model's params (`weights="int8"`: quantized, as above)."""
    return stage_param_bytes(cfg, cfg.num_hidden_layers, True, True, 1, dtype, weights)


def runtime_extra_bytes(cfg: OPTConfig, last: bool, tp: int = 1, dtype: str = "float32", weights: str = "float32",
                        cpu: bool = False, first: bool = True) -> int:
    """Bytes a stage's runtime layout holds beyond its checkpoint params: on one CPU device with float32
    weights, the whole model's packed LM head (a float32 copy of the tied embedding in oneDNN's layout, beside
    the embedding kept for the lookup and the exact rescoring) and the greedy screen's int8 copy with its
    per-token scales and norms (backend/cpu/head.py). A pipeline's last stage holds the packed head in the
    embedding's place and no screen (model/layout.py: _vocab_only). Nothing elsewhere: GPUs and
    tensor-parallel meshes run plain XLA on the params as they are, and int8's head copy is packed in place of
    its qkernel."""
    if not (cpu and last and first and tp == 1 and dtype == "float32" and weights == "float32"):
        return 0
    v, d = cfg.vocab_size, cfg.word_embed_proj_dim
    return v * d * 4 + v * d + 3 * 4 * v


def load_bytes(cfg: OPTConfig, n_layers: int, first: bool, last: bool, tp: int = 1, dtype: str = "float32",
               weights: str = "float32") -> int:
    """Transient bytes while a stage loads, beyond its params: a stage builds its runtime layout a layer at a
    time (model/layout.py: runtime_parts), so at most one group of tensors is in transit: a layer in its
    checkpoint layout on the device, beside a host copy of its largest tensor (a transposed view made
    contiguous) and that tensor's memory-mapped file pages, and on one device its q/k/v concatenated; on the first
    and last stage, the embedding's file pages (or its float32 draw) before it is in place. (OPT-1.3b, pp = 2,
    float32 folder: 0.23 and 0.31 GB measured above the loaded stages, against 0.41 GB here; benchmark/README.md.)"""
    b = dtype_bytes(dtype)
    h, f = cfg.hidden_size, cfg.ffn_dim
    largest = math.ceil(f / tp) * h * 4  # fc1 / fc2, a float32 file and its host copy
    layer = layer_bytes(cfg, tp, dtype, weights) + 2 * largest
    if tp == 1:
        layer += 3 * h * h * (1 if weights == "int8" else b)  # the fused q/k/v
    if n_layers == 0 or not (first or last):
        return layer
    return max(layer, math.ceil(cfg.vocab_size / tp) * cfg.word_embed_proj_dim * 4)


def matmul_params(cfg: OPTConfig) -> int:
    """Weights of one layer that take part in matrix products (2 FLOPs each per token)."""
    h, f = cfg.hidden_size, cfg.ffn_dim
    return 4 * h * h + 2 * h * f


# ---- KV cache and activations ----

def kv_cache_bytes(cfg: OPTConfig, batch: int, seq_len: int, dtype: str = "float16",
                   tp: int = 1) -> int:
    """Keys and values of one layer, sharded by heads: [2, batch, seq, heads/tp, head_dim]."""
    heads = math.ceil(cfg.num_attention_heads / tp)
    return 2 * batch * seq_len * heads * cfg.head_dim * dtype_bytes(dtype)


def activation_bytes(cfg: OPTConfig, batch: int, seq_len: int, dtype: str = "float16",
                     tp: int = 1) -> int:
    """Transient working memory of one layer during a prefill of `seq_len` tokens.

    Layers run one after another, so this is a peak, not a per-layer sum: the residual and
    q/k/v/attention output (4 x hidden, q/k/v/out sharded), the ffn intermediate (sharded)
    and the float32 attention scores of this device's heads.
    """
    b = dtype_bytes(dtype)
    h, f = cfg.hidden_size, cfg.ffn_dim
    heads = math.ceil(cfg.num_attention_heads / tp)
    tokens = batch * seq_len
    hidden_like = tokens * (2 * h + 4 * math.ceil(h / tp) + math.ceil(f / tp)) * b
    scores = batch * heads * seq_len * seq_len * 4
    return hidden_like + scores


def logits_bytes(cfg: OPTConfig, batch: int, tp: int = 1) -> int:
    """float32 logits of the last position, vocab-parallel."""
    return batch * math.ceil(cfg.vocab_size / tp) * 4


# ---- FLOPs and communication ----

def layer_flops(cfg: OPTConfig, tokens: int, context: int) -> int:
    """FLOPs of one layer for `tokens` new tokens of one sequence attending to `context`."""
    return tokens * (2 * matmul_params(cfg) + 4 * context * cfg.hidden_size)


def head_flops(cfg: OPTConfig, tokens: int = 1) -> int:
    proj = cfg.hidden_size * cfg.word_embed_proj_dim if cfg.has_project_in_out else 0
    return tokens * 2 * (cfg.word_embed_proj_dim * cfg.vocab_size + proj)


def allreduce_time(nbytes: float, tp: int, spec: DeviceSpec) -> float:
    """Ring all-reduce: each device sends and receives 2(tp-1)/tp of the buffer."""
    if tp == 1:
        return 0.0
    return spec.collective_latency_s + 2 * (tp - 1) / tp * nbytes / spec.intra_bw


def allgather_time(nbytes: float, tp: int, spec: DeviceSpec) -> float:
    if tp == 1:
        return 0.0
    return spec.collective_latency_s + (tp - 1) / tp * nbytes / spec.intra_bw


# ---- one pipeline stage ----

@dataclasses.dataclass(frozen=True)
class StageTime:
    compute_s: float    # roofline of the matrix products and weight/cache reads (measured: all of it)
    comm_s: float       # tensor-parallel all-reduces and the logits all-gather (measured: in compute)
    overhead_s: float   # dispatch of one jitted step and its layers' small ops
    measured: bool = False

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.overhead_s


def stage_time(cfg: OPTConfig, spec: DeviceSpec, n_layers: int, first: bool, last: bool,
               tp: int, batch: int, tokens: int, context: int, dtype: str = "float16",
               pipelined: bool = False, weights: str = "float32") -> StageTime:
    """Seconds for one stage to run `tokens` new tokens for `batch` sequences (decode: tokens=1).
    `pipelined`: the stage is one of several (pp > 1), run in its own process. `weights="int8"`: the
    products read int8 weights (a measured profile is of float weights: the roofline is used instead)."""
    b = dtype_bytes(dtype)
    measured = (weights == "float32" and spec.profile
                and spec.profile.times(cfg, tp, batch, tokens, context, dtype, pipelined))
    if measured:
        total = measured.stage_s(n_layers, first, last)
        fixed = min(measured.dispatch_s, total)
        return StageTime(total - fixed, 0.0, fixed, measured=True)
    flops = n_layers * batch * layer_flops(cfg, tokens, context)
    read = n_layers * (layer_bytes(cfg, tp, dtype, weights) + kv_cache_bytes(cfg, batch, context, dtype, tp))
    comm = n_layers * 2 * allreduce_time(batch * tokens * cfg.hidden_size * b, tp, spec)
    if first and tp > 1:   # vocab-parallel embedding: each device looks up its rows, then sum
        comm += allreduce_time(batch * tokens * cfg.word_embed_proj_dim * b, tp, spec)
    if last:               # only the last position's logits are needed to sample
        flops += batch * head_flops(cfg, 1)
        read += stage_param_bytes(cfg, 0, False, True, tp, dtype, weights)
        comm += allgather_time(logits_bytes(cfg, batch), tp, spec)
    if spec.shared_compute:
        # host devices share the same cores: the split runs at most `pool` devices' worth faster
        whole = max(flops / spec.flops_achieved, read * tp / spec.mem_bw_achieved)
        compute = whole / min(tp, max(spec.pool, 1.0))
    else:
        compute = max(flops / tp / spec.flops_achieved, read / spec.mem_bw_achieved)
    overhead = spec.launch_overhead_s + n_layers * spec.layer_overhead_s
    return StageTime(compute, comm, overhead)


def handoff_time(cfg: OPTConfig, cluster: Cluster, batch: int, tokens: int, inter_node: bool,
                 dtype: str = "float16") -> float:
    """Hidden states passed from one stage to the next."""
    nbytes = batch * tokens * cfg.hidden_size * dtype_bytes(dtype)
    bw = cluster.inter_bw if inter_node else cluster.spec.intra_bw
    return cluster.spec.handoff_latency_s + nbytes / bw

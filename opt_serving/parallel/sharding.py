"""Tensor parallelism as a transform over the model's pure steps: logical axes -> mesh axes.

Every parameter and cache array has logical axis names ('embed', 'heads', 'mlp', 'vocab', ...);
the plan's rules table (`Plan.axis_rules()`) maps them to axes of a stage's `Mesh`. With
the tp rules that is Megatron's layout: q/k/v and fc1 column-parallel, out_proj and fc2
row-parallel, vocab-parallel embedding and logits, KV cache split by heads. The model file
is untouched: `steps.prefill` / `steps.decode` are jitted again with these shardings and XLA
inserts the all-reduces.

Each device reads only its slice of each memory-mapped weight file. int8 weights (model/quantize.py) are
split as the float ones: a qkernel as its kernel, a scale as its weight's output channels (row-parallel
layers' scales whole), the tied head's int8 copy by vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from opt_serving.backend import Backend
from opt_serving.backend.tree import at as tree_at
from opt_serving.config import OPTConfig
from opt_serving.model import opt, steps
from opt_serving.model import quantize as quantization
from opt_serving.model import sources
from opt_serving.model.kv_cache import init_cache
from opt_serving.model.weights import flax_path, param_shapes

# Logical axes of each parameter in torch's [out, in] layout (the numpy folder's).
LAYER_AXES: dict[str, tuple[str | None, ...]] = {
    "self_attn.q_proj.weight": ("heads", "embed"), "self_attn.q_proj.bias": ("heads",),
    "self_attn.k_proj.weight": ("heads", "embed"), "self_attn.k_proj.bias": ("heads",),
    "self_attn.v_proj.weight": ("heads", "embed"), "self_attn.v_proj.bias": ("heads",),
    "self_attn.out_proj.weight": ("embed", "heads"), "self_attn.out_proj.bias": ("embed",),
    "fc1.weight": ("mlp", "embed"), "fc1.bias": ("mlp",),
    "fc2.weight": ("embed", "mlp"), "fc2.bias": ("embed",),
    "self_attn_layer_norm.weight": ("embed",), "self_attn_layer_norm.bias": ("embed",),
    "final_layer_norm.weight": ("embed",), "final_layer_norm.bias": ("embed",),
}
GLOBAL_AXES: dict[str, tuple[str | None, ...]] = {
    "decoder.embed_tokens.weight": ("vocab", "embed"),
    "decoder.embed_positions.weight": (None, "embed"),
    "decoder.layer_norm.weight": ("embed",), "decoder.layer_norm.bias": ("embed",),
    "decoder.project_in_dim.weight": ("embed", None),
    "decoder.project_out_dim.weight": (None, "embed"),
}
# cache arrays: k/v [batch, heads, max_len, head_dim], mask [batch, max_len]
CACHE_KV_AXES = ("batch", "kv_heads", "length", "head_dim")
CACHE_MASK_AXES = ("batch", "length")

Rules = tuple[tuple[str, str | None], ...]
TP_RULES: Rules = (("batch", None), ("length", None), ("embed", None), ("head_dim", None),
                   ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp"))


def logical_axes(name: str) -> tuple[str | None, ...]:
    """Axes of a metaseq key in the torch layout."""
    if name in GLOBAL_AXES:
        return GLOBAL_AXES[name]
    return LAYER_AXES[name.split(".", 3)[3]]


def spec_for(axes: tuple[str | None, ...], rules: Rules) -> P:
    """The PartitionSpec of an array with these logical axes, without trailing Nones: P(None, None) and P() lay
    an array out alike, but jit tells them apart, and its outputs take one or the other (the spelling of an
    input's equal sharding, else JAX's own, trimmed). A step's cache came back as P(None, None) where an insert
    left P(), and the next step compiled again for the other."""
    table = dict(rules)
    return trimmed(*(table.get(a) if a else None for a in axes))


def trimmed(*spec: str | None) -> P:
    """P(*spec) without its trailing Nones (see spec_for): every spec this module makes is spelled so."""
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def param_spec(name: str, rules: Rules) -> P:
    """PartitionSpec of a parameter in the Flax tree's layout (kernels are [in, out])."""
    axes = logical_axes(name)
    _, transpose = flax_path(name)
    return spec_for(axes[::-1] if transpose else axes, rules)


def make_mesh(devices, tp: int | None = None) -> Mesh:
    """A 1-D mesh named 'tp' over a stage's devices."""
    devices = list(devices)
    if tp is not None and len(devices) != tp:
        raise ValueError(f"a tp={tp} stage needs {tp} devices, got {len(devices)}")
    return Mesh(np.array(devices), ("tp",))


def _check_divisible(cfg: OPTConfig, tp: int) -> None:
    for what, n in (("attention heads", cfg.num_attention_heads), ("ffn_dim", cfg.ffn_dim),
                    ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"tensor parallel degree {tp} does not divide {what} = {n}")


def _tree_set(tree: dict, path, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _flax_shape(name: str, shape) -> tuple[int, ...]:
    return tuple(shape[::-1]) if flax_path(name)[1] else tuple(shape)


def param_shardings(cfg: OPTConfig, mesh: Mesh, rules: Rules = TP_RULES, weights: str = "float32") -> dict:
    """The Flax param tree's NamedShardings (`weights="int8"`: model/quantize.py's tree)."""
    quantized = set(quantization.quantized_names(cfg)) if weights == quantization.INT8 else set()
    tree: dict = {}
    for name in param_shapes(cfg):
        path, _ = flax_path(name)
        spec = param_spec(name, rules)
        if name not in quantized:
            _tree_set(tree, path, NamedSharding(mesh, spec))
            continue
        out = (*spec_for(logical_axes(name), rules), None)[0]  # the split of its output channels ([out, in])
        if name == "decoder.embed_tokens.weight":  # the lookup's table as it was; the head [D, V] by vocabulary
            _tree_set(tree, path, NamedSharding(mesh, spec))
            path, spec = ("lm_head", "qkernel"), trimmed(None, out)
        _tree_set(tree, path[:-1] + ("qkernel",), NamedSharding(mesh, spec))
        _tree_set(tree, path[:-1] + ("scale",), NamedSharding(mesh, trimmed(out)))
    return tree


def cache_shardings(cfg: OPTConfig, mesh: Mesh, rules: Rules = TP_RULES) -> dict:
    kv = NamedSharding(mesh, spec_for(CACHE_KV_AXES, rules))
    layers = tuple(kv for _ in range(cfg.num_hidden_layers))
    return {"k": layers, "v": layers, "mask": NamedSharding(mesh, spec_for(CACHE_MASK_AXES, rules))}


def load_sharded_params(source, cfg: OPTConfig, mesh: Mesh, rules: Rules = TP_RULES, dtype=jnp.float32,
                        names=None, quantize: str | None = None) -> dict:
    """A numpy folder (or a model/sources.py source: random weights drawn where they live) -> the Flax param
    tree sharded over `mesh`; each device reads (or draws) its slice only. `names`: only these checkpoint
    tensors (a pipeline stage's). `quantize="int8"`: model/quantize.py's tree, each weight quantized as it is
    read (one at a time), or read as it is from a quantized folder."""
    return sources.merged(sharded_parts(source, cfg, mesh, rules, dtype, names, quantize))


def sharded_parts(source, cfg: OPTConfig, mesh: Mesh, rules: Rules = TP_RULES, dtype=jnp.float32, names=None,
                  quantize: str | None = None):
    """load_sharded_params a group at a time (sources.tree_parts: the tensors outside the layers, then each
    layer), for a caller that puts each group in its runtime layout before the next is read."""
    if not hasattr(source, "place"):
        source = sources.FolderSource(source, quantize)
    _check_divisible(cfg, mesh.devices.size)
    quantize = quantization.check_choice(quantize)
    shardings = param_shardings(cfg, mesh, rules, weights=quantize or "float32")
    return sources.tree_parts(source, cfg, names, lambda path: tree_at(shardings, path), dtype, quantize)


def shard_params(params: dict, cfg: OPTConfig, mesh: Mesh, rules: Rules = TP_RULES) -> dict:
    """An in-memory param tree (float or int8) -> sharded over `mesh`."""
    _check_divisible(cfg, mesh.devices.size)
    return jax.device_put(params, param_shardings(cfg, mesh, rules, quantization.weights_of(params)))


class ShardedOPT:
    """One tensor-parallel group: params, cache and jitted steps sharded over `mesh`.

    Same signatures as `steps.prefill` / `steps.decode` minus cfg and params, so generate
    code can drive it like the single-device model.
    """

    def __init__(self, cfg: OPTConfig, params: dict, mesh: Mesh, rules: Rules = TP_RULES,
                 backend: Backend = Backend.xla()):
        self.cfg, self.params, self.mesh, self.rules, self.backend = cfg, params, mesh, rules, backend
        self.dtype = opt.param_dtype(params)
        cache_sh = cache_shardings(cfg, mesh, rules)
        full = NamedSharding(mesh, P())
        # logits gathered to every device: the sampler is not sharded
        self._prefill = jax.jit(steps.prefill_step, static_argnums=(0,), static_argnames=("all_logits", "backend"),
                                donate_argnums=(2,), out_shardings=(full, cache_sh))
        self._decode = jax.jit(steps.decode_step, static_argnums=(0,), static_argnames=("backend",),
                               donate_argnums=(2,), out_shardings=(full, cache_sh))
        self._cache_sh = cache_sh

    def init_cache(self, batch: int, max_len: int) -> dict:
        return jax.device_put(init_cache(self.cfg, batch, max_len, self.dtype), self._cache_sh)

    def prefill(self, cache, input_ids, attention_mask, all_logits: bool = True):
        return self._prefill(self.cfg, self.params, cache, input_ids, attention_mask,
                             all_logits=all_logits, backend=self.backend)

    def decode(self, cache, tokens, positions, write_index):
        return self._decode(self.cfg, self.params, cache, tokens, positions, write_index, backend=self.backend)

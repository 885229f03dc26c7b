"""LoRA adapters as a transform applied to the built model (model/peft.py reads them): for each targeted linear
layer y = base(x) + scale * (x @ A^T) @ B^T, the low-rank products done per row (or per token) for the adapter
that row names, inside the same jitted step, never a merged copy of the weights per adapter.

A stage holds `LoraLayout.slots` adapters stacked ([N, ...] arrays, `stack`), each padded with zeros to the
layout's rank, for the layers it holds; `set_slot` writes one adapter (`slot_part`) into a slot. A step takes
`Lora(weights, index)`: the stack and which adapter each row uses (int32 [B], or [B, S] per token where rows of
several requests share a row, as a decode step's joining prompts do), -1 for the base model. `applied(lora)` is
the transform: a Flax method interceptor, active while a step's model is traced, that adds the low-rank products
to the targeted `Linear`s' outputs (before fc1's ReLU) and leaves the model's modules as they are. The
products (S-LoRA / Punica's idea, in XLA): a few rows (a prefill) gather their own adapter's A and B; many rows
(a decode step, tokens of many prompts) multiply by every slot's A at once, masked to each row's own adapter,
then by the stacked B, which costs slots x rank columns and no gather of [rows, in, rank] weights.

On one device the params fuse q/k/v into one qkv_proj (layout.fuse_qkv): its adapters share one x @ A (their A
side by side) and each adds its B product to its own third of the fused output. Tensor-parallel stages split A
and B as the layer they modify is split (`shardings`); int8 and bfloat16 base weights run as they are (the
adapters run in the activations' dtype). `merge` / `merge_part` fold an adapter into the base weights instead,
for a one-adapter model.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.config import OPTConfig
from opt_serving.model import quantize as quantization
from opt_serving.model.lora_config import LoraConfig, LoraLayout  # noqa: F401 (the transform's vocabulary)
from opt_serving.model.peft import ATTENTION, AdapterError, LoraAdapter, in_out
from opt_serving.parallel.sharding import LAYER_AXES, TP_RULES, Rules, spec_for

QKV = ("q_proj", "k_proj", "v_proj")


class Lora(NamedTuple):
    """What a step takes: the stacked adapters (`stack`'s tree) and each row's (or token's) adapter."""
    weights: dict
    index: Any  # int32 [B] or [B, S]; -1: the base model


def _entries(cfg: OPTConfig, layout: LoraLayout) -> list[tuple[tuple, dict]]:
    """Every targeted layer of the stage: (its path in the stage's tree, {array: shape without the slot axis});
    a layer's `a` is [in, rank] (or its q/k/v's side by side when fused), `b` [rank, out] (fused: one per
    part, named by it)."""
    r, out = layout.rank, []
    qkv = [t for t in QKV if t in layout.targets]
    for i in range(layout.stop - layout.start):
        layer = f"layers_{i}"
        if layout.fused and qkv:
            d = cfg.hidden_size
            out.append(((layer, "self_attn", "qkv_proj"), {"a": (d, len(qkv) * r), **{t: (r, d) for t in qkv}}))
        for t in layout.targets:
            if t in QKV and layout.fused:
                continue
            k, o = in_out(cfg, t)
            out.append(((layer, "self_attn", t) if t in ATTENTION else (layer, t), {"a": (k, r), "b": (r, o)}))
    return out


def _tree(entries, leaf) -> dict:
    tree: dict = {}
    for path, arrays in entries:
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = {name: leaf(path, name, shape) for name, shape in arrays.items()}
    return tree


def stack(cfg: OPTConfig, layout: LoraLayout, shardings: Optional[dict] = None) -> dict:
    """A stage's stacked adapters, all slots empty (zeros: a row naming an empty slot gets the base model's
    numbers), placed as `shardings` says (default: the default device)."""
    tree = _tree(_entries(cfg, layout), lambda path, name, shape: jnp.zeros((layout.slots,) + shape, layout.dtype))
    return tree if shardings is None else jax.device_put(tree, shardings)


def slot_part(adapter: LoraAdapter, cfg: OPTConfig, layout: LoraLayout) -> dict:
    """One adapter as one slot of `stack`'s tree (numpy, no slot axis): its modules of the stage's layers,
    zero-padded to the layout's rank; modules it does not target are zeros."""
    layout.check(adapter)
    r, dtype = layout.rank, jnp.dtype(layout.dtype)

    def padded(layer: int, target: str, which: str) -> np.ndarray:
        k, o = in_out(cfg, target)
        a, b = adapter.layers.get(layout.start + layer, {}).get(target, (None, None))
        if which == "a":
            out = np.zeros((k, r), np.float32)
            if a is not None:
                out[:, :a.shape[1]] = a
        else:
            out = np.zeros((r, o), np.float32)
            if b is not None:
                out[:b.shape[0]] = b
        return out

    def leaf(path, name, shape):
        layer = int(path[0].split("_")[1])
        if path[-1] != "qkv_proj":
            return padded(layer, path[-1], name).astype(dtype)
        if name == "a":  # the parts' A side by side
            return np.concatenate([padded(layer, t, "a") for t in QKV if t in layout.targets], 1).astype(dtype)
        return padded(layer, name, "b").astype(dtype)
    return _tree(_entries(cfg, layout), leaf)


def set_slot(weights: dict, slot, part: dict) -> dict:
    """`weights` (stack's) with slot `slot` (traced int32) holding `part` (slot_part's)."""
    return jax.tree_util.tree_map(
        lambda w, p: jax.lax.dynamic_update_index_in_dim(w, p.astype(w.dtype), slot, 0), weights, part)


def shardings(cfg: OPTConfig, layout: LoraLayout, mesh, rules: Rules = TP_RULES) -> dict:
    """The NamedShardings of a tensor-parallel stage's stack: A split as its layer's input, B as its output (a
    column-parallel q/k/v or fc1 splits B; a row-parallel out_proj or fc2 splits A, and XLA sums x @ A)."""
    from jax.sharding import NamedSharding

    def leaf(path, name, shape):
        out_axis, in_axis = LAYER_AXES[("self_attn." if path[-1] in ATTENTION else "") + path[-1] + ".weight"]
        axes = (None, in_axis, None) if name == "a" else (None, None, out_axis)
        return NamedSharding(mesh, spec_for(axes, rules))
    if layout.fused:
        raise ValueError("a tensor-parallel stage keeps q/k/v apart: its LoRA layout is not fused")
    return _tree(_entries(cfg, layout), leaf)


# ---- the transform ----

@contextlib.contextmanager
def applied(lora: Optional[Lora]):
    """While a step's model is traced (inside its jitted function): the targeted Linears of `lora.weights` gain
    their rows' low-rank products. None: the model as it is."""
    if lora is None:
        yield
        return
    with nn.intercept_methods(functools.partial(_intercept, lora)):
        yield


def with_lora(fn):
    """`fn` taking one more argument, last: a `Lora` (or None), applied while `fn` runs (is traced)."""
    def run(*args):
        with applied(args[-1]):
            return fn(*args[:-1])
    run.__name__ = run.__qualname__ = getattr(fn, "__name__", "run")  # (no __wrapped__: jit reads run's own
    return run                                                          # signature, the extra argument with it)


def _intercept(lora: Lora, next_fun, args, kwargs, context):
    entry = _entry(lora.weights, context) if context.method_name == "__call__" else None
    if entry is None:
        return next_fun(*args, **kwargs)
    m, x = context.module, args[0]
    if m.relu:  # fc1: the low-rank products go in before its ReLU, which the base product would have fused
        y = m.backend.dense(m, x, m.features, use_bias=m.use_bias, relu=False, dtype=m.dtype)
    else:
        y = next_fun(*args, **kwargs)
    parts = [t for t in QKV if t in entry] or ["b"]
    deltas = low_rank(x.astype(entry["a"].dtype), entry["a"], [entry[p] for p in parts], lora.index)
    if parts == ["b"]:
        y = y + deltas[0].astype(y.dtype)
    else:  # qkv_proj [.., 3D]: q, k and v side by side
        d = y.shape[-1] // 3
        for p, delta in zip(parts, deltas):
            at = QKV.index(p) * d
            y = y.at[..., at:at + d].add(delta.astype(y.dtype))
    return nn.relu(y) if m.relu else y


def _entry(weights: dict, context) -> Optional[dict]:
    """The module's stacked adapters, where `weights` has them at its path."""
    node = weights
    for name in context.module.path:
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node if isinstance(node, dict) and "a" in node else None


def low_rank(x, a, bs: list, index) -> list:
    """x [B, S, K] through each row's adapter: a [N, K, P * R] (P parts' A side by side), bs P arrays [N, R, O]
    -> P products [B, S, O]; index int32 [B] (a row's adapter) or [B, S] (a token's), -1: none (zeros). Rows no
    more than the slots (a prefill) gather their own adapter's weights; more rows (a decode step) or tokens of
    several prompts multiply by every slot's A at once, masked to their own."""
    n, r = a.shape[0], bs[0].shape[1]
    if index.ndim == 1 and x.shape[0] <= n:
        sel = jnp.maximum(index, 0)
        live = (index >= 0).astype(x.dtype)[:, None, None]
        xa = jnp.einsum("bsk,bkw->bsw", x, a[sel]) * live
        return [jnp.einsum("bsr,bro->bso", xa[..., p * r:(p + 1) * r], b[sel]) for p, b in enumerate(bs)]
    idx = index[:, None] if index.ndim == 1 else index  # [B, 1] or [B, S]
    mine = (idx[..., None] == jnp.arange(n)).astype(x.dtype)  # [B, 1|S, N]
    xa = jnp.einsum("bsk,nkw->bsnw", x, a) * mine[..., None]
    return [jnp.einsum("bsnr,nro->bso", xa[..., p * r:(p + 1) * r], b) for p, b in enumerate(bs)]


# ---- merged into the base weights (one adapter, no run-time cost) ----

def merge(params: dict, adapter: LoraAdapter) -> dict:
    """Checkpoint-layout params (q/k/v apart; plain or int8 kernels) with the adapter folded in: W + B A scale."""
    return merge_part(params, adapter)


def merge_part(part: dict, adapter: LoraAdapter, start: int = 0) -> dict:
    """`merge` over a group of a checkpoint-layout tree (sources.tree_parts'), whose layer i is the model's
    layer start + i; a new tree, `part` unchanged. int8 layers are dequantized, merged and quantized again."""
    out = dict(part)
    for name, layer in part.items():
        if not name.startswith("layers_"):
            continue
        mods = adapter.layers.get(start + int(name.split("_")[1]), {})
        new = {**layer, "self_attn": dict(layer.get("self_attn", {}))}
        for target, (a, b) in mods.items():
            holder = new["self_attn"] if target in ATTENTION else new
            if target not in holder:
                raise AdapterError(f"LoRA adapter {adapter.path}: cannot merge into {name}: it has no {target} "
                                   "(merge into the checkpoint's layout, q/k/v apart)")
            holder[target] = _merged(holder[target], a @ b)
        out[name] = new
    return out


def _merged(node: dict, delta: np.ndarray) -> dict:
    """A dense layer's params ({kernel} or int8 {qkernel, scale}, [in, out]) plus delta [in, out]."""
    if "kernel" in node:
        k = node["kernel"]
        merged = (jnp.asarray(k, jnp.float32) + delta).astype(k.dtype)
        return {**node, "kernel": jax.device_put(merged, k.sharding) if hasattr(k, "sharding") else merged}
    q, scale = node["qkernel"], node["scale"]
    w = np.asarray(q, np.float32) * np.asarray(scale, np.float32)[None, :] + delta
    q8, s8 = quantization.quantize_rows(np.ascontiguousarray(w.T))
    put = (lambda x, like: jax.device_put(x, like.sharding)) if hasattr(q, "sharding") else (lambda x, like: x)
    return {**node, "qkernel": put(np.ascontiguousarray(q8.T), q), "scale": put(s8, scale)}

"""The param tree's layouts: the checkpoint's (q_proj / k_proj / v_proj, plain kernels), and the runtime one
the steps run fastest on where the params lie, with the `Backend` that runs it (`runtime_params`).
Transforms applied after the model is built; the forward pass gives the same numbers in either layout."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import Backend, BackendSettings, choose, devices, for_params
from opt_serving.backend.cpu import heap
from opt_serving.config import OPTConfig
from opt_serving.model import opt, param_tree

QKV = ("q_proj", "k_proj", "v_proj")


def runtime_params(params: dict, settings: Optional[BackendSettings] = None,
                   weights: str = "float32") -> tuple[Backend, dict]:
    """Checkpoint-layout params -> (the backend chosen where they lie (backend.for_params), the params in its
    runtime layout): on one device q/k/v fused (fuse_qkv), then what that backend packs (Backend.prepare).
    `weights`: the dense weights' format (Backend.weights; "int8" for model/quantize.py's params)."""
    fused = fuse_qkv_on_one_device(params)
    backend = for_params(fused, settings, weights)
    return backend, backend.prepare(fused)


def runtime_parts(parts: Iterable[dict], where: Iterable, dtype, settings: Optional[BackendSettings] = None,
                  weights: str = "float32", head: bool = True) -> tuple[Backend, dict]:
    """runtime_params over params arriving a group at a time (sources.tree_parts: the tensors outside the
    layers first, then one layer after another): each group is put in the runtime layout as it arrives and its
    checkpoint-layout arrays are dropped, so the peak is the runtime params plus one group, where building the
    whole checkpoint tree first held both. The backend is chosen for `where` (the devices the params lie on)
    and `dtype`, as for_params would choose it for the whole tree. `head`: the params hold the LM head (a
    pipeline's last stage, or the whole model); a first stage keeps its embedding for the lookup only, with no
    packed head beside it."""
    where = list(where)
    backend = choose(where, dtype, settings, weights)
    out: dict = {}
    on_cpu = all(d.platform == "cpu" for d in where)
    with heap.returning_freed_blocks() if on_cpu else contextlib.nullcontext():
        for part in parts:
            embedding = part.get("embed_tokens", {}).get("embedding")
            head_only = head and embedding is not None and "embed_positions" not in part  # a pipeline's last stage
            if embedding is not None and backend.greedy_head and (head_only or not (
                    head and np.isfinite(np.asarray(embedding)).all())):
                backend = dataclasses.replace(backend, greedy_head=False)  # for_params's rule; no head, no screen
            rest = part if head else {k: v for k, v in part.items() if k != "embed_tokens"}
            out.update(backend.prepare(fuse_qkv(rest) if len(where) <= 1 else rest))
            if not head and embedding is not None:
                out["embed_tokens"] = part["embed_tokens"]
            if head_only and "packed" in out.get("lm_head", {}):
                out["embed_tokens"] = {"embedding": _vocab_only(embedding.shape[0], where[0])}
            del part, rest, embedding
    if backend.greedy_head and not head:
        backend = dataclasses.replace(backend, greedy_head=False)
    return backend, out


def _vocab_only(vocab: int, device):
    """A pipeline's last stage that is not also its first reads the tied embedding only as its packed head
    (Backend.logits; the lookup is the first stage's): the float32 embedding [V, D] is dropped, a [V, 0] array on
    its device left for its vocabulary size. Without it the screened greedy head (which rescores its candidates
    from the embedding's rows) is off there: the stage would hold the vocabulary's weights two and a half times
    over for a few percent of a step, where a pipeline is the plan because memory is short."""
    return jax.device_put(np.zeros((vocab, 0), np.float32), device)


def checkpoint_params(cfg: OPTConfig, backend: Backend, params: dict) -> dict:
    """runtime_params undone for a whole model's params: the checkpoint's layout."""
    like = param_tree.param_tree_shapes(cfg, fused_qkv=opt.is_fused(params))
    if backend.weights == "int8":  # model/quantize.py's names: qkernel for kernel, and the LM head's own
        like = _renamed(like, "kernel", "qkernel")
        like["lm_head"] = {"qkernel": jax.ShapeDtypeStruct(like["embed_tokens"]["embedding"].shape[::-1], jnp.int8)}
    return unfuse_qkv(backend.plain(params, like))


def _renamed(tree: dict, old: str, new: str) -> dict:
    return {(new if k == old else k): (_renamed(v, old, new) if isinstance(v, dict) else v) for k, v in tree.items()}


def fuse_qkv(params: dict) -> dict:
    """The same params with each layer's q, k and v projections as one qkv_proj [D, 3D].

    XLA's CPU matmul runs one wide product faster than three narrow ones (benchmark/README.md).
    For one device only: a tensor-parallel plan splits q, k and v by heads separately."""
    out = dict(params)
    for name, layer in params.items():
        attn = layer.get("self_attn", {}) if name.startswith("layers_") else {}
        if "q_proj" not in attn:
            continue
        parts = [attn[n] for n in QKV]
        fused = {key: jnp.concatenate([p[key] for p in parts], axis=-1) for key in parts[0]}  # kernel/qkernel, scale, bias
        rest = {k: v for k, v in attn.items() if k not in QKV}
        out[name] = {**layer, "self_attn": {**rest, "qkv_proj": fused}}
    return out


def fuse_qkv_on_one_device(params: dict) -> dict:
    """fuse_qkv when every parameter sits on one device; a sharded (tensor-parallel) tree as it is."""
    return fuse_qkv(params) if len(devices(params)) <= 1 else params


def unfuse_qkv(params: dict) -> dict:
    """fuse_qkv undone: the checkpoint's layout (q_proj, k_proj, v_proj)."""
    out = dict(params)
    for name, layer in params.items():
        attn = layer.get("self_attn", {}) if name.startswith("layers_") else {}
        if "qkv_proj" not in attn:
            continue
        parts = {key: jnp.split(attn["qkv_proj"][key], 3, axis=-1) for key in attn["qkv_proj"]}
        rest = {k: v for k, v in attn.items() if k != "qkv_proj"}
        rest.update({n: {key: parts[key][i] for key in parts} for i, n in enumerate(QKV)})
        out[name] = {**layer, "self_attn": rest}
    return out

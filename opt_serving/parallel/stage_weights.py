"""Which layers each pipeline stage holds, and reading them on the stage's own node: each stage reads only its slice
of the numpy folder, from its own node's disk, a layer at a time (or, for random weights, draws only its slice from
the seed: model/sources.py), and puts each layer in its runtime layout before reading the next, so a stage process
holds its share once.
"""
from __future__ import annotations

import socket

import numpy as np

from opt_serving.config import OPTConfig

# JAX, the model and Ray are imported in the functions that use them: a stage actor sets its devices (XLA_FLAGS,
# jax_env) before JAX loads in its process


def split_layers(num_layers: int, pp: int, layer_split: list[int] | None = None) -> list[range]:
    split = layer_split or [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
    if len(split) != pp or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"layer split {split} does not cover {num_layers} layers in {pp} stages")
    starts = np.cumsum([0, *split])
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def stage_specs(cfg: OPTConfig, pp: int, layer_split: list[int] | None = None):
    from opt_serving.model.opt import StageSpec
    ranges = split_layers(cfg.num_hidden_layers, pp, layer_split)
    return [StageSpec(r.start, r.stop, i == 0, i == pp - 1) for i, r in enumerate(ranges)]


def load_stage_params(source, cfg: OPTConfig, spec, dtype="float32", mesh=None, quantize=None) -> dict:
    """One stage's tensors in the checkpoint layout, its Flax tree (layers numbered from 0), over `mesh`
    (default: this process's first device): from a numpy folder, memory-mapped, each device reading only its
    own slice of each file, or drawn from a seed (model/sources.py's RandomSource: the whole model's numbers,
    each device drawing its slice). `quantize="int8"`: int8 weights, quantized as they are read or read from a
    quantized folder. A node without the files gets an error naming the node and the path."""
    from opt_serving.model import sources
    return sources.merged(_stage_parts(source, cfg, spec, dtype, mesh, quantize))


def load_stage(source, cfg: OPTConfig, spec, dtype="float32", mesh=None, quantize=None, merge_lora=None):
    """load_stage_params in the runtime layout of the backend chosen for where the stage lies ->
    (backend, params): each group (the tensors outside the layers, then each layer) is put in that layout as it
    is read and its host and checkpoint-layout copies dropped, so the stage never holds its share twice.
    `merge_lora`: a LoRA adapter (model/peft.py's) merged into the stage's layers as they are read."""
    import jax
    from opt_serving.model import layout
    where = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    return layout.runtime_parts(_stage_parts(source, cfg, spec, dtype, mesh, quantize, merge_lora), where,
                                jax.numpy.dtype(dtype), weights=quantize or "float32", head=spec.last)


def _stage_parts(source, cfg, spec, dtype, mesh, quantize, merge_lora=None):
    import jax
    from opt_serving.model import param_tree
    from opt_serving.model import sources
    from opt_serving.parallel.sharding import make_mesh, sharded_parts
    if not hasattr(source, "place"):
        source = sources.FolderSource(source, quantize)
    if isinstance(source, sources.FolderSource):
        folder = source.folder
        if not (folder / "decoder.embed_tokens.weight").exists() and not (folder / "config.json").exists():
            raise FileNotFoundError(f"node {node_name()} has no numpy weights folder at {folder}: every node "
                                    "that runs a pipeline stage reads its layers from the same path (copy the "
                                    "folder there, or use a shared file system)")
    mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], 1)
    # int8: the first and last stages read the embedding (the lookup's table, the head's int8 copy); each
    # keeps only its own part of the two (param_tree.stage_part)
    parts = sharded_parts(source, cfg, mesh, dtype=dtype, names=stage_param_names(cfg, spec), quantize=quantize)
    if merge_lora is not None:  # (the layers numbered as the model's, before the stage's own numbering)
        from opt_serving.model.lora import merge_part
        parts = (merge_part(part, merge_lora) for part in parts)
    try:
        for part in parts:
            yield param_tree.stage_part(part, spec)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"node {node_name()}: {e}") from None


def stage_param_names(cfg: OPTConfig, spec) -> set[str]:
    """The checkpoint names a stage holds: param_tree.stage_params's cut of the model, applied to a tree of names."""
    import jax
    from opt_serving.model import param_tree
    from opt_serving.model.weights import flax_path, param_shapes
    from opt_serving.parallel.sharding import _tree_set
    tree: dict = {}
    for name in param_shapes(cfg):
        _tree_set(tree, flax_path(name)[0], name)
    return set(jax.tree_util.tree_leaves(param_tree.stage_params(tree, spec)))



def node_name() -> str:
    import ray
    if not ray.is_initialized():  # get_runtime_context() would start a Ray of its own
        return socket.gethostname()
    return f"{socket.gethostname()} (Ray node {ray.get_runtime_context().get_node_id()[:12]})"

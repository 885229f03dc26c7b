"""The param tree outside a forward pass: random params of a config's shapes, its shapes without allocating
it, and a whole model's tree cut to one pipeline stage's."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opt_serving.config import OPTConfig
from opt_serving.model import sources
from opt_serving.model.opt import OPT, StageSpec


def init_params(cfg: OPTConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02, names=None):
    """Random params (normal(0, std) weights, zero biases, unit norms), as `dummy=True` uses: each tensor
    drawn from its own key, derived from (seed, its name) (model/sources.py), so a subset (`names`: checkpoint
    keys, e.g. a pipeline stage's) holds exactly the numbers of the whole model's tree.

    Drawn on the device one tensor at a time (never two copies of the model)."""
    return sources.merged(sources.tree_parts(sources.RandomSource(seed, std), cfg, names, dtype=dtype))


def stage_params(params: dict, stage: StageSpec) -> dict:
    """A whole model's param tree (checkpoint layout) cut down to one stage's: its layers numbered
    from 0, the embeddings on the first stage, the final norm, projection and tied embedding on the last (an
    int8 model's last stage: its head's int8 copy, and the embedding only where it is also first, for the
    lookup)."""
    out = {f"layers_{i - stage.start}": params[f"layers_{i}"] for i in range(stage.start, stage.stop)}
    out.update(stage_globals(params, stage))
    return out


def stage_part(part: dict, stage: StageSpec) -> dict:
    """One group of sources.tree_parts (the tensors outside the layers, or a layer) cut to the stage as
    stage_params cuts a whole tree: its layers renumbered from the stage's first."""
    out = {f"layers_{int(k[7:]) - stage.start}": v for k, v in part.items()
           if k.startswith("layers_") and stage.start <= int(k[7:]) < stage.stop}
    out.update(stage_globals(part, stage))
    return out


def stage_globals(params: dict, stage: StageSpec) -> dict:
    """What of the tensors outside the layers a stage keeps (see stage_params)."""
    keep = set()
    if stage.first or (stage.last and "lm_head" not in params):
        keep.add("embed_tokens")
    if stage.first:
        keep |= {"embed_positions", "project_in"}
    if stage.last:
        keep |= {"project_out", "layer_norm", "lm_head"}
    return {k: v for k, v in params.items() if k in keep}


def param_tree_shapes(cfg: OPTConfig, fused_qkv: bool = False) -> dict:
    """The Flax param tree's shapes (plain XLA layout; q/k/v fused with `fused_qkv`), without allocating it."""
    b = jnp.zeros((1, 1), jnp.int32)
    attends = [lambda q, k, v: (q, None)] * cfg.num_hidden_layers
    return jax.eval_shape(lambda: OPT(cfg, fused_qkv=fused_qkv).init(jax.random.PRNGKey(0), b, b, attends)["params"])


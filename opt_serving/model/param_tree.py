"""The param tree outside a forward pass: random params of a config's shapes, its shapes without allocating
it, and a whole model's tree cut to one pipeline stage's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.config import OPTConfig
from opt_serving.model.opt import OPT, StageSpec


def init_params(cfg: OPTConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02):
    """Random params (normal(0, std) weights, zero biases, unit norms), as `dummy=True` uses.

    Drawn on the host one tensor at a time (no compile, never two copies of the model)."""
    rng = np.random.default_rng(seed)

    def make(path, leaf):
        name = path[-1].key
        if name == "bias":
            return jnp.zeros(leaf.shape, dtype)
        if name == "scale":
            return jnp.ones(leaf.shape, dtype)
        host = rng.standard_normal(leaf.shape, np.float32) * np.float32(std)
        return jax.device_put(host.astype(dtype))

    return jax.tree_util.tree_map_with_path(make, param_tree_shapes(cfg))


def stage_params(params: dict, stage: StageSpec) -> dict:
    """A whole model's param tree (checkpoint layout) cut down to one stage's: its layers numbered
    from 0, the embeddings on the first stage, the final norm, projection and tied embedding on the last (an
    int8 model's last stage: its head's int8 copy, and the embedding only where it is also first, for the
    lookup)."""
    out = {f"layers_{i - stage.start}": params[f"layers_{i}"] for i in range(stage.start, stage.stop)}
    keep = set()
    if stage.first or (stage.last and "lm_head" not in params):
        keep.add("embed_tokens")
    if stage.first:
        keep |= {"embed_positions", "project_in"}
    if stage.last:
        keep |= {"project_out", "layer_norm", "lm_head"}
    out.update({k: v for k, v in params.items() if k in keep})
    return out


def param_tree_shapes(cfg: OPTConfig, fused_qkv: bool = False) -> dict:
    """The Flax param tree's shapes (plain XLA layout; q/k/v fused with `fused_qkv`), without allocating it."""
    b = jnp.zeros((1, 1), jnp.int32)
    attends = [lambda q, k, v: (q, None)] * cfg.num_hidden_layers
    return jax.eval_shape(lambda: OPT(cfg, fused_qkv=fused_qkv).init(jax.random.PRNGKey(0), b, b, attends)["params"])


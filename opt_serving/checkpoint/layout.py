"""How a source parameter maps onto the numpy folder: unit, Megatron glue rule, names.

Megatron split OPT's layers over P model-parallel parts: column-parallel linears
(q/k/v, fc1) and the vocab-parallel embedding are cut along dim 0 (weights and biases),
row-parallel linears (out_proj, fc2) along dim 1 (their biases replicated), and every
layer norm and the learned positions are replicated. A part's fused `qkv_proj` is
[K_p; V_p; Q_p], so it is split in three before gluing, never concatenated whole.
"""
from __future__ import annotations

import re

from opt_serving.config import OPT_CONFIGS, OPTConfig
from opt_serving.checkpoint.formats import CheckpointError
from opt_serving.model.weights import global_param_shapes, layer_param_shapes

ROWS, COLS, QKV, REPLICATED = "rows", "cols", "qkv", "replicated"
GLOBALS = "globals"

# source keys that carry no weights of their own
IGNORED_KEYS = re.compile(r"(^|\.)version$|_float_tensor$|^decoder\.output_projection\.weight$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def unit_of(key: str) -> str:
    m = _LAYER_RE.match(key)
    return f"layer.{int(m[1])}" if m else GLOBALS


def units(cfg: OPTConfig) -> list[str]:
    return [GLOBALS] + [f"layer.{i}" for i in range(cfg.num_hidden_layers)]


def unit_shapes(cfg: OPTConfig, unit: str) -> dict[str, tuple[int, ...]]:
    """Output arrays of one unit, by metaseq key."""
    if unit == GLOBALS:
        return global_param_shapes(cfg)
    return layer_param_shapes(cfg, int(unit.split(".")[1]))


def rule(key: str) -> str:
    if key == "decoder.embed_tokens.weight":
        return ROWS
    if ".qkv_proj." in key:
        return QKV
    if re.search(r"\.(q_proj|k_proj|v_proj|fc1)\.(weight|bias)$", key):
        return ROWS
    if re.search(r"\.(out_proj|fc2)\.weight$", key):
        return COLS
    return REPLICATED


def qkv_outputs(key: str) -> tuple[str, str, str]:
    """Output keys of the three thirds of a fused qkv parameter, in stored (K, V, Q) order."""
    return tuple(key.replace(".qkv_proj.", f".{n}_proj.") for n in "kvq")


def local_shape(global_shape: tuple[int, ...], r: str, num_parts: int) -> tuple[int, ...]:
    """The shape one model-parallel part holds of a global parameter."""
    if r == ROWS:
        return (global_shape[0] // num_parts,) + tuple(global_shape[1:])
    if r == COLS:
        return (global_shape[0], global_shape[1] // num_parts)
    return tuple(global_shape)


def expected_local_shapes(cfg: OPTConfig, num_parts: int, fused_qkv: bool) -> dict[str, tuple[int, ...]]:
    """Every source key one part should hold, with its shape."""
    out: dict[str, tuple[int, ...]] = {}
    for unit in units(cfg):
        for key, shape in unit_shapes(cfg, unit).items():
            if fused_qkv and re.search(r"\.(q|k|v)_proj\.", key):
                if ".q_proj." in key:
                    fused = key.replace(".q_proj.", ".qkv_proj.")
                    out[fused] = (3 * shape[0] // num_parts,) + tuple(shape[1:])
                continue
            out[key] = local_shape(shape, rule(key), num_parts)
    return out


def check_divisible(cfg: OPTConfig, num_parts: int, where: str) -> None:
    for dim, name in ((cfg.vocab_size, "vocab_size"), (cfg.hidden_size, "hidden_size"),
                      (cfg.ffn_dim, "ffn_dim")):
        if dim % num_parts:
            raise CheckpointError(f"{where}: {name} {dim} does not split over {num_parts} parts")


# ---- config from a metaseq checkpoint ----

def _get(obj, name):
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def metaseq_model_args(ckpt: dict):
    """The model section of a metaseq/fairseq cfg: cfg['model'] (dict or Namespace) or legacy 'args'."""
    cfg = ckpt.get("cfg")
    model = _get(cfg, "model") if cfg is not None else None
    return model if model is not None else ckpt.get("args")


def config_from_metaseq(ckpt: dict, shapes: dict[str, tuple[int, ...]], num_parts: int,
                        where: str, override: OPTConfig | None = None) -> OPTConfig:
    """OPTConfig from the checkpoint's cfg, with sizes read off the (part-local) shapes."""
    if override is not None:
        return override
    args = metaseq_model_args(ckpt)
    try:
        vocab, embed_dim = shapes["decoder.embed_tokens.weight"]
        positions, hidden = shapes["decoder.embed_positions.weight"]
    except KeyError as e:
        raise CheckpointError(f"{where}: no {e.args[0]} in the checkpoint") from None
    layers = 1 + max((int(m[1]) for k in shapes if (m := _LAYER_RE.match(k))), default=-1)
    fc1 = shapes.get("decoder.layers.0.fc1.weight")
    ffn = fc1[0] * num_parts if fc1 else 4 * hidden
    heads = _get(args, "decoder_attention_heads")
    if heads is None:
        same = [c for c in OPT_CONFIGS.values() if c.hidden_size == hidden]
        if not same:
            raise CheckpointError(f"{where}: the checkpoint has no cfg giving decoder_attention_heads "
                                  f"and hidden size {hidden} matches no OPT preset; pass --config")
        heads = same[0].num_attention_heads
    pre_ln = _get(args, "decoder_normalize_before")
    if pre_ln is None:
        pre_ln = "decoder.layer_norm.weight" in shapes
    cfg_layers = _get(args, "decoder_layers")
    if cfg_layers is not None and cfg_layers != layers:
        raise CheckpointError(f"{where}: cfg says {cfg_layers} layers but the weights hold {layers}")
    return OPTConfig(vocab_size=vocab * num_parts, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=int(heads), ffn_dim=ffn,
                     max_position_embeddings=positions - OPTConfig.position_offset,
                     word_embed_proj_dim=embed_dim, do_layer_norm_before=bool(pre_ln))


def architecture_signature(ckpt: dict) -> tuple:
    """The cfg fields that must agree between shards of one model."""
    args = metaseq_model_args(ckpt)
    return tuple(_get(args, k) for k in ("decoder_layers", "decoder_embed_dim", "decoder_attention_heads",
                                         "decoder_ffn_embed_dim", "decoder_normalize_before",
                                         "decoder_input_dim", "max_target_positions"))

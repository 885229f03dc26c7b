"""The numpy weights folder: Alpa's layout, so existing Alpa weights load as they are.

One file per parameter, named exactly as the metaseq key, written with
`np.save` to an open file (so no `.npy` suffix); linear weights in torch's
`[out, in]` layout; `config.json` with Hugging Face `OPTConfig` fields beside
them. Loading memory-maps each file, so the weights are never held twice.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from opt_serving.config import OPTConfig

LAYER_PREFIX = "decoder.layers.{i}."

# per-layer parameter suffixes, in the order a layer is written
_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.out_proj", "fc1", "fc2")
_LAYER_NORMS = ("self_attn_layer_norm", "final_layer_norm")


def global_param_shapes(cfg: OPTConfig) -> dict[str, tuple[int, ...]]:
    """Parameters outside the decoder layers."""
    shapes = {
        "decoder.embed_tokens.weight": (cfg.vocab_size, cfg.word_embed_proj_dim),
        "decoder.embed_positions.weight": (cfg.max_position_embeddings + cfg.position_offset,
                                           cfg.hidden_size),
    }
    if cfg.has_final_layer_norm:
        shapes["decoder.layer_norm.weight"] = (cfg.hidden_size,)
        shapes["decoder.layer_norm.bias"] = (cfg.hidden_size,)
    if cfg.has_project_in_out:
        shapes["decoder.project_in_dim.weight"] = (cfg.hidden_size, cfg.word_embed_proj_dim)
        shapes["decoder.project_out_dim.weight"] = (cfg.word_embed_proj_dim, cfg.hidden_size)
    return shapes


def layer_param_shapes(cfg: OPTConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Parameters of decoder layer `i` (torch `[out, in]` layout for linears)."""
    h, f = cfg.hidden_size, cfg.ffn_dim
    linear_shapes = {
        "self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
        "self_attn.out_proj": (h, h), "fc1": (f, h), "fc2": (h, f),
    }
    p = LAYER_PREFIX.format(i=i)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in _LAYER_LINEARS:
        out_dim, in_dim = linear_shapes[name]
        shapes[f"{p}{name}.weight"] = (out_dim, in_dim)
        shapes[f"{p}{name}.bias"] = (out_dim,)
    for name in _LAYER_NORMS:
        shapes[f"{p}{name}.weight"] = (h,)
        shapes[f"{p}{name}.bias"] = (h,)
    return shapes


def param_shapes(cfg: OPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by metaseq key."""
    shapes = global_param_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        shapes.update(layer_param_shapes(cfg, i))
    return shapes


def save_array(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write one parameter file the way Alpa did: np.save to an open file, no suffix."""
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array))


def load_array(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """Memory-map one parameter file. Raises a clear error for a missing or corrupt file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"missing weight file {path}")
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"corrupt weight file {path}: {e}") from None


def load_checked(folder: str | os.PathLike, name: str, shape: tuple[int, ...],
                 mmap: bool = True) -> np.ndarray:
    """Load `folder/name` and check its shape against the config's."""
    arr = load_array(Path(folder) / name, mmap=mmap)
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"shape mismatch in weight file {Path(folder) / name}: "
                         f"file has {tuple(arr.shape)}, the config expects {tuple(shape)}")
    return arr


def load_numpy_folder(folder: str | os.PathLike, cfg: OPTConfig | None = None,
                      mmap: bool = True) -> tuple[OPTConfig, dict[str, np.ndarray]]:
    """All parameters of a numpy folder, memory-mapped, shape-checked."""
    folder = Path(folder)
    if cfg is None:
        cfg = OPTConfig.from_hf_json(folder / "config.json")
    return cfg, {name: load_checked(folder, name, shape, mmap=mmap)
                 for name, shape in param_shapes(cfg).items()}


def save_numpy_folder(folder: str | os.PathLike, cfg: OPTConfig,
                      params: dict[str, np.ndarray]) -> None:
    """Write a whole parameter dict (metaseq keys) plus config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise KeyError(f"parameters missing for this config: {missing[:5]}")
    for name, shape in expected.items():
        arr = np.asarray(params[name])
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(arr.shape)} != expected {shape}")
        save_array(folder / name, arr)
    cfg.save_hf_json(folder)

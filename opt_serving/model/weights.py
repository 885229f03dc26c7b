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

from opt_serving.config import OPTConfig, size_from_name

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


def resolve_numpy_folder(path: str | os.PathLike, model_name: str) -> Path:
    """`path` itself, or Alpa's `<path>/<name>-np` (also accepting `<path>/<size>-np`)."""
    path = Path(path)
    try:
        size = size_from_name(model_name)
        candidates = [path, path / f"opt-{size}-np", path / f"{size}-np"]
    except ValueError:  # not a preset: the name is a label for the folder itself ("jax/my-finetune")
        candidates = [path]
    for c in candidates:
        if (c / "config.json").exists() or (c / "decoder.embed_tokens.weight").exists():
            return c
    raise FileNotFoundError(f"no numpy weights folder for {model_name!r}: tried "
                            + ", ".join(str(c) for c in candidates))


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
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"corrupt weight file {path}: {e}") from None
    if arr.dtype == np.dtype("V2"):  # np.save records bfloat16 as 2 raw bytes
        import ml_dtypes
        arr = arr.view(ml_dtypes.bfloat16)
    return arr


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


# ---- Flax param tree (opt_serving.model.opt.OPT) <-> metaseq keys ----

_GLOBAL_PATHS = {
    "decoder.embed_tokens.weight": (("embed_tokens", "embedding"), False),
    "decoder.embed_positions.weight": (("embed_positions", "embedding"), False),
    "decoder.layer_norm.weight": (("layer_norm", "ln", "scale"), False),
    "decoder.layer_norm.bias": (("layer_norm", "ln", "bias"), False),
    "decoder.project_in_dim.weight": (("project_in", "kernel"), True),
    "decoder.project_out_dim.weight": (("project_out", "kernel"), True),
}


def flax_path(name: str) -> tuple[tuple[str, ...], bool]:
    """Metaseq key -> (path in the Flax param tree, whether to transpose [out, in] -> [in, out])."""
    if name in _GLOBAL_PATHS:
        return _GLOBAL_PATHS[name]
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["decoder", "layers"]:
        raise KeyError(f"not an OPT parameter name: {name!r}")
    layer, module, leaf = f"layers_{parts[2]}", parts[3:-1], parts[-1]
    if module[-1].endswith("layer_norm"):
        return (layer, *module, "ln", {"weight": "scale", "bias": "bias"}[leaf]), False
    return (layer, *module, {"weight": "kernel", "bias": "bias"}[leaf]), leaf == "weight"


# HF OPTForCausalLM state-dict names that differ from metaseq's
_HF_RENAMES = (("decoder.project_in.", "decoder.project_in_dim."),
               ("decoder.project_out.", "decoder.project_out_dim."),
               ("decoder.final_layer_norm.", "decoder.layer_norm."))


def hf_key_to_metaseq(key: str) -> str | None:
    """'model.decoder.project_in.weight' -> 'decoder.project_in_dim.weight'; None for lm_head (tied)."""
    if key.startswith("lm_head."):
        return None
    key = key.removeprefix("model.")
    for hf, ms in _HF_RENAMES:
        if key.startswith(hf):
            return ms + key[len(hf):]
    return key


def metaseq_key_to_hf(name: str) -> str:
    for hf, ms in _HF_RENAMES:
        if name.startswith(ms):
            return "model." + hf + name[len(ms):]
    return "model." + name


def set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def params_from_arrays(cfg: OPTConfig, arrays, dtype=None, progress: bool = False) -> dict:
    """Metaseq-keyed arrays (a mapping, or a callable name -> array) -> Flax param tree on device.

    One tensor at a time: each is converted (transpose, dtype) into one host
    copy, put on the device, and dropped, so a memory-mapped folder is never
    held twice."""
    import jax
    import jax.numpy as jnp
    dtype = jnp.dtype(dtype or jnp.float32)
    get = arrays if callable(arrays) else arrays.__getitem__
    shapes = param_shapes(cfg)
    names = shapes.items()
    if progress:
        from tqdm import tqdm
        names = tqdm(names, desc="loading weights", unit="tensor")
    tree: dict = {}
    for name, shape in names:
        arr = get(name)
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"shape mismatch for {name}: got {tuple(arr.shape)}, "
                             f"the config expects {tuple(shape)}")
        path, transpose = flax_path(name)
        host = np.asarray(arr.T if transpose else arr)
        set_path(tree, path, jax.device_put(np.ascontiguousarray(host, dtype=dtype)))
        del host
    return tree


def load_params(folder: str | os.PathLike, cfg: OPTConfig | None = None, dtype=None,
                progress: bool = False) -> tuple[OPTConfig, dict]:
    """A numpy folder -> (config, Flax param tree), memory-mapped and shape-checked per file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"numpy weights folder {folder} does not exist")
    if cfg is None:
        cfg = OPTConfig.from_hf_json(folder / "config.json")
    shapes = param_shapes(cfg)
    return cfg, params_from_arrays(cfg, lambda n: load_checked(folder, n, shapes[n]), dtype,
                                   progress)


def params_from_hf_state_dict(cfg: OPTConfig, state_dict, dtype=None) -> dict:
    """A Hugging Face OPTForCausalLM state dict (torch tensors or arrays) -> Flax param tree."""
    arrays = {}
    for k, v in state_dict.items():
        name = hf_key_to_metaseq(k)
        if name is not None:
            arrays[name] = v.detach().float().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
    missing = sorted(set(param_shapes(cfg)) - set(arrays))
    if missing:
        raise KeyError(f"HF state dict lacks {missing[:5]}")
    return params_from_arrays(cfg, arrays, dtype)


def params_to_arrays(cfg: OPTConfig, params: dict) -> dict[str, np.ndarray]:
    """Flax param tree -> metaseq-keyed numpy arrays in torch [out, in] layout (for saving)."""
    out = {}
    for name in param_shapes(cfg):
        path, transpose = flax_path(name)
        node = params
        for p in path:
            node = node[p]
        a = np.asarray(node)
        out[name] = a.T if transpose else a
    return out

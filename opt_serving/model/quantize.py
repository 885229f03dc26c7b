"""int8 weights: a transform applied to a model's params after they are built (as gpt-fast does),
and the numpy folder that stores them so a large model loads a quarter of the bytes.

Scheme: symmetric, one scale per output channel (the layout CTranslate2 and SmoothQuant-style
tools use): w[out, in] ~= q[out, in] * scale[out], q in [-127, 127], scale = max |w[out, :]| / 127.
Every linear layer's weight and the tied embedding (whose output channels, as the LM head, are the
tokens) are quantized; layer norms, biases and the learned positions stay as they are.

In the Flax tree a quantized dense layer holds `qkernel` (int8 [in, out]) and `scale` ([out],
float32) in place of `kernel`; the tied head is `lm_head: {qkernel [K, V], scale [V]}` and the
embedding the lookup reads is the dequantized one, so the head and the lookup use the same numbers
whether the folder was quantized on disk or the model at load.

A quantized numpy folder is Alpa's layout with each quantized weight file holding int8 and a
`<name>.scale` file beside it, and `quantization.json` saying so.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from opt_serving.backend.tree import dense_paths, fresh_at
from opt_serving.config import OPTConfig
from opt_serving.model import weights
from opt_serving.settings import Settings

INT8 = "int8"
CHOICES = (INT8,)
SCALE_SUFFIX = ".scale"
MARKER = "quantization.json"
# a block of rows quantized at a time (16 MB of float32, whatever the width): a weight is never held twice in
# float32, and a block stays in cache between its passes; the blocks go to one thread per CPU
_ELEMENTS_PER_BLOCK = 1 << 22


def check_choice(quantize: Optional[str]) -> Optional[str]:
    if quantize in (None, "", "none"):
        return None
    if quantize not in CHOICES:
        raise ValueError(f"quantize={quantize!r}: choose one of {', '.join(CHOICES)} (or none)")
    return quantize


def quantized_names(cfg: OPTConfig) -> list[str]:
    """The metaseq keys whose weights int8 quantizes: every matrix but the learned positions."""
    return [n for n, shape in weights.param_shapes(cfg).items()
            if len(shape) == 2 and n != "decoder.embed_positions.weight"]


def quantize_rows(w) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] (any float dtype; anything with a shape whose row slices give arrays: a memory-mapped file, a
    random matrix drawn as it is read) -> (int8 [out, in], float32 scale [out]), blocks of rows at a time, on
    every CPU this process may use (each block's rows are quantized on their own: the same numbers)."""
    if not hasattr(w, "shape"):
        w = np.asarray(w)
    q = np.empty(w.shape, np.int8)
    scale = np.empty(w.shape[0], np.float32)
    rows = max(1, _ELEMENTS_PER_BLOCK // max(1, w.shape[1]))

    def block_at(r0: int) -> None:
        block = np.asarray(w[r0:r0 + rows], np.float32)
        if not np.isfinite(block).all():
            raise ValueError("cannot quantize a weight holding NaN or infinity")
        top = np.abs(block).max(axis=1)
        s = np.where(top > 0, top / 127.0, 1.0).astype(np.float32)
        q[r0:r0 + len(block)] = np.clip(np.rint(block / s[:, None]), -127, 127)
        scale[r0:r0 + len(block)] = s

    for _ in _pool(os.getpid()).map(block_at, range(0, w.shape[0], rows)):  # raises the first block's error
        pass
    return q, scale


@functools.cache
def _pool(pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """quantize_rows' threads (numpy lets go of the GIL over a block's passes); one pool a process, by pid: a
    forked child has none of its parent's threads."""
    return concurrent.futures.ThreadPoolExecutor(Settings.from_env().threads(), thread_name_prefix="quantize")


def dequantize_rows(q, scale, dtype=np.float32) -> np.ndarray:
    return (np.asarray(q, np.float32) * np.asarray(scale, np.float32)[:, None]).astype(dtype)


# ---- the Flax tree ----

def quantize_params(params: dict) -> dict:
    """A float params tree -> the int8 one (see the module docstring); the input is left as it was."""
    import jax
    out = dict(params)
    for path in list(dense_paths(params, "kernel")):
        node = fresh_at(out, path)
        # [out, in], transposed where the kernel lies (a device's copy arrives in rows) and widened a block at a time
        q, scale = quantize_rows(np.asarray(node.pop("kernel").T))
        node["qkernel"], node["scale"] = jax.device_put(q).T, jax.device_put(scale)  # turned on the device
    if "embed_tokens" in params:
        embedding = params["embed_tokens"]["embedding"]
        q, scale = quantize_rows(np.asarray(embedding))
        out["embed_tokens"] = {"embedding": jax.device_put(dequantize_rows(q, scale, embedding.dtype))}
        out["lm_head"] = {"qkernel": jax.device_put(q).T, "scale": jax.device_put(scale)}
    return out


# ---- the numpy folder ----

def folder_quantization(folder: str | os.PathLike) -> Optional[str]:
    """"int8" for a quantized numpy folder, None for a plain one."""
    marker = Path(folder) / MARKER
    if not marker.exists():
        return None
    try:
        kind = json.loads(marker.read_text())["weights"]
    except (ValueError, KeyError) as e:
        raise ValueError(f"corrupt {marker}: {e}") from None
    return check_choice(kind)


def write_marker(folder: str | os.PathLike) -> None:
    (Path(folder) / MARKER).write_text(json.dumps(
        {"weights": INT8, "scheme": "symmetric, one float32 scale per output channel",
         "scale_files": f"<name>{SCALE_SUFFIX}"}, indent=2) + "\n")


def quantize_file(folder: Path, name: str) -> None:
    """Replace the float weight file `folder/name` by its int8 one and `name.scale` (via temporary names,
    so an interrupted run leaves either the float file or both quantized files complete)."""
    q, scale = quantize_rows(weights.load_array(folder / name))
    weights.save_array(folder / (name + SCALE_SUFFIX + ".tmp"), scale)
    weights.save_array(folder / (name + ".int8.tmp"), q)
    os.replace(folder / (name + SCALE_SUFFIX + ".tmp"), folder / (name + SCALE_SUFFIX))
    os.replace(folder / (name + ".int8.tmp"), folder / name)


def load_quantized(folder: str | os.PathLike, name: str, shape) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [out, in], scale [out]) of one weight of a quantized folder, shape-checked."""
    q = weights.load_checked(folder, name, shape)
    scale = weights.load_checked(folder, name + SCALE_SUFFIX, (shape[0],))
    if q.dtype != np.int8:
        raise ValueError(f"{Path(folder) / name}: a quantized folder's weight must be int8, found {q.dtype}")
    return q, scale


def weights_of(params: dict) -> str:
    """A params tree's dense weights format: "int8" when it holds quantized layers (qkernel), else "float32"."""
    return INT8 if any(True for _ in dense_paths(params, "qkernel")) else "float32"


def tree_entries(name: str, q, scale, dtype=np.float32) -> list[tuple[tuple, np.ndarray]]:
    """One quantized checkpoint weight (q int8 [out, in], scale [out]) -> its (Flax path, array) entries:
    qkernel [in, out] (a transposed view) and scale for a dense layer; for the embedding its dequantized
    lookup table and the tied head's qkernel [D, V] and scale."""
    path, _ = weights.flax_path(name)
    if name == "decoder.embed_tokens.weight":
        return [(path, dequantize_rows(q, scale, dtype)), (("lm_head", "qkernel"), np.asarray(q).T),
                (("lm_head", "scale"), np.asarray(scale, np.float32))]
    return [(path[:-1] + ("qkernel",), np.asarray(q).T), (path[:-1] + ("scale",), np.asarray(scale, np.float32))]


def load_weight(folder: Path, name: str, shape, quantized_folder: bool) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [out, in], scale [out]) of one weight: read as it is from a quantized folder, quantized from a
    plain one (memory-mapped, a block of rows at a time)."""
    if quantized_folder:
        return load_quantized(folder, name, shape)
    return quantize_rows(weights.load_checked(folder, name, shape))


def load_params(folder: str | os.PathLike, cfg: OPTConfig, dtype=None) -> dict:
    """A numpy folder (quantized or not) -> the int8 params tree: int8 files read as they are, float ones
    quantized a weight at a time from the file (as a tensor-parallel or pipelined plan loads them:
    parallel/sharding.py's load_sharded_params), so the whole model is never held in float."""
    import jax
    folder = Path(folder)
    on_disk = folder_quantization(folder) is not None
    dtype = np.dtype(dtype or np.float32)
    quantized = set(quantized_names(cfg))
    tree: dict = {}
    for name, shape in weights.param_shapes(cfg).items():
        if name not in quantized:
            arr = weights.load_checked(folder, name, shape)
            weights.set_path(tree, weights.flax_path(name)[0], jax.device_put(np.ascontiguousarray(arr, dtype=dtype)))
            continue
        for at, arr in tree_entries(name, *load_weight(folder, name, shape, on_disk), dtype):
            weights.set_path(tree, at, jax.device_put(np.ascontiguousarray(arr)))
    return tree

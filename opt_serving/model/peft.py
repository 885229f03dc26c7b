"""PEFT's LoRA adapter folders read without torch: `adapter_config.json` and `adapter_model.safetensors` ->
a `LoraAdapter` for one OPT config, checked against it, with every refusal naming the file and the problem.

What is read: LoRA (`peft_type` "LORA") on any of OPT's decoder linear layers (q_proj, k_proj, v_proj,
out_proj, fc1, fc2), any rank, scaled by lora_alpha / r (rsLoRA's lora_alpha / sqrt(r) with `use_rslora`). What is
refused, saying so: DoRA, trained biases (`bias` other than "none"), `modules_to_save` (fully trained copies of
other modules), per-module `rank_pattern` / `alpha_pattern`, targets OPT has no LoRA path for (the embedding,
the LM head), pickled `adapter_model.bin` (never unpickled here: PEFT writes safetensors by default), and an
adapter whose shapes do not fit the model (another OPT size). The safetensors file is parsed here (its header is
JSON, its tensors raw little-endian arrays): numpy has no bfloat16 for safetensors' own numpy API, and adapters
trained in bfloat16 are common.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Optional

import ml_dtypes
import numpy as np

from opt_serving.config import OPTConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
TARGETS = ATTENTION + ("fc1", "fc2")  # every decoder linear layer, in the order the tree holds them
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
# base_model.model.model.decoder.layers.3.self_attn.q_proj.lora_A.weight (the adapter's name, when kept, after lora_A)
_KEY = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(?:self_attn\.)?(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be read or does not fit the model; the message names the file and the problem."""


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One LoRA adapter in the checkpoint's terms: per decoder layer and target, (a [in, r], b [r, out]) in
    float32 with the scale (alpha / r) folded into b, so a layer's output gains (x @ a) @ b."""
    layers: dict  # layer index -> {target: (a, b)}
    rank: int     # the largest rank of its modules
    targets: tuple[str, ...]
    fingerprint: bytes  # a hash of its config and weights: the prefix cache's key for its prompts
    path: str = ""
    base_model: Optional[str] = None


def in_out(cfg: OPTConfig, target: str) -> tuple[int, int]:
    """(in, out) features of a decoder layer's linear layer."""
    d, f = cfg.hidden_size, cfg.ffn_dim
    return {"fc1": (d, f), "fc2": (f, d)}.get(target, (d, d))


def targets_of(path) -> tuple[str, ...]:
    """The targets of the adapter folder at `path`, from its weights file's header alone (a server sizes its
    adapter slots before the model is loaded); AdapterError for a folder that is no PEFT adapter."""
    where = Path(path) / WEIGHTS_FILE
    try:
        with open(where, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {path}: cannot read {WEIGHTS_FILE} ({e})") from None
    found = {m.group(2) for m in map(_KEY.search, header) if m is not None}
    return tuple(t for t in TARGETS if t in found)


def read_peft(path, cfg: OPTConfig) -> LoraAdapter:
    """The PEFT adapter folder at `path` (or its adapter_config.json) for a model of `cfg` (see the module
    docstring); AdapterError naming what is wrong."""
    folder = Path(path)
    folder = folder.parent if folder.name == CONFIG_FILE else folder
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter {folder}: no such folder")
    config = _config(folder)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        bin_note = (" (adapter_model.bin is a pickle, which is not loaded: save the adapter with PEFT's default "
                    "safe_serialization=True)") if (folder / "adapter_model.bin").exists() else ""
        raise AdapterError(f"LoRA adapter {folder}: no {WEIGHTS_FILE}{bin_note}")
    data = weights_path.read_bytes()
    tensors = read_safetensors(data, weights_path)
    layers, rank = _layers(tensors, cfg, config, weights_path)
    digest = hashlib.blake2b(json.dumps(config, sort_keys=True).encode() + data, digest_size=16).digest()
    targets = tuple(t for t in TARGETS if any(t in mods for mods in layers.values()))
    return LoraAdapter(layers, rank, targets, digest, str(folder), config.get("base_model_name_or_path"))


def _config(folder: Path) -> dict:
    """adapter_config.json, with what this reader cannot apply refused."""
    where = folder / CONFIG_FILE
    if not where.is_file():
        raise AdapterError(f"LoRA adapter {folder}: no {CONFIG_FILE}")
    try:
        config = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r} is not supported (only LoRA adapters)")
    for key, unsupported in (("use_dora", "DoRA adapters are not supported"),
                             ("modules_to_save", "modules_to_save (fully trained copies of modules) are not "
                                                 "supported"),
                             ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
                             ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
                             ("fan_in_fan_out", "fan_in_fan_out weights (GPT-2's Conv1D) do not fit OPT's layers")):
        if config.get(key):
            raise AdapterError(f"{where}: {unsupported} ({key}: {config[key]!r:.60})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: trained biases (bias: {config['bias']!r}) are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        kinds = int if key == "r" else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
            raise AdapterError(f"{where}: {key} must be a positive {'integer' if key == 'r' else 'number'}, "
                               f"got {value!r:.40}")
    return config


def read_safetensors(data: bytes, where) -> dict[str, np.ndarray]:
    """A safetensors file's tensors (its bytes given) as numpy arrays viewing them."""
    if len(data) < 8:
        raise AdapterError(f"{where}: truncated (not a safetensors file)")
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        raise AdapterError(f"{where}: not a safetensors file (its header is not JSON)") from None
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise AdapterError(f"{where}: tensor {key} has dtype {info.get('dtype')}, not a float one")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * np.dtype(dtype).itemsize or 8 + n + end > len(data):
            raise AdapterError(f"{where}: tensor {key} is truncated or its offsets are wrong")
        out[key] = np.frombuffer(data, dtype, math.prod(shape), 8 + n + begin).reshape(shape)
    return out


def _layers(tensors: dict, cfg: OPTConfig, config: dict, where) -> tuple[dict, int]:
    """The tensors as {layer: {target: (a [in, r], b [r, out] scaled)}}, each checked against the model."""
    pairs: dict = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"{where}: {key} is not a LoRA weight of an OPT decoder linear layer "
                               f"({', '.join(TARGETS)}); this adapter targets something else")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS:
            raise AdapterError(f"{where}: {key} targets {target}, which has no LoRA path here (only "
                               f"{', '.join(TARGETS)})")
        if layer >= cfg.num_hidden_layers:
            raise AdapterError(f"{where}: {key} is for layer {layer}, but the model has "
                               f"{cfg.num_hidden_layers} layers: {_other_model(config)}")
        pairs.setdefault((layer, target), {})[which] = value
    if not pairs:
        raise AdapterError(f"{where}: holds no LoRA weights")
    layers: dict = {}
    rank = 0
    for (layer, target), ab in sorted(pairs.items()):
        name = f"layer {layer} {target}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: {name} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]  # torch's [r, in] and [out, r]
        d_in, d_out = in_out(cfg, target)
        r = a.shape[0] if a.ndim == 2 else -1
        if r != config["r"]:
            raise AdapterError(f"{where}: {name}: lora_A has rank {r} but {CONFIG_FILE} says r = {config['r']}")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise AdapterError(f"{where}: {name}: lora_A {a.shape} and lora_B {b.shape} do not fit the model's "
                               f"[{d_in} in, {d_out} out] layer (expected [r, {d_in}] and [{d_out}, r]): "
                               f"{_other_model(config)}")
        scale = _scale(config)
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not (np.isfinite(a32).all() and np.isfinite(b32).all()):
            raise AdapterError(f"{where}: {name} holds NaN or infinity")
        layers.setdefault(layer, {})[target] = (np.ascontiguousarray(a32.T), np.ascontiguousarray(b32.T * scale))
        rank = max(rank, r)
    return layers, rank


def _scale(config: dict) -> float:
    """PEFT's scaling of the low-rank product: lora_alpha / r, or rsLoRA's lora_alpha / sqrt(r)."""
    alpha, r = float(config["lora_alpha"]), config["r"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _other_model(config: dict) -> str:
    base = config.get("base_model_name_or_path")
    return "the adapter was trained for another model" + (f" ({base})" if base else "")

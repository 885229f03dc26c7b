"""Random LoRA adapters in PEFT's on-disk format, written with numpy alone (tests, benchmarks): the folder PEFT's
`save_pretrained` writes for a LoRA of OPTForCausalLM (adapter_config.json, adapter_model.safetensors with its
`base_model.model.model.decoder.layers.{i}.{module}.lora_{A,B}.weight` keys). Unlike PEFT's own init, B is not
zero, so the adapter changes the model's numbers."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from opt_serving.config import OPTConfig

MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
           "out_proj": "self_attn.out_proj", "fc1": "fc1", "fc2": "fc2"}
_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16"}


def write_safetensors(path, tensors: dict) -> None:
    """numpy arrays (float32, float16, bfloat16) as a safetensors file."""
    header, blobs, at = {}, [], 0
    for key, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[key] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        blobs.append(a.tobytes())
        at += a.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def write_adapter(folder, cfg: OPTConfig, targets: Sequence[str] = ("q_proj", "v_proj"), rank: int = 8,
                  alpha: float = 16, seed: int = 0, std: float = 0.1, use_rslora: bool = False,
                  layers: Optional[Sequence[int]] = None, dtype=np.float32, base_model: str = "facebook/opt-test",
                  **config) -> Path:
    """A random LoRA adapter of `cfg`'s model on `targets` of `layers` (default: every layer) in PEFT's format in
    `folder`; `config`: more adapter_config.json fields. -> the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    d, f = cfg.hidden_size, cfg.ffn_dim
    tensors = {}
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        for t in targets:
            k, o = {"fc1": (d, f), "fc2": (f, d)}.get(t, (d, d))
            key = f"base_model.model.model.decoder.layers.{i}.{MODULES[t]}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, k)) * std).astype(dtype)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((o, rank)) * std).astype(dtype)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
        "use_rslora": use_rslora, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, **config}))
    return folder

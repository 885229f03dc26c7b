"""Reader for Hugging Face `save_pretrained` OPT folders (safetensors or pytorch_model.bin).

HF names differ from metaseq's in three places (decoder.final_layer_norm is metaseq's
decoder.layer_norm; project_in/out are project_in_dim/out_dim) and carry a `model.`
prefix when saved from OPTForCausalLM (facebook/opt-* .bin files were saved without it).
"""
from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open

from opt_serving.config import OPTConfig
from opt_serving.checkpoint import layout
from opt_serving.checkpoint.formats import CheckpointError, Detected
from opt_serving.checkpoint.metaseq import _check_against_expected
from opt_serving.checkpoint.torch_io import load_pt
from opt_serving.checkpoint.writer import CHUNK
from opt_serving.model.weights import hf_key_to_metaseq


class HfReader:
    def __init__(self, detected: Detected, override: OPTConfig | None = None):
        self.root = detected.root
        self.files = detected.all_files
        try:
            self.config = override or OPTConfig.from_hf_json(self.root / "config.json")
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{self.root / 'config.json'}: {e}") from None
        self.num_parts = 1
        self.safetensors = self.files[0].suffix == ".safetensors"
        self.index: dict[str, tuple[Path, str]] = {}  # metaseq name -> (file, HF key)
        shapes: dict[str, tuple[int, ...]] = {}
        self.bins = {}
        for path in self.files:
            if self.safetensors:
                try:
                    with safe_open(path, framework="pt") as f:
                        keys = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
                except Exception as e:
                    raise CheckpointError(f"cannot read {path} (truncated or corrupt?): {e}") from None
            else:
                mf = self.bins[path] = load_pt(path)
                keys = {k: tuple(v.shape) for k, v in mf.data.items()}
            for hf_key, shape in keys.items():
                name = hf_key_to_metaseq(hf_key)
                if name is not None:
                    self.index[name] = (path, hf_key)
                    shapes[name] = shape
        self.shapes = shapes
        _check_against_expected(self.config, 1, False, shapes,
                                {k: p for k, (p, _) in self.index.items()}, self.files, 0)

    def read_unit(self, unit: str, writer) -> None:
        wanted = [k for k in self.index if layout.unit_of(k) == unit]
        if not self.safetensors:
            for name in wanted:
                path, hf_key = self.index[name]
                writer.put(name, 0, 0, self.bins[path].data[hf_key].reshape(-1), path,
                           release=self.bins[path].release)
            return
        for name in wanted:
            path, hf_key = self.index[name]
            rows, *rest = self.shapes[name]
            row = math.prod(rest)
            step = max(1, CHUNK // max(row, 1))
            for r0 in range(0, rows, step):
                # a block of rows per opening: closing the file unmaps it, so only this
                # block's pages were ever resident (the header parse is cheap)
                with safe_open(path, framework="pt") as f:
                    block = f.get_slice(hf_key)[r0:r0 + step].reshape(-1)
                writer.put(name, 0, r0 * row, block, path)

    def release(self) -> None:
        for mf in self.bins.values():
            mf.release()

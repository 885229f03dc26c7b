"""get_model(): the notebook's entry point. A model name and its options are parsed once into a `ModelSpec`
(spec.py) and the spec picks the model:

    model = get_model("jax/opt-125m", "/data/opt-125m-np")          # the Flax model on one device
    model = get_model("facebook/opt-125m", "/data/opt-125m-hf")     # Hugging Face's PyTorch model (reference)
    model = get_model("alpa/opt-tiny", folder, tensor_parallel=2)   # the planner's plan (parallel/backend.py)
    model.generate(input_ids, max_new_tokens=8)
    model = get_model("jax/opt-125m", folder, lora="/data/my-peft-lora")  # a PEFT LoRA adapter on every row
    model = get_model("jax/opt-125m", folder, lora="/data/my-peft-lora", merge_lora=True)  # merged into the weights

`opt_serving.model.wrapper.get_model`, where notebooks have always imported it, is this function.
"""
from __future__ import annotations

import difflib
import inspect
from pathlib import Path

from opt_serving.errors import require
from opt_serving.model import loader
from opt_serving.model.peft import read_peft
from opt_serving.model import quantize as quantization
from opt_serving.parallel import backend as parallel
from opt_serving.runner.generate import Generation
from opt_serving.spec import PREFIXES, TORCH, ModelSpec

__all__ = ["PREFIXES", "get_model"]


def get_model(model_name: str, path: str | Path | None = None, dtype="auto",
              tensor_parallel: int | None = None, pipeline_parallel: int | None = None,
              dummy: bool = False, seed: int = 0, quantize: str | None = None, lora: str | Path | None = None,
              merge_lora: bool = False, **kwargs):
    """Load an OPT model by name (spec.py's prefixes: jax/, facebook/, alpa/). `quantize="int8"`: every dense
    weight and the LM head in int8 with a scale per output channel (model/quantize.py), from any numpy
    folder (a quantized one is read as it is). `dtype="bfloat16"` on a CPU with native bfloat16 products
    keeps float32 activations and runs the products on bfloat16 weights. An alpa/ model takes the planner's
    options too (batch_size, max_seq_len, cluster, device_memory, micro_batches: parallel/backend.py).
    `lora`: a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) the model runs with: its
    low-rank products beside the base weights (model/lora.py), or with `merge_lora=True` merged into the weights
    as they are read (no cost a step; int8 weights are merged, then quantized again). facebook/ applies it with
    PEFT itself (the reference; peft must be installed)."""
    quantize = quantization.check_choice(quantize)
    spec = ModelSpec.parse(model_name, path, dummy=dummy, seed=seed, tensor_parallel=tensor_parallel,
                           pipeline_parallel=pipeline_parallel, quantize=quantize)
    _check_options(spec, kwargs)
    if spec.parallel:
        loader.check_quantize_dtype(quantize, dtype)
        return parallel.get_alpa_model(spec, dtype=dtype, lora=lora, merge_lora=merge_lora, **kwargs)
    if spec.backend == TORCH:
        if quantize:  # the engine runs facebook/ weights on the Flax model, which quantizes; the reference does not
            raise ValueError(f"{model_name}: quantize={quantize!r} applies to jax/ and alpa/ models (facebook/ is "
                             "Hugging Face's PyTorch model, the reference)")
        return _reference_lora(loader.reference_model(spec, dtype), lora, merge_lora)
    m = loader.local_model(spec, dtype, progress=kwargs.get("progress", False),
                           merge_lora=lora if merge_lora else None)
    return Generation.of(m, None if lora is None or merge_lora else read_peft(lora, m.config))


# what get_model takes beyond its own parameters: an alpa/ model's planner options (parallel/backend.py)
PLANNER_OPTIONS = ("batch_size", "max_seq_len", "cluster", "device_memory", "micro_batches", "handoff")


def _check_options(spec: ModelSpec, kwargs: dict) -> None:
    """A keyword the model would not use is refused, naming it, before anything loads (a misspelt option silently
    dropped would load a model other than the one asked for)."""
    used = {"progress"} | (set(PLANNER_OPTIONS) if spec.parallel else set())
    unknown = sorted(set(kwargs) - used)
    if not unknown:
        return
    known = [n for n in inspect.signature(get_model).parameters if n != "kwargs"] + ["progress", *PLANNER_OPTIONS]
    hints = [f"{n!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(n, known, 1)) else repr(n)
             for n in unknown]
    planner = [n for n in unknown if n in PLANNER_OPTIONS]
    why = f"; {', '.join(planner)}: the planner's options, for alpa/ models only" if planner else ""
    raise TypeError(f"get_model({spec.name!r}) got arguments it does not use: {', '.join(hints)}{why}")


def _reference_lora(model, lora, merge: bool):
    """Hugging Face's model with the adapter as PEFT applies it (merged: PEFT's merge_and_unload)."""
    if lora is None:
        return model
    peft = require("peft", "torch", "a LoRA adapter on facebook/ (Hugging Face's model, with PEFT)")
    model = peft.PeftModel.from_pretrained(model, str(lora)).eval()
    return model.merge_and_unload() if merge else model

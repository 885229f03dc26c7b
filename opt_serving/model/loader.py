"""A model spec's weights -> the model on one device: `local_model` (the Flax model, model/wrapper.py's
OPTModel) and `reference_model` (Hugging Face's PyTorch OPTForCausalLM, facebook/'s: the reference and
baseline). get_model (opt_serving/models.py) picks between them and the parallel backend by the spec."""
from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving import backend as backend_api
from opt_serving.backend.cpu import products
from opt_serving.config import config_for, get_config
from opt_serving.errors import require
from opt_serving.model import layout, lora, sources, weights
from opt_serving.model.peft import read_peft
from opt_serving.model import quantize as quantization
from opt_serving.model.weights import resolve_numpy_folder
from opt_serving.model.wrapper import OPTModel
from opt_serving.spec import ModelSpec

log = logging.getLogger(__name__)

__all__ = ["check_quantize_dtype", "load_model", "local_model", "model_dtype", "reference_model",
           "resolve_numpy_folder"]


def model_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str) and dtype == "auto":  # float16 on a GPU, float32 on a CPU
        dtype = "float16" if jax.default_backend() == "gpu" else "float32"
    if isinstance(dtype, str):
        dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    return jnp.dtype(dtype)


def local_model(spec: ModelSpec, dtype="auto", progress: bool = False, merge_lora=None) -> OPTModel:
    """The Flax model on one device over the spec's weights: its numpy folder or random weights from its seed.
    `spec.quantize="int8"`: every dense weight and the LM head in int8 with a scale per output channel
    (model/quantize.py), from any numpy folder (a quantized one is read as it is). `dtype="bfloat16"` on a CPU
    with native bfloat16 products keeps float32 activations and runs the products on bfloat16 weights.
    `merge_lora`: a PEFT LoRA adapter folder merged into the weights as they are read (model/lora.py's merge)."""
    quantize = quantization.check_choice(spec.quantize)
    dtype, fmt = _weights_format(model_dtype(dtype), quantize)
    if spec.weights.random:
        cfg, source = get_config(spec.name), sources.RandomSource(spec.weights.seed)
    else:
        if spec.weights.folder is None:
            raise ValueError(f"{spec.name}: give path= (the numpy weights folder) or dummy=True")
        folder = resolve_numpy_folder(spec.weights.folder, spec.name)
        cfg, source = config_for(spec.name, folder), sources.FolderSource(folder, quantize)
    merge = None if merge_lora is None else read_peft(merge_lora, cfg)
    return load_model(cfg, source, dtype, quantize, fmt, progress=progress, merge=merge)


def load_model(cfg, source, dtype, quantize: str | None = None, fmt: str = "float32",
               progress: bool = False, merge=None) -> OPTModel:
    """The one-device model from a source of tensors (model/sources.py), put in its runtime layout a layer at a
    time as it is read (layout.runtime_parts): the process never holds the checkpoint layout and the runtime
    one of the whole model at once. `merge`: a LoRA adapter (model/peft.py's) merged into each layer read."""
    parts = lora_merged(sources.tree_parts(source, cfg, dtype=dtype, quantize=quantize), merge)
    if progress:
        from tqdm import tqdm  # optional: only for a progress bar
        parts = tqdm(parts, desc="loading weights", unit="layer", total=cfg.num_hidden_layers + 1)
    backend, params = layout.runtime_parts(parts, jax.devices()[:1], dtype, weights=fmt)
    return OPTModel(cfg, params, backend=backend)


def lora_merged(parts, adapter=None):
    """Groups of a checkpoint-layout tree (sources.tree_parts') with a LoRA adapter merged into each (None: as
    they are)."""
    return parts if adapter is None else (lora.merge_part(part, adapter) for part in parts)


def _weights_format(dtype, quantize: str | None) -> tuple[jnp.dtype, str]:
    """(the params' dtype, Backend.weights) for a requested dtype and quantization. bfloat16 on a CPU with
    native bfloat16 products: float32 params (activations, norms, the cache) with bfloat16 packed products;
    elsewhere bfloat16 params as they are, which XLA on a CPU converts at each product (several times slower
    than float32: said once, at load)."""
    if quantize:
        check_quantize_dtype(quantize, dtype)
        if jax.default_backend() != "cpu":  # said once, at load: what int8 buys there and what it costs
            log.info("int8 weights on %s hold about half of float16's bytes, but XLA widens them at each product: "
                     "decode runs slower than float16 weights (benchmark/README.md, the GPU section)",
                     jax.default_backend())
        return dtype, quantize
    if dtype != jnp.bfloat16 or jax.default_backend() != "cpu":
        return dtype, "float32"
    if backend_api.bfloat16_products(jax.devices()[:1]):
        rows = products.bf16_fma_rows()
        if rows:  # said once, at load: which kernel a batch's products take
            log.info("bfloat16 products of %d rows or more run as float32 FMAs on the widened bfloat16 weights "
                     "(this CPU's bfloat16 dot products are no faster; OPT_SERVING_BF16_FMA_ROWS)", rows)
        return jnp.dtype(jnp.float32), "bfloat16"
    log.warning("this CPU has no native bfloat16 products (AVX512_BF16 or AMX), or the CPU kernels are off: "
                "bfloat16 weights run on XLA's converting path, slower than float32. Use float32, or "
                "quantize='int8' (--quantize int8) for a quarter of the bytes.")
    return dtype, "float32"


def check_quantize_dtype(quantize: str | None, dtype) -> None:
    """int8 weights run beside float32 activations on a CPU (the packed int8 products'), so any other dtype
    there is refused rather than run on XLA's converting path."""
    if quantize and jax.default_backend() == "cpu" and model_dtype(dtype) != jnp.float32:
        raise ValueError(f"quantize={quantize!r} keeps float32 activations on a CPU; drop dtype={dtype}")


def reference_model(spec: ModelSpec, dtype="auto"):
    """facebook/: Hugging Face's PyTorch OPTForCausalLM (the reference) over a Hugging Face folder, a numpy
    folder, or random weights from the spec's seed (torch's generator, not the Flax model's draw)."""
    torch = require("torch", "torch", f"{spec.name} (facebook/: Hugging Face's PyTorch model, the reference)")
    import transformers  # beside torch: loaded only for the reference model
    torch_dtype = {"float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}[str(model_dtype(dtype))]
    if spec.weights.random:
        torch.manual_seed(spec.weights.seed)
        hf_cfg = transformers.OPTConfig(**get_config(spec.name).to_hf_dict())
        return transformers.OPTForCausalLM(hf_cfg).to(torch_dtype).eval()
    if spec.weights.folder is None:
        raise ValueError(f"{spec.name}: give path= (an HF folder or numpy folder) or dummy=True")
    path = Path(spec.weights.folder)
    if (path / "config.json").exists() and (any(path.glob("*.safetensors"))
                                            or any(path.glob("pytorch_model*.bin"))):
        return transformers.OPTForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    folder = resolve_numpy_folder(path, spec.name)
    cfg, arrays = weights.load_numpy_folder(folder)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**cfg.to_hf_dict()))
    state = {weights.metaseq_key_to_hf(k): torch.from_numpy(np.array(v, np.float32))
             for k, v in arrays.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"numpy folder {folder} does not fit OPTForCausalLM: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.to(torch_dtype).eval()

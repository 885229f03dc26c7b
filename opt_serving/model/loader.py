"""get_model(name, path, ...): a model name and its weights -> the model a notebook (and the slot runner)
uses. `facebook/opt-*` -> Hugging Face PyTorch OPTForCausalLM (the reference and baseline), `jax/opt-*` -> the
Flax model on one device (model/wrapper.py's OPTModel), `alpa/opt-*` -> the parallel backend."""
from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving import backend as backend_api
from opt_serving.config import config_for, get_config, size_from_name
from opt_serving.errors import require
from opt_serving.model import param_tree, sources, weights
from opt_serving.model import quantize as quantization

log = logging.getLogger(__name__)

PREFIXES = ("facebook/", "jax/", "alpa/")


def resolve_numpy_folder(path: str | Path, model_name: str) -> Path:
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


def model_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str) and dtype == "auto":  # float16 on a GPU, float32 on a CPU
        dtype = "float16" if jax.default_backend() == "gpu" else "float32"
    if isinstance(dtype, str):
        dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    return jnp.dtype(dtype)


def get_model(model_name: str, path: str | Path | None = None, dtype="auto",
              tensor_parallel: int | None = None, pipeline_parallel: int | None = None,
              dummy: bool = False, seed: int = 0, quantize: str | None = None, **kwargs):
    """Load an OPT model by name (see the module docstring for the prefixes). `quantize="int8"`: every dense
    weight and the LM head in int8 with a scale per output channel (model/quantize.py), from any numpy
    folder (a quantized one is read as it is). `dtype="bfloat16"` on a CPU with native bfloat16 products
    keeps float32 activations and runs the products on bfloat16 weights."""
    quantize = quantization.check_choice(quantize)
    if not model_name.startswith(PREFIXES):
        raise ValueError(f"unknown model {model_name!r}: the name must start with one of "
                         f"{', '.join(PREFIXES)} (e.g. 'jax/opt-125m')")
    if path is None or not (Path(path) / "config.json").is_file():
        try:  # unknown sizes fail here, naming the known ones (a folder's config.json wins)
            size_from_name(model_name)
        except ValueError as e:
            if path is None:
                raise
            raise ValueError(f"{e}; any name works with a folder that has a config.json, and {path} has none") \
                from None
    if quantize and model_name.startswith("facebook/"):
        raise ValueError(f"{model_name}: quantize={quantize!r} applies to jax/ and alpa/ models (facebook/ is "
                         "Hugging Face's PyTorch model, the reference)")
    if model_name.startswith("alpa/"):
        try:
            from opt_serving.parallel import backend
        except ImportError:
            raise NotImplementedError(
                f"{model_name}: the alpa/ backend (opt_serving.parallel.backend) is not available "
                "in this build; use jax/ for one device") from None
        check_quantize_dtype(quantize, dtype)
        return backend.get_alpa_model(model_name, path, dtype=dtype, tensor_parallel=tensor_parallel,
                                      pipeline_parallel=pipeline_parallel, dummy=dummy, seed=seed,
                                      quantize=quantize, **kwargs)
    if tensor_parallel not in (None, 1) or pipeline_parallel not in (None, 1):
        raise ValueError(f"{model_name} runs on one device; use alpa/ for parallelism")
    if model_name.startswith("facebook/"):
        return _get_hf_model(model_name, path, dtype, dummy, seed)
    dtype, fmt = _weights_format(model_dtype(dtype), quantize)
    if dummy:
        cfg, source = get_config(model_name), sources.RandomSource(seed)
    else:
        if path is None:
            raise ValueError(f"{model_name}: give path= (the numpy weights folder) or dummy=True")
        folder = resolve_numpy_folder(path, model_name)
        cfg, source = config_for(model_name, folder), sources.FolderSource(folder, quantize)
    return load_model(cfg, source, dtype, quantize, fmt, progress=kwargs.get("progress", False))


def load_model(cfg, source, dtype, quantize: str | None = None, fmt: str = "float32", progress: bool = False):
    """The one-device model from a source of tensors (model/sources.py), put in its runtime layout a layer at a
    time as it is read (layout.runtime_parts): the process never holds the checkpoint layout and the runtime
    one of the whole model at once."""
    from opt_serving.model import layout
    parts = sources.tree_parts(source, cfg, dtype=dtype, quantize=quantize)
    if progress:
        from tqdm import tqdm
        parts = tqdm(parts, desc="loading weights", unit="layer", total=cfg.num_hidden_layers + 1)
    backend, params = layout.runtime_parts(parts, jax.devices()[:1], dtype, weights=fmt)
    from opt_serving.model.wrapper import OPTModel  # wrapper re-exports get_model: imported late, not in a cycle
    return OPTModel(cfg, params, backend=backend)


def _weights_format(dtype, quantize: str | None) -> tuple[jnp.dtype, str]:
    """(the params' dtype, Backend.weights) for a requested dtype and quantization. bfloat16 on a CPU with
    native bfloat16 products: float32 params (activations, norms, the cache) with bfloat16 packed products;
    elsewhere bfloat16 params as they are, which XLA on a CPU converts at each product (several times slower
    than float32: said once, at load)."""
    if quantize:
        check_quantize_dtype(quantize, dtype)
        return dtype, quantize
    if dtype != jnp.bfloat16 or jax.default_backend() != "cpu":
        return dtype, "float32"
    if backend_api.bfloat16_products(jax.devices()[:1]):
        from opt_serving.backend.cpu import products
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


def _get_hf_model(model_name, path, dtype, dummy, seed):
    torch = require("torch", "torch", f"{model_name} (facebook/: Hugging Face's PyTorch model, the reference)")
    import transformers
    torch_dtype = {"float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}[str(model_dtype(dtype))]
    if dummy or path is None:
        if not dummy:
            raise ValueError(f"{model_name}: give path= (an HF folder or numpy folder) or dummy=True")
        torch.manual_seed(seed)
        hf_cfg = transformers.OPTConfig(**get_config(model_name).to_hf_dict())
        return transformers.OPTForCausalLM(hf_cfg).to(torch_dtype).eval()
    path = Path(path)
    if (path / "config.json").exists() and (any(path.glob("*.safetensors"))
                                            or any(path.glob("pytorch_model*.bin"))):
        return transformers.OPTForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    folder = resolve_numpy_folder(path, model_name)
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

"""One loader: a model name and weights (or random weights, or the embedded tiny model) -> a `Generator`.
`opt-serving serve` (one per replica) and `opt-serving batch` load through `load_generator`, which parses the
model's name and options once into a `ModelSpec` (spec.py), so a name, a folder or a flag means the same thing to
each."""
from __future__ import annotations

from typing import Optional, Union

from opt_serving import startlog, xla_cache
from opt_serving.config import SpeculativeConfig
from opt_serving.engine.admission import DECODE_STEPS, PREFILL_CHUNK
from opt_serving.model.embedded import ensure_embedded_model
from opt_serving.engine.scheduler import Engine
from opt_serving.text.generator import Generator
from opt_serving.model.weights import resolve_numpy_folder
from opt_serving.spec import EMBEDDED, EMBEDDED_NAMES, ModelSpec
from opt_serving.text.tokenizer import load_tokenizer, tokenizer_for_dummy


def check_model_args(model: Optional[str], path=None, dummy: bool = False, tokenizer=None) -> None:
    """The model arguments' own errors (ValueError, naming the argument and its CLI flag), found before
    anything loads or Ray starts."""
    if dummy:
        if model is None:
            raise ValueError("dummy (--dummy, random weights) needs a model name for the size (--model), "
                             "e.g. jax/opt-125m")
        if path is not None:
            raise ValueError("give either path (--path, a weights folder) or dummy (--dummy, random weights), "
                             "not both")
        tokenizer_for_dummy(model, tokenizer)  # a large vocabulary needs a tokenizer folder
    elif path is None:
        if model is not None and model not in EMBEDDED_NAMES:
            raise ValueError(f"{model}: give path (--path, the numpy weights folder) or dummy (--dummy, "
                             "random weights)")
        if tokenizer is not None:
            raise ValueError("tokenizer (--tokenizer) goes with path or dummy; the embedded model has its own")
    elif model is None:
        raise ValueError("give model (--model NAME, e.g. facebook/opt-125m) together with path (--path)")


def load_generator(model: Optional[str], path=None, dtype: str = "auto", max_batch_size: int = 16,
                   max_seq_len: Optional[int] = None, max_queue: int = 256, warmup: Union[bool, str] = True,
                   dummy: bool = False, seed: int = 0, tokenizer=None, prefill_chunk: Optional[int] = PREFILL_CHUNK,
                   prefill_budget: Optional[int] = None, decode_steps: int = DECODE_STEPS, prefix_caching: bool = True,
                   ahead: bool = False, tensor_parallel: Optional[int] = None, pipeline_parallel: Optional[int] = None,
                   quantize: Optional[str] = None, lora=None, **plan) -> Generator:
    """The named model's weights from `path` (a numpy folder, or its parent holding `<size>-np/`) with the
    tokenizer from the same folder; random weights of the named size from `seed` with `dummy` (no `path`);
    the embedded tiny model with neither. `tokenizer`: a folder to take the
    tokenizer from instead (needed with `dummy` when the vocabulary is larger than the embedded model's).
    `max_batch_size` decode slots; what generation runs is compiled before it returns when `warmup` (every shape
    with "all": load_engine). `prefill_chunk`:
    prompts longer than this are prefilled that many tokens an engine iteration, between decode steps (0 or
    None: whole; engine.Engine), `prefill_budget` prompt tokens an iteration (whole prompts and chunks; default
    admission.PREFILL_BUDGET), `decode_steps`
    decode steps in one call while nobody waits for a slot (engine.Engine), `prefix_caching`: prompts that start
    as earlier ones did reuse their KV cache (runner/prefix.py). `tensor_parallel`, `pipeline_parallel` and
    `plan` (device_memory, micro_batches, handoff): an alpa/ model's plan (`load_engine`); `quantize="int8"`: int8
    weights; `lora`: LoRA adapters (runner/lora.py's LoraOptions).
    ValueError (naming the argument) for arguments that do not go together; OSError for missing files."""
    check_model_args(model, path, dummy, tokenizer)
    if dummy:
        folder, tok = None, load_tokenizer(tokenizer_for_dummy(model, tokenizer))
    else:
        if path is None:
            path, model = ensure_embedded_model(), EMBEDDED
        folder = resolve_numpy_folder(path, model)
        tok = load_tokenizer(folder if tokenizer is None else tokenizer)
    spec = ModelSpec.parse(model, folder, dummy=dummy, seed=seed, tensor_parallel=tensor_parallel,
                           pipeline_parallel=pipeline_parallel, quantize=quantize)
    engine = load_engine(spec, dtype=dtype, num_slots=max_batch_size, max_seq_len=max_seq_len,
                         max_queue=max_queue, warmup=warmup, prefill_chunk=prefill_chunk,
                         prefill_budget=prefill_budget, decode_steps=decode_steps, prefix_caching=prefix_caching,
                         ahead=ahead, lora=lora, **plan)
    return Generator(engine, tok, max_seq_len=max_seq_len, model_name=model)


def draft_spec(speculative: Optional[SpeculativeConfig], quantize: Optional[str] = None) -> Optional[ModelSpec]:
    """The draft model's spec of a speculative_config that names one (the embedded tiny model for "opt-tiny"
    without a path), its folder resolved; None for prompt lookup or none. ValueError/OSError naming it."""
    if speculative is None or speculative.model is None:
        return None
    model, path = speculative.model, speculative.path
    try:
        if ModelSpec.parse(EMBEDDED if model in EMBEDDED_NAMES else model, path, dummy=True).parallel:
            raise ValueError(f"it runs on one device in the engine's process, and {model} names a parallel plan "
                             f"(give jax/{model.rsplit('/', 1)[-1]})")
        if path is None:
            if model not in EMBEDDED_NAMES:
                raise ValueError(f"give 'path', {model}'s numpy weights folder (or \"model\": \"opt-tiny\", the "
                                 "embedded tiny model, without one)")
            path, model = ensure_embedded_model(), EMBEDDED
        return ModelSpec.parse(model, resolve_numpy_folder(path, model), quantize=quantize)
    except (ValueError, OSError) as e:
        raise type(e)(f"speculative_config's draft model: {e}") from None


def load_engine(model: Union[str, ModelSpec], path=None, dtype: str = "auto", num_slots: int = 16,
                max_seq_len: Optional[int] = None, max_queue: int = 256, warmup: Union[bool, str] = True,
                prefill_chunk: Optional[int] = PREFILL_CHUNK, prefill_budget: Optional[int] = None,
                decode_steps: int = DECODE_STEPS, prefix_caching: bool = True, dummy: bool = False, seed: int = 0,
                tensor_parallel: Optional[int] = None, pipeline_parallel: Optional[int] = None,
                quantize: Optional[str] = None, device_memory=None, micro_batches: Optional[int] = None,
                handoff: str = "auto", lora=None, speculative=None, ahead: bool = False) -> Engine:
    """An engine over `runner.load.load_slots` of a model spec, or of a name with its weights (`path`, or
    `dummy` random ones from `seed`) and plan (`tensor_parallel`, `pipeline_parallel`, `quantize`) parsed into
    one here: every plan (one device, a tensor-parallel mesh, pipeline stages on a Ray cluster;
    `device_memory`, `micro_batches`, `handoff`: parallel.pipeline.RayStages), what generation runs compiled
    before it returns when `warmup` ("all": every shape, the prefills only scored prompts run too, which
    otherwise compile at their first use where prompts join the steps; False: nothing) (the
    chunked prefill's step and `decode_steps` steps in one call too: `prefill_chunk`, `prefill_budget`,
    `decode_steps` and `ahead`, see engine.Engine; `prefix_caching`, runner/prefix.py; `lora`: LoRA adapters,
    runner/lora.py's LoraOptions; `speculative`: served speculative decoding, config.SpeculativeConfig or its JSON,
    runner/ngram.py).
    What it compiles is kept on disk for the next start (xla_cache)."""
    # JAX is imported where a model is loaded, not with this module: the fake engine's server and a process that
    # only checks arguments or routes requests never import it
    from opt_serving.runner.load import draft_model, load_draft, load_slots
    spec = model if isinstance(model, ModelSpec) else ModelSpec.parse(
        model, path, dummy=dummy, seed=seed, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        quantize=quantize)
    speculative = SpeculativeConfig.parse(speculative)  # (its errors before any weight is read)
    draft = draft_spec(speculative, spec.quantize)
    if warmup not in (True, False, "all"):
        raise ValueError(f"warmup is True, False or 'all', not {warmup!r}")
    xla_cache.enable()
    with startlog.PHASES.phase("weights and stages", compiles=True):
        slots = load_slots(spec, dtype=dtype, num_slots=num_slots, max_seq_len=max_seq_len,
                           device_memory=device_memory, micro_batches=micro_batches, prefix_caching=prefix_caching,
                           handoff=handoff, lora=lora,
                           draft=None if draft is None else draft_model(draft, speculative))
    if speculative is not None:
        try:
            with startlog.PHASES.phase("draft model" if draft else "speculation", compiles=False):
                slots.use_speculation(speculative, None if draft is None else load_draft(draft, dtype, spec.quantize))
        except BaseException:
            slots.close()
            raise
    engine = Engine(slots, max_queue=max_queue, start=False, prefill_chunk=prefill_chunk,
                    prefill_budget=prefill_budget, decode_steps=decode_steps, ahead=ahead)
    try:
        if warmup:
            engine.warmup(every_shape=warmup == "all")
    except BaseException:
        slots.close()
        raise
    engine.start()
    return engine

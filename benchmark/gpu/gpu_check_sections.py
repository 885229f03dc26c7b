"""The GPU check's measuring sections (gpu_check.py runs one a process): env (the card and the versions), tiny
(float32 tokens and logits against HF's), model (one size in one dtype: logits, tokens/s of HF generate(), our engine
and our generate(), memory against the planner) and compile (HF generate() under torch.compile)."""
from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING

import numpy as np

from benchmark.gpu.gpu_check_tools import (PAD, Compiles, device_name, engine_counts, engine_rate, engine_tokens,
                                           hf_model, jax_memory, params_from_torch, planner_estimate, sync_torch,
                                           torch_device, tree_bytes)

if TYPE_CHECKING:
    from benchmark.gpu.gpu_check import Run


def section_env(run: Run) -> None:
    import jax
    row = {"section": "env", "python": platform.python_version(), "jax": jax.__version__,
           "devices": [str(d) for d in jax.devices()], "device": device_name()}
    for mod in ("jaxlib", "flax", "numpy", "torch", "transformers"):
        try:
            row[mod] = __import__(mod).__version__
        except ImportError as e:
            row[mod] = f"missing ({e})"
    try:
        import torch
        row["torch_cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    row["memory"] = jax_memory()
    run.write(**row)


def section_tiny(run: Run) -> None:
    """float32 tiny models on the device: tokens of generate() (greedy, beam) equal HF's, the engine's greedy
    tokens equal generate()'s, and the logits' distance to HF's."""
    import jax
    import torch
    from opt_serving.config import OPT_CONFIGS
    from opt_serving.model import wrapper
    from opt_serving.runner.generate import Generation
    from opt_serving.runner.load import local_slots
    from opt_serving.engine.scheduler import Engine
    dev = torch_device()
    tiny = OPT_CONFIGS["tiny"]
    shapes = {"tiny": tiny, "tiny-post-ln": tiny.replace(word_embed_proj_dim=64, do_layer_norm_before=False)}
    rng = np.random.default_rng(0)
    for name, cfg in shapes.items():
        hf = hf_model(cfg, 0, torch.float32, dev, peaked=8.0)
        ours = Generation.of(wrapper.OPTModel(cfg, params_from_torch(cfg, hf, "float32")))
        ids = rng.integers(4, cfg.vocab_size, (3, 12)).astype(np.int32)
        mask = np.ones_like(ids)
        mask[1, :3] = mask[2, :7] = 0  # left-padded prompts of three lengths
        ids[mask == 0] = PAD
        ids_t, mask_t = torch.tensor(ids, device=dev), torch.tensor(mask, device=dev)
        with torch.no_grad():
            ref_logits = hf(input_ids=ids_t, attention_mask=mask_t).logits.float().cpu().numpy()
        for precision in ("default", "highest"):
            with jax.default_matmul_precision(None if precision == "default" else "highest"):
                logits = np.asarray(ours(ids, mask))
            valid = mask.astype(bool)
            err = np.linalg.norm(logits[valid] - ref_logits[valid]) / np.linalg.norm(ref_logits[valid])
            run.write(section="tiny", model=name, check="logits_rel_err", matmul_precision=precision,
                      value=float(err), device=device_name())
        for case, kw in {"greedy": {}, "beam": dict(num_beams=4, num_return_sequences=2)}.items():
            with torch.no_grad():
                ref = hf.generate(ids_t, attention_mask=mask_t, max_new_tokens=16, do_sample=False,
                                  pad_token_id=PAD, **kw).cpu().numpy()
            out = np.asarray(ours.generate(ids, attention_mask=mask, max_new_tokens=16, **kw))
            same = out.shape == ref.shape and bool((out == ref).all())
            run.write(section="tiny", model=name, check=f"{case}_tokens_equal_hf", ok=same,
                      agree=float((out == ref).mean()) if out.shape == ref.shape else 0.0, device=device_name())
        # the engine (right-padded prompts, slots) against generate() of each prompt alone
        slots = local_slots(cfg, ours.fused_params, num_slots=4, max_seq_len=64, backend=ours.backend)
        engine = Engine(slots, decode_steps=4)
        try:
            prompts = [ids[r][mask[r] > 0].tolist() for r in range(3)]
            got = engine_tokens(engine, prompts, 16)
            want = [np.asarray(ours.generate(np.array([p], np.int32), max_new_tokens=16, min_new_tokens=16))[0,
                    len(p):].tolist() for p in prompts]
            run.write(section="tiny", model=name, check="engine_tokens_equal_generate", ok=got == want,
                      device=device_name())
        finally:
            engine.close()


def section_model(run: Run) -> None:
    """One size in one dtype: logits, then tokens/s of HF generate(), our engine and our generate(), then
    memory (the order keeps what matters most ahead of the deadline)."""
    import jax
    import torch
    from opt_serving.config import get_config
    from opt_serving.model import wrapper
    from opt_serving.runner.generate import Generation
    a = run.args
    size, dtype = a.size, a.dtype
    cfg = get_config(size)
    dev = torch_device()
    tdt = getattr(torch, dtype)
    base = dict(section="model", size=size, dtype=dtype, device=device_name())
    if a.quantize:
        base["quantize"] = a.quantize
    rng = np.random.default_rng(0)
    compiles = Compiles()

    # torch draws the weights in float32 (the reference's), then rounds them to the dtype both sides run
    t0 = time.perf_counter()
    hf = hf_model(cfg, 0, torch.float32, dev)
    run.write(**base, check="hf_init_s", value=round(time.perf_counter() - t0, 2),
              attn=getattr(hf.config, "_attn_implementation", "?"))
    ids = rng.integers(4, cfg.vocab_size, (4, a.logit_len)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :a.logit_len // 4] = 0  # one left-padded row
    ids[mask == 0] = PAD
    valid = mask.astype(bool)

    def torch_logits():
        with torch.no_grad():
            out = hf(input_ids=torch.tensor(ids, device=dev), attention_mask=torch.tensor(mask, device=dev))
        return out.logits.float().cpu().numpy()[valid].astype(np.float64)  # [tokens, V]
    ref = torch_logits()
    hf = hf.to(tdt)
    if dev == "cuda":
        torch.cuda.empty_cache()
    theirs = torch_logits()

    t0 = time.perf_counter()
    params = params_from_torch(cfg, hf, dtype)
    if a.quantize:  # int8 weights (the same numbers as get_model(quantize="int8")'s), activations in `dtype`
        from opt_serving.model.quantize import quantize_params
        params = quantize_params(params)
    ours = Generation.of(wrapper.OPTModel(cfg, params, weights=a.quantize or "float32"))
    del params
    jax.block_until_ready(ours.fused_params)
    run.write(**base, check="jax_load_s", value=round(time.perf_counter() - t0, 2),
              param_bytes=tree_bytes(ours.fused_params), memory=jax_memory())
    mine = np.asarray(ours(ids, mask))[valid].astype(np.float64)
    rel = lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(y))  # noqa: E731
    top = ref.argmax(-1)
    run.write(**base, check="logits", tokens=int(valid.sum()),
              jax_rel_err=rel(mine, ref), torch_rel_err=rel(theirs, ref), jax_vs_torch=rel(mine, theirs),
              jax_max_abs=float(np.abs(mine - ref).max()), torch_max_abs=float(np.abs(theirs - ref).max()),
              jax_top1=float((mine.argmax(-1) == top).mean()), torch_top1=float((theirs.argmax(-1) == top).mean()))
    del ref, theirs, mine

    batches, n, p = a.batches, a.new_tokens, a.prompt_len

    def prompts(b):
        return rng.integers(4, cfg.vocab_size, (b, p)).astype(np.int32)

    # Hugging Face generate() (eager, SDPA): nothing to compile, a short warm-up call. Beside int8 weights none:
    # HF's are float, timed in the float section, and its copy goes back to the card
    hf_batches = batches
    if a.quantize:
        hf, hf_batches = None, []
        if dev == "cuda":
            torch.cuda.empty_cache()
    if hf_batches:
        with torch.no_grad():
            hf.generate(torch.tensor(prompts(1), device=dev), max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    for b in hf_batches:
        run.check(10, f"hf generate batch {b}")
        x = torch.tensor(prompts(b), device=dev)
        times = []
        for _ in range(a.reps):
            sync_torch()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=PAD)
            sync_torch()
            times.append(time.perf_counter() - t0)
        assert tuple(out.shape) == (b, p + n), out.shape
        run.write(**base, check="hf_generate_tokens_per_s", batch=b, value=round(b * n / min(times), 1),
                  runs=[round(b * n / t, 1) for t in times], prompt_len=p, new_tokens=n)

    # the continuous-batching engine: one engine of max(batches) slots, as a server runs, at each load
    from opt_serving.engine.admission import DECODE_STEPS, PREFILL_CHUNK
    from opt_serving.engine.scheduler import Engine
    from opt_serving.runner.load import local_slots
    slots = local_slots(cfg, ours.fused_params, num_slots=max(batches), max_seq_len=a.max_seq_len,
                        backend=ours.backend)
    engine = Engine(slots, prefill_chunk=PREFILL_CHUNK, decode_steps=DECODE_STEPS)
    try:
        for b in sorted(batches, reverse=True):
            run.check(15, f"engine batch {b}")
            # warm runs until two in a row compile nothing: a run can leave the cache at another window than it
            # found, and after a slow (compiling) run the engine takes single steps until its step time settles
            compiles.take()
            t0, warm_compiles = time.perf_counter(), []
            for _ in range(6):
                engine_rate(engine, b, p, n, cfg.vocab_size, rng)
                warm_compiles.append(compiles.take())
                if len(warm_compiles) >= 2 and not warm_compiles[-1][0] and not warm_compiles[-2][0]:
                    break
                run.check(10, f"engine batch {b} warm-up")
            warm_s = time.perf_counter() - t0
            before = engine.stats()
            rates = [engine_rate(engine, b, p, n, cfg.vocab_size, rng) for _ in range(a.engine_reps)]
            # how the timed runs were stepped: steps a call, prefill passes, and a decode step's wall time
            # (the engine's moving average) beside generate()'s, to tell the host's share from the device's
            counts = engine_counts(before, engine.stats())
            run.write(**base, check="engine_tokens_per_s", batch=b, value=round(max(rates), 1),
                      runs=[round(r, 1) for r in rates], compiles_in_timed=compiles.take()[0],
                      warm_runs_s=round(warm_s, 1), warm_compiles=warm_compiles, prompt_len=p, new_tokens=n,
                      slots=max(batches), step_ms=round(engine._step_s * 1e3, 2), **counts)
        stage = slots.stages.stages[0]
        full = jax.eval_shape(lambda: stage._new_cache(max(batches), stage.windows[-1]))  # the largest window's
        run.write(**base, check="memory", engine_cache_bytes=tree_bytes(full), param_bytes=tree_bytes(ours.fused_params),
                  memory=jax_memory(), torch_allocated=torch.cuda.memory_allocated() if dev == "cuda" else None,
                  **planner_estimate(cfg, size, dtype, max(batches), a.max_seq_len, a.quantize or "float32"))
    finally:
        engine.close()
    del engine, slots

    # our generate(): one compiled loop per batch shape
    for b in batches:
        run.check(20, f"our generate batch {b}")
        x = prompts(b)
        compiles.take()
        t0 = time.perf_counter()
        out = np.asarray(ours.generate(x, max_new_tokens=n, min_new_tokens=n))
        first, first_compiles = time.perf_counter() - t0, compiles.take()
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            out = np.asarray(ours.generate(x, max_new_tokens=n, min_new_tokens=n))
            times.append(time.perf_counter() - t0)
        assert out.shape == (b, p + n), out.shape
        run.write(**base, check="jax_generate_tokens_per_s", batch=b, value=round(b * n / min(times), 1),
                  runs=[round(b * n / t, 1) for t in times], first_call_s=round(first, 1),
                  first_call_compiles=first_compiles, compiles_in_timed=compiles.take()[0], prompt_len=p,
                  new_tokens=n)
    run.write(**base, check="memory_end", memory=jax_memory())


def section_compile(run: Run) -> None:
    """HF generate() with a static KV cache and torch.compile (transformers compiles the forward itself when
    the cache is static), where this torch and card support it."""
    import torch
    from opt_serving.config import get_config
    a = run.args
    cfg = get_config(a.size)
    dev = torch_device()
    hf = hf_model(cfg, 0, getattr(torch, a.dtype), dev)
    rng = np.random.default_rng(0)
    base = dict(section="compile", size=a.size, dtype=a.dtype, device=device_name())
    for b in a.batches:
        run.check(60, f"torch.compile batch {b}")
        x = torch.tensor(rng.integers(4, cfg.vocab_size, (b, a.prompt_len)), device=dev)
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                  do_sample=False, pad_token_id=PAD, cache_implementation="static")
        try:
            times = []
            for _ in range(1 + a.reps):
                sync_torch()
                t0 = time.perf_counter()
                with torch.no_grad():
                    hf.generate(x, **kw)
                sync_torch()
                times.append(time.perf_counter() - t0)
            run.write(**base, check="hf_compiled_tokens_per_s", batch=b,
                      value=round(b * a.new_tokens / min(times[1:]), 1), first_call_s=round(times[0], 1))
        except Exception as e:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
            run.write(**base, check="hf_compiled_tokens_per_s", batch=b, error=f"{type(e).__name__}: {e}"[:400])
            return

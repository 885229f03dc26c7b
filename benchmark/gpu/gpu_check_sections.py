"""The GPU check's measuring sections (gpu_check.py runs one a process): env (the card and the versions), tiny
(float32 tokens and logits against HF's), model (one size in one dtype: logits, tokens/s of HF generate(), our engine
and our generate(), memory against the planner) and compile (HF generate() under torch.compile)."""
from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING

import numpy as np

from benchmark.gpu.gpu_check_tools import (PAD, Compiles, StepBytes, copy_bandwidth, device_name, engine_counts,
                                           engine_rate, engine_tokens, engine_ttft, hf_model, jax_memory,
                                           params_from_torch, planner_estimate, sync_torch, torch_allocated,
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
    row.update(copy_bandwidth(run.args.copy_mib << 20))  # the bound every decode figure is read against
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
    """One size in one dtype: logits, the card's copy bandwidth, tokens/s of our engine and our generate() (each
    decode step against the bytes it must read), TTFT of a wave of long prompts, then HF generate() (the order
    keeps what the targets need ahead of the deadline)."""
    import jax
    import torch
    from opt_serving.config import get_config
    from opt_serving.model import wrapper
    from opt_serving.runner.generate import Generation
    a = run.args
    cfg = get_config(a.size)
    dev = torch_device()
    base = dict(section="model", size=a.size, dtype=a.dtype, device=device_name())
    if a.quantize:
        base["quantize"] = a.quantize
    if a.variant:
        base["variant"] = a.variant
    rng = np.random.default_rng(0)

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
    hf = hf.to(getattr(torch, a.dtype))
    if dev == "cuda":
        torch.cuda.empty_cache()
    theirs = torch_logits()

    t0 = time.perf_counter()
    params = params_from_torch(cfg, hf, a.dtype)
    if a.quantize:  # int8 weights (the same numbers as get_model(quantize="int8")'s), activations in `dtype`
        from opt_serving.model.quantize import quantize_params
        params = quantize_params(params)
        hf = None  # HF's weights are float, timed in the float section
        if dev == "cuda":
            torch.cuda.empty_cache()
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

    bw = copy_bandwidth(a.copy_mib << 20)
    run.write(**base, check="bandwidth", **bw)
    step = StepBytes(cfg, tree_bytes(ours.fused_params), a.dtype, bw["gb_per_s"])
    if "engine" in a.parts:
        _engine_rates(run, base, cfg, ours, step, rng)
    if "generate" in a.parts:
        _generate_rates(run, base, ours, step, rng, cfg.vocab_size)
    if a.ttft_batch and "ttft" in a.parts:
        _ttft(run, base, cfg, ours, rng)
    if hf is not None and "hf" in a.parts:
        _hf_eager(run, base, hf, rng, cfg.vocab_size)


def _engine_rates(run: Run, base: dict, cfg, ours, step: StepBytes, rng) -> None:
    """The continuous-batching engine: one engine of max(batches) slots, as a server runs, at each load and at each
    of --engine-steps decode steps a call; its decode step's wall time beside the time the step's bytes take at
    the copy bandwidth."""
    import jax
    from opt_serving.engine.admission import DECODE_STEPS, PREFILL_CHUNK
    from opt_serving.engine.scheduler import Engine
    from opt_serving.runner.load import local_slots
    a = run.args
    slots = local_slots(cfg, ours.fused_params, num_slots=max(a.batches), max_seq_len=a.max_seq_len,
                        backend=ours.backend)
    for steps in a.engine_steps or [DECODE_STEPS]:
        engine = Engine(slots, prefill_chunk=PREFILL_CHUNK, decode_steps=steps, ahead=a.engine_ahead)
        try:
            for b in sorted(a.batches, reverse=True):
                run.check(15, f"engine batch {b}")
                _engine_rate(run, base, engine, cfg, step, b, rng)
        finally:
            engine.close()
    stage = slots.stages.stages[0]
    full = jax.eval_shape(lambda: stage._new_cache(max(a.batches), stage.windows[-1]))  # the largest window's
    run.write(**base, check="memory", engine_cache_bytes=tree_bytes(full), param_bytes=tree_bytes(ours.fused_params),
              memory=jax_memory(), torch_allocated=torch_allocated(),
              **planner_estimate(cfg, a.size, a.dtype, max(a.batches), a.max_seq_len, a.quantize or "float32"))


def _engine_rate(run: Run, base: dict, engine, cfg, step: StepBytes, b: int, rng) -> None:
    """The engine's new tokens/s at batch `b`: warm runs until two in a row compile nothing (a run can leave the
    cache at another window than it found, and after a slow, compiling run the engine takes single steps until its
    step time settles), then --engine-reps timed runs, and with --profile one more under JAX's profiler."""
    import jax
    a, compiles = run.args, Compiles()
    n, p = a.new_tokens, a.prompt_len
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
    # how the timed runs were stepped: steps a call, prefill passes, and a decode step's wall time (the engine's
    # moving average) against what reading its bytes once takes
    counts = engine_counts(before, engine.stats())
    run.write(**base, check="engine_tokens_per_s", batch=b, value=round(max(rates), 1),
              runs=[round(r, 1) for r in rates], compiles_in_timed=compiles.take()[0], warm_runs_s=round(warm_s, 1),
              warm_compiles=warm_compiles, prompt_len=p, new_tokens=n, slots=max(a.batches),
              decode_steps=engine.decode_steps, ahead=engine.ahead, step_ms=round(engine._step_s * 1e3, 3),
              **step.row(b, p + n // 2),
              step_over_bound=round(engine._step_s * 1e3 / step.bound_ms(b, p + n // 2), 2), **counts)
    if a.profile:  # where a step's time goes, kernel by kernel and on the host (benchmark/gpu/trace_split.py)
        where = f"{a.profile}/engine-{a.size}-b{b}-s{engine.decode_steps}"
        with jax.profiler.trace(where, create_perfetto_trace=True):
            engine_rate(engine, b, p, n, cfg.vocab_size, rng)


def _generate_rates(run: Run, base: dict, ours, step: StepBytes, rng, vocab: int) -> None:
    """Our generate(): one compiled loop per batch shape; a token's time against its step's bytes."""
    a, compiles = run.args, Compiles()
    n, p = a.new_tokens, a.prompt_len
    for b in a.batches:
        run.check(20, f"our generate batch {b}")
        x = rng.integers(4, vocab, (b, p)).astype(np.int32)
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
        token_ms = min(times) / n * 1e3
        run.write(**base, check="jax_generate_tokens_per_s", batch=b, value=round(b * n / min(times), 1),
                  runs=[round(b * n / t, 1) for t in times], first_call_s=round(first, 1),
                  first_call_compiles=first_compiles, compiles_in_timed=compiles.take()[0], prompt_len=p,
                  new_tokens=n, token_ms=round(token_ms, 3), **step.row(b, p + n // 2),
                  token_over_bound=round(token_ms / step.bound_ms(b, p + n // 2), 2))
    run.write(**base, check="memory_end", memory=jax_memory())


def _ttft(run: Run, base: dict, cfg, ours, rng) -> None:
    """A wave of `--ttft-batch` prompts of `--ttft-prompt-len` tokens arriving together at an engine of as many
    slots: each one's time to its first token (warm runs until one compiles nothing, then timed)."""
    from opt_serving.engine.admission import DECODE_STEPS, PREFILL_CHUNK
    from opt_serving.engine.scheduler import Engine
    from opt_serving.runner.load import local_slots
    a, compiles = run.args, Compiles()
    b, p, n = a.ttft_batch, a.ttft_prompt_len, a.ttft_new_tokens
    run.check(30, f"ttft {b} x {p}")
    slots = local_slots(cfg, ours.fused_params, num_slots=b, max_seq_len=p + n, backend=ours.backend)
    engine = Engine(slots, prefill_chunk=PREFILL_CHUNK, decode_steps=DECODE_STEPS)
    try:
        t0, warm_compiles = time.perf_counter(), []
        for _ in range(4):
            engine_ttft(engine, b, p, n, cfg.vocab_size, rng)
            warm_compiles.append(compiles.take())
            if not warm_compiles[-1][0]:
                break
            run.check(10, f"ttft {b} x {p} warm-up")
        warm_s = time.perf_counter() - t0
        before = engine.stats()
        runs = [engine_ttft(engine, b, p, n, cfg.vocab_size, rng) for _ in range(a.engine_reps)]
        best = min(runs, key=lambda r: r["p50_s"])
        run.write(**base, check="ttft", batch=b, prompt_len=p, new_tokens=n, **best,
                  p50_runs=[r["p50_s"] for r in runs], compiles_in_timed=compiles.take()[0],
                  warm_runs_s=round(warm_s, 1), warm_compiles=warm_compiles, **engine_counts(before, engine.stats()))
    finally:
        engine.close()


def _hf_eager(run: Run, base: dict, hf, rng, vocab: int) -> None:
    """Hugging Face generate() (eager, SDPA): nothing to compile, a short warm-up call."""
    import torch
    a, dev = run.args, torch_device()
    n, p = a.new_tokens, a.prompt_len
    with torch.no_grad():
        hf.generate(torch.tensor(rng.integers(4, vocab, (1, p)), device=dev), max_new_tokens=4, do_sample=False,
                    pad_token_id=PAD)
    for b in a.hf_batches if a.hf_batches is not None else a.batches:
        run.check(10, f"hf generate batch {b}")
        x = torch.tensor(rng.integers(4, vocab, (b, p)), device=dev)
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

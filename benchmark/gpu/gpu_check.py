"""The prepared GPU check: our numbers and speed against Hugging Face torch on the same card, one section a process.

`benchmark/gpu_check.sh` runs the sections in order under one deadline and prints the report; each section can
also run alone:

  python benchmark/gpu_check.py env                             the card and the versions
  python benchmark/gpu_check.py tiny                            tiny models (pre-LN and OPT-350m's post-LN shape),
      float32: generate()'s greedy and beam tokens equal HF's, the engine's greedy tokens equal generate()'s
  python benchmark/gpu_check.py model --size 1.3b --dtype float16
      random weights drawn once by torch and shared with JAX: logits of both against torch's float32 logits,
      tokens/s of HF generate() (SDPA), our generate() and our continuous-batching engine at each --batches,
      and the card's memory against the planner's estimate
  python benchmark/gpu_check.py compile --size 1.3b --dtype float16   HF generate() with a static cache under
      torch.compile, where it works
  python benchmark/gpu_check.py report                          the table of every result in --out

Every measurement is one JSON line appended to --out the moment it is taken, so a section stopped by the deadline
(--deadline, seconds since the epoch) keeps what it measured. The same script runs on a CPU (rehearsal: small
sizes, few tokens), so a GPU's short lease is spent measuring.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # opt_serving from this checkout

PAD = 1


class Deadline(Exception):
    """The section's time is up: what it measured so far stays in --out."""


class Run:
    """The section's output file, its deadline and what every row says of where it ran."""

    def __init__(self, args):
        self.out, self.deadline, self.args = Path(args.out), args.deadline, args
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time() if self.deadline else float("inf")

    def check(self, need_s: float = 0.0, what: str = "") -> None:
        if self.left() < need_s:
            raise Deadline(f"{what}: {self.left():.0f} s left, {need_s:.0f} s needed")

    def write(self, **row) -> None:
        row = {"time": round(time.time(), 1), **row}
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print("  " + json.dumps(row), flush=True)


def device_name() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def sync_torch():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def torch_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- the same random weights on both sides ----

def hf_model(cfg, seed: int, dtype, device: str, peaked: float = 1.0):
    """HF's OPTForCausalLM for `cfg` on `device`, random from `seed` (HF's own init, std 0.02), SDPA attention,
    in `dtype`. `peaked` multiplies the matrices (tiny models: greedy choices far from ties) and moves the
    biases and norms off 0 / 1, as tests/conftest.py's hf_model does."""
    import torch
    import transformers
    torch.manual_seed(seed)
    hf_cfg = transformers.OPTConfig(**cfg.to_hf_dict(), attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.OPTForCausalLM(hf_cfg).to(dtype).eval()
    if peaked != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(peaked)
                else:
                    p.add_(0.1 * torch.randn_like(p))
    return model


def params_from_torch(cfg, model, dtype):
    """Our Flax param tree from a torch OPTForCausalLM's state dict, tensor by tensor, on JAX's default device
    (through DLPack: on a GPU the weights never visit the host)."""
    import jax
    import jax.numpy as jnp
    from opt_serving.model import weights
    tree: dict = {}
    for key, t in model.state_dict().items():
        name = weights.hf_key_to_metaseq(key)
        if name is None:  # the tied LM head
            continue
        path, transpose = weights.flax_path(name)
        t = t.detach().contiguous()
        try:
            a = jnp.from_dlpack(t)
        except Exception:  # noqa: BLE001 - a DLPack pairing this JAX and torch refuse: through the host
            a = jnp.asarray(t.float().cpu().numpy())
        a = jnp.array(a.T if transpose else a, dtype=dtype, copy=True)  # our own copy, torch's can go
        weights.set_path(tree, path, jax.device_put(a, jax.devices()[0]))
    return tree


def tree_bytes(tree) -> int:
    """Bytes of a tree of arrays (or of ShapeDtypeStructs)."""
    import jax
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "dtype"))


class Compiles:
    """XLA compiles (and their seconds) since the last `take()`: a timed run that compiled measured a compile."""

    def __init__(self):
        import jax
        self.n, self.s = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name, secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            self.n, self.s = self.n + 1, self.s + secs

    def take(self) -> tuple[int, float]:
        out, self.n, self.s = (self.n, round(self.s, 1)), 0, 0.0
        return out


def jax_memory() -> dict:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


# ---- sections ----

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


def engine_tokens(engine, prompts, n: int) -> list[list[int]]:
    """Greedy tokens of each prompt through the engine, all submitted at once, no stop token."""
    import threading
    from opt_serving.engine.scheduler import SlotSettings
    out = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def callback(i):
        def on_output(o):
            if o.error is not None:
                raise o.error
            out[i].extend(t.id for t in o.tokens if not o.is_prompt)
            if o.finish_reason is not None:
                done.release()
        return on_output
    # queued under the engine's lock (re-entrant: submit takes it too), so its next iteration sees the whole
    # batch and every run admits it the same way, in shapes the first run compiled
    with engine._cv:
        for i, p in enumerate(prompts):
            engine.submit(p, SlotSettings(max_tokens=n, logprob=False, top_logprobs=False), callback(i))
    for _ in prompts:
        done.acquire()
    return out


def engine_rate(engine, batch: int, prompt_len: int, n: int, vocab: int, rng) -> float:
    """`batch` requests of `prompt_len` random ids submitted at once, each making `n` greedy tokens -> new
    tokens/s from the first submit to the last token."""
    prompts = [rng.integers(4, vocab, prompt_len).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    out = engine_tokens(engine, prompts, n)
    dt = time.perf_counter() - t0
    assert all(len(o) == n for o in out), [len(o) for o in out]
    return batch * n / dt


def engine_counts(before, after, prefix: str = "") -> dict:
    """What the engine did between two of its stats(): decode steps, the calls that took them, prefills, and of
    those the prompts that joined a step."""
    return {prefix + k: getattr(after, k) - getattr(before, k) for k in ("steps", "step_calls", "prefills", "joined")}


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


def planner_estimate(cfg, size: str, dtype: str, batch: int, max_seq_len: int, weights: str = "float32") -> dict:
    """What the planner counts for one device holding the whole model (pp = tp = 1) at this batch and context."""
    from opt_serving.parallel import cluster, planner
    plan = planner.best_plan(cfg, cluster.cluster_from_jax(), model=f"jax/opt-{size}", batch_size=batch,
                             max_seq_len=max_seq_len, dtype=dtype, tensor_parallel=1, pipeline_parallel=1,
                             data_parallel=1, weights=weights)
    st = plan.stages[0]
    return {"plan_param_bytes": st.param_bytes, "plan_kv_bytes": st.kv_bytes, "plan_act_bytes": st.act_bytes,
            "plan_memory_bytes": st.memory_bytes, "plan_limit_bytes": plan.memory_limit}


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


def section_report(run: Run) -> None:
    """The table of every result in --out."""
    rows = [json.loads(line) for line in open(run.out)] if run.out.exists() else []
    env = next((r for r in rows if r.get("section") == "env"), {})
    print(f"\nGPU check on {env.get('torch_cuda') or env.get('device')} (jax {env.get('jax')}, "
          f"torch {env.get('torch')}, transformers {env.get('transformers')})")
    for r in rows:
        if r.get("section") == "tiny" and "model" in r:
            what = r.get("value", r.get("ok"))
            print(f"  tiny {r['model']:<14} {r['check']:<30} {r.get('matmul_precision', ''):<8} {what}")
    speed: dict = {}
    for r in rows:
        if r.get("section") in ("model", "compile") and r.get("check", "").endswith("tokens_per_s"):
            speed.setdefault((r["size"], label(r), r["batch"]), {})[r["check"]] = r.get("value", r.get("error"))
        elif r.get("check") == "logits":
            print(f"  {r['size']:>5} {label(r):<9} logits vs torch float32: jax rel {r['jax_rel_err']:.2e} "
                  f"(top-1 {r['jax_top1']:.3f}), torch rel {r['torch_rel_err']:.2e} (top-1 {r['torch_top1']:.3f}), "
                  f"jax vs torch {r['jax_vs_torch']:.2e}")
        elif r.get("check") == "memory":
            gb = lambda x: f"{x / 2 ** 30:.2f}"  # noqa: E731
            m = r.get("memory", {})
            print(f"  {r['size']:>5} {label(r):<9} memory GiB: params {gb(r['param_bytes'])} (plan "
                  f"{gb(r['plan_param_bytes'])}), engine KV {gb(r['engine_cache_bytes'])} (plan {gb(r['plan_kv_bytes'])}),"
                  f" in use {gb(m.get('bytes_in_use', 0))}, peak {gb(m.get('peak_bytes_in_use', 0))} (plan total "
                  f"{gb(r['plan_memory_bytes'])} + act)")
    if speed:
        print(f"\n  {'size':>5} {'dtype':<9} {'batch':>5} {'HF eager':>10} {'HF compiled':>12} {'our generate':>13} "
              f"{'our engine':>11} {'gen/HF':>7} {'engine/HF':>9}")
        for (size, dtype, b), s in sorted(speed.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            hf, gen, eng = (s.get(k) for k in ("hf_generate_tokens_per_s", "jax_generate_tokens_per_s",
                                               "engine_tokens_per_s"))
            ratio = lambda x: f"{x / hf:.2f}x" if isinstance(x, (int, float)) and isinstance(hf, (int, float)) else "-"  # noqa: E731
            print(f"  {size:>5} {dtype:<9} {b:>5} {fmt(hf):>10} {fmt(s.get('hf_compiled_tokens_per_s')):>12} "
                  f"{fmt(gen):>13} {fmt(eng):>11} {ratio(gen):>7} {ratio(eng):>9}")
    stops = [r for r in rows if r.get("check") == "stopped"]
    for r in stops:
        print(f"  stopped: {r.get('what')}")


def label(r: dict) -> str:
    """A row's weights: its dtype, and "+int8" where the weights were int8."""
    return r["dtype"] + (f"+{r['quantize']}" if r.get("quantize") else "")


def fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if isinstance(x, (int, float)) else str(x)[:12]


SECTIONS = {"env": section_env, "tiny": section_tiny, "model": section_model, "compile": section_compile,
            "report": section_report}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("section", choices=list(SECTIONS))
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "gpu_check.jsonl"))
    p.add_argument("--deadline", type=float, default=0.0, help="seconds since the epoch; 0: none")
    p.add_argument("--size", default="1.3b")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--logit-len", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="model: int8 weights (model/quantize.py) beside activations in --dtype")
    p.add_argument("--reps", type=int, default=1, help="timed runs after the first (compiling) one")
    p.add_argument("--engine-reps", type=int, default=2, help="the engine's timed runs after the first")
    args = p.parse_args(argv)
    run = Run(args)
    try:
        SECTIONS[args.section](run)
    except Deadline as e:
        run.write(section=args.section, check="stopped", what=f"{args.section} {args.size} {args.dtype}"
                  f"{'+' + args.quantize if args.quantize else ''}: {e}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

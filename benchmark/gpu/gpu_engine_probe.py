"""Where the engine's decode step loses time against generate()'s compiled loop on a GPU (the first GPU runs: the
engine's step took 2.9-3.1 ms at OPT-1.3b float16 where generate() took 1.8-2.1 ms a token).

One process, one model of random weights, one slot model of --slots rows filled with greedy requests, every step
at one cache window; times a decode step (ms, median of --reps calls) taken these ways:

  slots.step_many      the engine's call: --steps steps in one jitted call, and the host's bookkeeping around it
  stage.decode_steps   the same call without the slot model's bookkeeping (the jitted scan and reading it back)
  model step only      the model's step alone, --steps calls in a row, no sampler (what the sampler adds)
  plain sampler        as slots.step_many, with the sampler's `lax.cond` between the argmax and the full sampler
                       traced as the argmax alone (what the conditional costs where the device must tell the
                       host which branch to launch)
  generate()           our generate() at the same batch, for the same number of new tokens (per token)

With --admission, the engine itself (as gpu_check.py runs it: 64 slots, prompts of 32 ids, 64 new tokens, all
submitted at once) in tokens/s at each --batches, under three ways of starting the prompts: joining decode steps
in the blocks a CPU's stages take (runner.slots.join_blocks: up to 128 tokens, each shorter than the context), in
those a GPU's take (up to 512: 16 prompts of 32 a step), and with no joining (prefilled together, then inserted).

  python benchmark/gpu/gpu_engine_probe.py --size 1.3b --dtype float16 --slots 64 --active 64,1 --out probe.jsonl
(--size tiny on a CPU rehearses it.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.3b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--active", default="64,1", help="active slots of each measurement (comma-separated)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps a call (the engine's DECODE_STEPS)")
    ap.add_argument("--prompt-len", type=int, default=70)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds since the epoch; 0: none")
    ap.add_argument("--out", default="")
    ap.add_argument("--admission", action="store_true", help="the engine's rate under three ways of admission")
    ap.add_argument("--batches", default="64,16")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from opt_serving.config import get_config
    from opt_serving.model import param_tree, wrapper
    from opt_serving.runner import sampler as sampler_mod
    from opt_serving.runner.generate import Generation
    from opt_serving.runner.load import local_slots
    from opt_serving.runner.types import DecodeStep, SlotSettings

    cfg = get_config(a.size)
    dev = str(jax.devices()[0])
    rows_out = []

    def write(**row):
        row = {"size": a.size, "dtype": a.dtype, "device": dev, "slots": a.slots, "steps": a.steps, **row}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    def left() -> float:
        return a.deadline - time.time() if a.deadline else 1e9

    t0 = time.perf_counter()
    ours = Generation.of(wrapper.OPTModel(cfg, param_tree.init_params(cfg, 0, getattr(jnp, a.dtype))))
    jax.block_until_ready(ours.fused_params)
    write(check="load_s", value=round(time.perf_counter() - t0, 2))
    rng = np.random.default_rng(0)
    if a.admission:
        return admission(a, cfg, ours, write, left, rng)
    greedy = SlotSettings(max_tokens=a.max_seq_len, logprob=False, top_logprobs=False)
    # every step of the measurement stays in one cache window: prompt_len + 1 + reps x steps entries at most
    reps = min(a.reps, (a.max_seq_len - a.prompt_len - 2) // a.steps)

    def filled(active: int, slots=None):
        if slots is None:
            slots = local_slots(cfg, ours.fused_params, num_slots=a.slots, max_seq_len=a.max_seq_len,
                                backend=ours.backend)
        for s in range(a.slots):
            if slots.table.lengths[s]:
                slots.free(s)
        for s in range(active):
            slots.insert(slots.prefill(rng.integers(4, cfg.vocab_size, a.prompt_len).tolist(), greedy), s)
        return slots

    def timed(fn, n_calls: int) -> list[float]:
        out = []
        for _ in range(n_calls):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3 / a.steps)
        return out

    def per_step(name: str, active: int, times: list[float], **more):
        write(check=name, active=active, ms=round(statistics.median(times), 3),
              all_ms=[round(t, 3) for t in times], **more)

    def measure(active: int, variant: str):
        # a first pass compiles (and settles the cache window), a second one on fresh requests is timed
        slots = None
        for timed_pass in (False, True):
            slots = filled(active, slots)
            st = slots.stages.stages[0]
            window = slots.window_needed(0, a.steps * reps)
            calls = timed(lambda: slots.step_many(a.steps), reps)
            if timed_pass:
                per_step(f"{variant}: slots.step_many", active, calls, window=window)
            if variant != "as built" or not timed_pass:
                continue
            if left() < 30:
                return
            # the stage's jitted call alone: the same inputs each time (the cache is donated and taken back)
            lengths = slots.table.lengths
            pos = np.where(lengths > 0, lengths - 1, 0).astype(np.int32)
            x, window, read_len = slots.table.next.copy(), slots.window_needed(0, a.steps), int(lengths.max())
            step = DecodeStep(0, pos, window, read_len, False, False, steps=a.steps)
            calls = timed(lambda: st.decode_steps(x, step), reps)
            per_step("stage.decode_steps", active, calls)

            def model_steps():
                h = None
                for i in range(a.steps):
                    h, st.caches[0] = st._step(st.params, st.caches[0], x, pos + i, np.int32(read_len + i), None, None)
                jax.block_until_ready(h)
            model_steps()  # (compiles the single step)
            per_step("model step only", active, timed(model_steps, reps))

    class PlainLax:  # jax.lax with cond taking its true branch (the argmax, for greedy rows that want no scores)
        def __getattr__(self, name):
            if name == "cond":
                return lambda pred, true_fn, false_fn, *ops: true_fn(*ops)
            return getattr(jax.lax, name)

    class PlainJax:
        lax = PlainLax()

        def __getattr__(self, name):
            return getattr(jax, name)

    for active in [int(x) for x in a.active.split(",")]:
        for variant in ("as built", "plain sampler"):
            if left() < 40:
                write(check="stopped", what=f"{variant} at {active} active: {left():.0f} s left")
                break
            if variant == "plain sampler":
                sampler_mod.jax = PlainJax()  # (traced at the new slot model's first call)
            try:
                measure(active, variant)
            finally:
                sampler_mod.jax = jax
        if left() > 40:
            x = rng.integers(4, cfg.vocab_size, (active, 32)).astype(np.int32)
            n = reps * a.steps
            np.asarray(ours.generate(x, max_new_tokens=n, min_new_tokens=n))  # compiles
            times = []
            for _ in range(3):
                t = time.perf_counter()
                np.asarray(ours.generate(x, max_new_tokens=n, min_new_tokens=n))
                times.append((time.perf_counter() - t) * 1e3 / n)
            per_step("generate() per token", active, times)
    print("\nper decode step (ms, median):")
    for r in rows_out:
        if "ms" in r:
            print(f"  {r['size']} {r['dtype']} active {r['active']:>3}  {r['check']:<34} {r['ms']:8.3f}")
    return 0


def admission(a, cfg, ours, write, left, rng) -> int:
    from benchmark.gpu.gpu_check_tools import Compiles, engine_counts, engine_rate
    from opt_serving.engine.admission import DECODE_STEPS, PREFILL_CHUNK
    from opt_serving.engine.scheduler import Engine
    from opt_serving.runner.load import local_slots
    from opt_serving.runner.slots import join_blocks
    batches = [int(x) for x in a.batches.split(",")]
    new = min(64, a.max_seq_len - 33)  # new tokens a request (64, as gpu_check.py, where the context holds them)
    slots = local_slots(cfg, ours.fused_params, num_slots=a.slots, max_seq_len=a.max_seq_len, backend=ours.backend)
    engine = Engine(slots, prefill_chunk=PREFILL_CHUNK, decode_steps=DECODE_STEPS)
    compiles = Compiles()
    cpu_blocks, gpu_blocks = (join_blocks(p, slots.max_seq_len, slots.join_room) for p in ("cpu", "gpu"))
    variants = {"a CPU's join blocks": cpu_blocks, "a GPU's join blocks": gpu_blocks, "no joining": None}
    try:
        for name, blocks in variants.items():
            slots.use_join_blocks(blocks or gpu_blocks)
            if blocks is None:
                slots.joins_steps = False
            for b in batches:
                if left() < 25:
                    write(check="stopped", what=f"{name} batch {b}: {left():.0f} s left")
                    return 0
                compiles.take()
                warm = []
                for _ in range(5):
                    engine_rate(engine, b, 32, new, cfg.vocab_size, rng)
                    warm.append(compiles.take())
                    if len(warm) >= 2 and not warm[-1][0] and not warm[-2][0]:
                        break
                before = engine.stats()
                rates = [engine_rate(engine, b, 32, new, cfg.vocab_size, rng) for _ in range(2)]
                counts = engine_counts(before, engine.stats(), "engine_")
                write(check="engine_tokens_per_s", variant=name, batch=b, new_tokens=new,
                      join_blocks=list(slots.join_blocks), value=round(max(rates), 1),
                      runs=[round(r, 1) for r in rates], compiles_in_timed=compiles.take()[0], warm_compiles=warm,
                      step_ms=round(engine._step_s * 1e3, 2), **counts)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA adapters served beside the base model: what they cost a decode step, and what loading one costs the
streams already running.

Two engines over the same random OPT weights (`--size`, default 125m; the CPU kernels where they run): the base
model alone, and the model serving `--adapters` random PEFT adapters of rank `--rank` on `--targets` (every
adapter in its own slot, --max-loras = the adapters + 1, for the one loaded late). Each round runs `--streams` greedy streams of `--prompt`
tokens and `--new` new tokens on each engine in turn, twice (base, LoRA, LoRA, base; the next round the other way
round, so a drift in the machine's load cancels), the adapters mixed evenly over the streams (stream i runs adapter
i mod adapters), and prints both engines' tokens/s side by side, and the median of the rounds' ratios.

Then the stall: with the streams running on the LoRA engine, another adapter is read and converted (off the
engine's thread, as /v1/load_lora_adapter does) and one more request naming it starts (its first request puts
it on the device between two steps). The largest gap between two outputs of any running stream while that
happens is printed beside the median gap (one decode call: --decode-steps steps) and the largest gap of a
round without a load.

    .venv/bin/python benchmark/offline/bench_lora.py [--size 125m] [--rounds 6] [--streams 32] [--adapters 8] [--rank 16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving


def build(a, lora, folders):
    """An engine over random weights of `a.size`; with `lora` (LoraOptions) serving `folders`."""
    from opt_serving.engine.scheduler import Engine
    from opt_serving.runner.load import load_slots
    from opt_serving.spec import ModelSpec
    # a slot more than the streams: the stall round's request of the adapter loaded late starts beside them
    slots = load_slots(ModelSpec.parse(f"jax/opt-{a.size}", dummy=True), "float32", num_slots=a.streams + 1,
                       max_seq_len=a.prompt + a.new + 8, prefix_caching=False, lora=lora)
    # steps a call fixed (decode_call_s unbounded): the served default takes fewer a call once a step is slower than
    # 0.15 s / decode_steps, which would let the two engines run different numbers of steps a call
    eng = Engine(slots, start=False, decode_steps=a.decode_steps, decode_call_s=3600)
    t0 = time.perf_counter()
    eng.warmup()
    eng.start()
    print(f"  {'LoRA' if lora else 'base'} engine warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
    return eng


def run_streams(eng, a, names, during=None):
    """`a.streams` streams (stream i naming names[i % len(names)]) to the end -> (tokens/s, every gap between two
    outputs of a stream with its start time, the `during` call's window or None)."""
    import numpy as np
    from opt_serving.runner.types import SlotSettings
    rng = np.random.default_rng(0)
    gaps, lock, finished, left = [], threading.Lock(), threading.Event(), [a.streams]
    window = {}

    def start(i):
        last = [None]

        def on_output(o):
            now = time.perf_counter()
            with lock:
                if last[0] is not None:
                    gaps.append((last[0], now - last[0]))
                last[0] = now
                if o.finish_reason:
                    left[0] -= 1
                    if not left[0]:
                        finished.set()

        prompt = rng.integers(3, 50000, a.prompt).tolist()
        eng.submit(prompt, SlotSettings(max_tokens=a.new, lora=names[i % len(names)]), on_output)

    t0 = time.perf_counter()
    for i in range(a.streams):
        start(i)
    if during is not None:
        time.sleep(a.load_after)  # the streams are decoding: then the load
        window["start"] = time.perf_counter()
        during()
        window["end"] = time.perf_counter()
    finished.wait()
    return a.streams * a.new / (time.perf_counter() - t0), gaps, window


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="125m")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,v_proj", help="PEFT's default for OPT; or e.g. "
                    "q_proj,k_proj,v_proj,out_proj,fc1,fc2")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--load-after", type=float, default=1.0, help="seconds into the stall round the load starts")
    a = ap.parse_args(argv)

    from benchmark.common import machine_description
    from opt_serving.config import get_config
    from opt_serving.model.lora_config import LoraOptions
    from opt_serving.testing.lora import write_adapter

    cfg, targets = get_config(a.size), tuple(a.targets.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    folders = [write_adapter(tmp / f"a{i}", cfg, targets, rank=a.rank, alpha=2 * a.rank, seed=i, std=0.02)
               for i in range(a.adapters + 1)]  # the last one is loaded during the stall round
    names = [f"a{i}" for i in range(a.adapters)]
    print(f"OPT-{a.size} random weights, {a.streams} streams x ({a.prompt} prompt + {a.new} new tokens), "
          f"{a.adapters} adapters of rank {a.rank} on {','.join(targets)}; {machine_description()}", flush=True)
    base = build(a, None, [])
    # an adapter slot more than the adapters: the one loaded late takes it while the others are held
    lora = build(a, LoraOptions(tuple(zip(names, map(str, folders))), a.adapters + 1, a.rank, targets), folders)
    try:
        ratios = []
        for r in range(a.rounds):  # ABBA within a round (BAAB the next): a drift of the machine's load cancels
            engines = [("base", base, [None]), ("lora", lora, names)]
            order = engines + engines[::-1] if r % 2 == 0 else engines[::-1] + engines
            rates = {"base": [], "lora": []}
            for label, eng, streams_names in order:
                rates[label].append(run_streams(eng, a, streams_names)[0])
            b, m = statistics.mean(rates["base"]), statistics.mean(rates["lora"])
            ratios.append(m / b)
            print(f"  round {r}: base {b:7.1f} tok/s   {a.adapters} adapters mixed {m:7.1f} tok/s   ({m / b:.2f}x)",
                  flush=True)
        print(f"median of the rounds' ratios: {statistics.median(ratios):.2f}x "
              f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
        for label, eng in (("base", base), ("lora", lora)):
            st = eng.stats()
            print(f"  {label}: {st.steps / max(st.step_calls, 1):.2f} steps a call, {st.joined} of {st.prefills} "
                  "prompts joined a step", flush=True)
        stall(a, lora, names, folders[-1])
    finally:
        base.close()
        lora.close()
    return 0


def stall(a, eng, names, folder) -> None:
    """The stall of the running streams while one more adapter is loaded and its first request starts."""
    from opt_serving.runner.types import SlotSettings
    _, quiet, _ = run_streams(eng, a, names)
    quiet_gaps = [g for _, g in quiet]

    def load():
        eng.model.loras.add("late", folder)  # read and converted here: this thread, not the engine's
        eng.submit([2, 10, 20, 30], SlotSettings(max_tokens=4, lora="late"), lambda o: None)

    _, gaps, window = run_streams(eng, a, names, during=load)
    # the gaps that overlap the load, or end within a second after it (its first request's device transfer)
    near = [g for t0, g in gaps if t0 <= window["end"] + 1.0 and t0 + g >= window["start"]]
    print(f"stall: a step call's median gap {statistics.median(quiet_gaps) * 1e3:.1f} ms, the largest gap of a "
          f"round without a load {max(quiet_gaps) * 1e3:.1f} ms; while an adapter loaded "
          f"({(window['end'] - window['start']) * 1e3:.0f} ms off the engine thread) and its first request "
          f"started, the largest gap {max(near) * 1e3:.1f} ms", flush=True)
    eng.model.loras.remove("late")


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check's report (gpu_check.py report): the table of every result in --out, one line a check, then
tokens/s by size, dtype and batch side by side with HF's."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmark.gpu.gpu_check import Run


def section_report(run: Run) -> None:
    """The table of every result in --out."""
    rows = [json.loads(line) for line in open(run.out)] if run.out.exists() else []
    env = next((r for r in rows if r.get("section") == "env"), {})
    print(f"\nGPU check on {env.get('torch_cuda') or env.get('device')} (jax {env.get('jax')}, "
          f"torch {env.get('torch')}, transformers {env.get('transformers')})")
    if "gb_per_s" in env:
        print(f"  copy bandwidth (read + written): {env['gb_per_s']:.0f} GB/s over {env['copy_bytes'] >> 20} MiB")
    for r in rows:
        if r.get("section") == "tiny" and "model" in r:
            what = r.get("value", r.get("ok"))
            print(f"  tiny {r['model']:<14} {r['check']:<30} {r.get('matmul_precision', ''):<8} {what}")
    speed: dict = {}
    for r in rows:
        if r.get("section") in ("model", "compile") and r.get("check", "").endswith("tokens_per_s"):
            # (the engine at several decode steps a call: the first measured, the check's first --engine-steps)
            cell = speed.setdefault((r["size"], label(r), r["batch"]), {})
            cell.setdefault(r["check"], r.get("value", r.get("error")))
        elif r.get("check") == "logits":
            print(f"  {r['size']:>5} {label(r):<9} logits vs torch float32: jax rel {r['jax_rel_err']:.2e} "
                  f"(top-1 {r['jax_top1']:.3f}), torch rel {r['torch_rel_err']:.2e} (top-1 {r['torch_top1']:.3f}), "
                  f"jax vs torch {r['jax_vs_torch']:.2e}")
        elif r.get("check") == "ttft":
            print(f"  {r['size']:>5} {label(r):<9} TTFT of {r['batch']} prompts of {r['prompt_len']} together: "
                  f"p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s ({r['tokens_per_s']:.0f} new tokens/s, "
                  f"{r['new_tokens']} each)")
        elif r.get("check") == "memory":
            gb = lambda x: f"{x / 2 ** 30:.2f}"  # noqa: E731
            m = r.get("memory", {})
            print(f"  {r['size']:>5} {label(r):<9} memory GiB: params {gb(r['param_bytes'])} (plan "
                  f"{gb(r['plan_param_bytes'])}), engine KV {gb(r['engine_cache_bytes'])} "
                  f"(plan {gb(r['plan_kv_bytes'])}),"
                  f" in use {gb(m.get('bytes_in_use', 0))}, peak {gb(m.get('peak_bytes_in_use', 0))} (plan total "
                  f"{gb(r['plan_memory_bytes'])} + act)")
    if speed:
        print(f"\n  {'size':>5} {'dtype':<9} {'batch':>5} {'HF eager':>10} {'HF compiled':>12} {'our generate':>13} "
              f"{'our engine':>11} {'gen/HF':>7} {'engine/HF':>9} {'engine/gen':>10}")
        for (size, dtype, b), s in sorted(speed.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            hf, gen, eng = (s.get(k) for k in ("hf_generate_tokens_per_s", "jax_generate_tokens_per_s",
                                               "engine_tokens_per_s"))
            print(f"  {size:>5} {dtype:<9} {b:>5} {fmt(hf):>10} {fmt(s.get('hf_compiled_tokens_per_s')):>12} "
                  f"{fmt(gen):>13} {fmt(eng):>11} {over(gen, hf):>7} {over(eng, hf):>9} {over(eng, gen):>10}")
    bounds = [r for r in rows if "bound_ms" in r]
    if bounds:
        print("\n  a decode step against its bytes at the copy bandwidth (weights + KV written):")
        print(f"  {'size':>5} {'dtype':<9} {'batch':>5} {'what':<9} {'ms':>7} {'bound ms':>8} {'ratio':>6}")
        for r in bounds:
            what, ms = (f"engine/{r.get('decode_steps', '?')}", r["step_ms"]) if "step_ms" in r else \
                ("generate", r["token_ms"])
            print(f"  {r['size']:>5} {label(r):<9} {r['batch']:>5} {what:<9} {ms:>7.3f} {r['bound_ms']:>8.3f} "
                  f"{ms / r['bound_ms']:>5.2f}x")
    stops = [r for r in rows if r.get("check") == "stopped"]
    for r in stops:
        print(f"  stopped: {r.get('what')}")


def label(r: dict) -> str:
    """A row's weights: its dtype, "+int8" where the weights were int8, and the variant it ran under, if any."""
    weights = r["dtype"] + (f"+{r['quantize']}" if r.get("quantize") else "")
    return weights + (f" {r['variant']}" if r.get("variant") else "")


def over(x, y) -> str:
    return f"{x / y:.2f}x" if isinstance(x, (int, float)) and isinstance(y, (int, float)) else "-"


def fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if isinstance(x, (int, float)) else str(x)[:12]

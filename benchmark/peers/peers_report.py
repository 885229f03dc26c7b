"""benchmark_peers.py's report: the machine and the sides above the table, the generation and prefill tables, and
batch 1 against the bound that reading the weights once a token at the measured bandwidth sets."""
from __future__ import annotations

import platform
import statistics
import subprocess
import time
from pathlib import Path

from benchmark.peers.peers_sides import SIDES, default_threads


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        name = info.get("Model name", "").strip()
    except OSError:
        name = ""
    if not name:
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    name = name or platform.processor() or "unknown CPU"
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    shown = [label for flag, label in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512_BF16"),
                                       ("avx512_vnni", "AVX512_VNNI"), ("amx_tile", "AMX"))
             if flag in flags] or [label for flag, label in (("avx2", "AVX2"),) if flag in flags]
    return f"{name} ({', '.join(shown)})" if shown else name


def _git_rev(src: str) -> str:
    if not (Path(src) / ".git").exists():
        return f"the tree at {src}"
    try:
        rev = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+local changes" if dirty else "")
    except OSError:
        return "?"


def _fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"**{a / b:.2f}x**"


def header(args, infos: dict) -> str:
    ct2_info = next((i for i in infos.values() if "ctranslate2" in i), {})
    ct2 = ct2_info.get("ctranslate2", "?")
    ct2_extra = "; ".join(filter(None, [ct2_info.get("backend"), " ".join(ct2_info.get("env", []))]))
    hf_info = next((i for i in infos.values() if "transformers" in i), None)
    hf_text = (f"HF PyTorch: transformers {hf_info['transformers']}, torch {hf_info['torch']}, "
               f"{hf_info['threads']} threads. ") if hf_info else ""
    order = ", ".join(["ours", "CTranslate2"] + (["HF"] if hf_info else []))
    model = f"{args.size} shape, random weights (seed {args.seed}, 2-D weights x{args.weight_scale:g})" \
        if not args.hf_dir else f"weights from {args.hf_dir}"
    return (f"{cpu_model()}, {default_threads()} CPUs, {platform.system()} {platform.machine()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {model}. Ours: code {_git_rev(args.ours_src)}, "
            f"{args.threads} threads; CTranslate2 {ct2} ({ct2_extra + '; ' if ct2_extra else ''}inter_threads 1, "
            f"intra_threads {args.threads}). "
            f"{hf_text}Each side in its own process, {args.warmup} warm-up call(s), then {args.reps} timed calls "
            f"each, interleaved ({order}, ...), {args.pause:g} s rest before each"
            + (f", each started once other processes used < {args.wait_quiet:g} cores" if args.wait_quiet is not None
               else "") + ".")


def _runs(side: dict, digits: int) -> str:
    """'620.0, 75.1*, 640.0': a star on the calls other processes disturbed (left out of the median)."""
    marks = side.get("disturbed") or [False] * len(side["runs"])
    return ", ".join(f"{x:.{digits}f}{'*' if d else ''}" for x, d in zip(side["runs"], marks))


def generation_table(rows: list[dict]) -> str:
    lines = ["| dtype | batch | ours tokens/s (runs) | CT2 tokens/s (runs) | ours median | CT2 median | ours / CT2 "
             "| ours ms/token | CT2 ms/token | ours = CT2 tokens | vs own float32 (ours / CT2) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        o, c = r.get("ours"), r.get("ct2")
        runs = lambda s: _runs(s, 1) if s else "not available"  # noqa: E731
        ms = lambda s: _fmt(1e3 / s["median"] * r["batch"]) if s else "-"  # noqa: E731  (per step, whole batch)
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        vs = r.get("vs_float32", {})
        own = "-" if not vs else f"{pct(vs.get('ours'))} / {pct(vs.get('ct2'))}"
        lines.append(f"| {r['dtype']} | {r['batch']} | {runs(o)} | {runs(c)} | {_fmt(o and o['median'])} "
                     f"| {_fmt(c and c['median'])} | {_ratio(o and o['median'], c and c['median'])} "
                     f"| {ms(o)} | {ms(c)} | {pct(r.get('agree'))} | {own} |")
    return "\n".join(lines)


def prefill_table(rows: list[dict]) -> str:
    lines = ["| dtype | prompt | ours prompt tokens/s (runs) | CT2 (runs) | HF (runs) | ours median | CT2 median "
             "| HF median | ours / CT2 | ours / HF | ours TTFT ms |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        o, c, h = r.get("ours"), r.get("ct2"), r.get("hf")
        runs = lambda s, none="not available": _runs(s, 0) if s else none  # noqa: E731
        med = lambda s: s and s["median"]  # noqa: E731
        ttft = _fmt(1e3 * r["prompt"] / o["median"]) if o else "-"
        hf_none = "not available" if r["dtype"] == "float32" else "-"  # HF runs float32 only here
        lines.append(f"| {r['dtype']} | {r['prompt']} | {runs(o)} | {runs(c)} | {runs(h, hf_none)} | {_fmt(med(o), 0)} "
                     f"| {_fmt(med(c), 0)} | {_fmt(med(h), 0)} | {_ratio(med(o), med(c))} | {_ratio(med(o), med(h))} "
                     f"| {ttft} |")
    return "\n".join(lines)


def weight_bytes_per_token(cfg: dict, dtype: str) -> float:
    """Bytes of weights a batch-1 decode step must read once: every layer's four matrices and the output head
    (the tied embedding) at `dtype`'s width (int8: one byte, its per-channel scales left out)."""
    d, f, n = cfg["hidden_size"], cfg["ffn_dim"], cfg["num_hidden_layers"]
    width = {"int8": 1, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    return (n * (4 * d * d + 2 * d * f) + cfg["vocab_size"] * cfg.get("word_embed_proj_dim", d)) * width


def bandwidth_lines(rows: list[dict], cfg: dict, threads: int) -> list[str]:
    """The batch-1 rows against the limit set by reading the weights once per token at the measured bandwidth."""
    ones = [r for r in rows if r.get("batch") == 1]
    if not ones:
        return []
    out = [f"Batch 1 against reading the weights once a token at this machine's read bandwidth ({threads} threads; "
           "the median of the readings taken between the row's rounds of runs):"]
    for r in ones:
        readings = next((r[k]["bandwidth"] for k in SIDES if r.get(k) and r[k].get("bandwidth")), None)
        if not readings:  # no side ran this row
            continue
        bw = statistics.median(readings)
        out.append(f"  {r['dtype']}: read bandwidth {bw:.1f} GB/s (readings "
                   f"{', '.join(f'{x:.1f}' for x in readings)})")
        limit = bw * 1e9 / weight_bytes_per_token(cfg, r["dtype"])
        sides = ", ".join(f"{SIDES[k]} {r[k]['median']:.1f} ({r[k]['median'] / limit:.0%})"
                          for k in SIDES if r.get(k) and r[k]["median"])
        out.append(f"  {r['dtype']}: {weight_bytes_per_token(cfg, r['dtype']) / 1e9:.2f} GB a token -> at most "
                   f"{limit:.1f} tokens/s; {sides}")
    return out

"""Draw the recorded benchmark results as PNG plots in docs/img/; one command redraws every one.

Usage (matplotlib: `.venv/bin/pip install -r requirements-docs.txt`):
  .venv/bin/python benchmark/plots.py            # every plot into docs/img/
  .venv/bin/python benchmark/plots.py --list     # what each plot reads; nothing drawn

It reads only results kept in the repository, and draws nothing it has no numbers for:
  benchmark/results/gpu/*.jsonl       the GPU check's records (gpu_check.sh, gpu/gpu_engine_probe.py)
  benchmark/results/cpu_tables.json   CPU figures transcribed from benchmark/README.md (each names its section)
  benchmark/results/*.json            `peers/serve_vs_vllm.py --json` runs, where one was saved there
A plot whose data is absent is skipped with a line saying so. Every panel shows figures measured side by side
in one run; a panel never mixes runs, since figures from different runs or days do not compare.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_RUNS = ROOT / "benchmark" / "results" / "gpu"
RESULTS = ROOT / "benchmark" / "results"
OUT = ROOT / "docs" / "img"

# the GPU check's tokens/s records, by side
GPU_SIDES = {"hf_generate_tokens_per_s": "HF eager", "hf_compiled_tokens_per_s": "HF compiled",
             "jax_generate_tokens_per_s": "our generate()", "engine_tokens_per_s": "our engine"}
SIDE_COLORS = {"HF eager": "#ff7f0e", "HF compiled": "#d62728", "our generate()": "#2ca02c", "our engine": "#1f77b4"}
# a GPU's nominal memory bandwidth (bytes/s), from its maker's sheet: the batch-1 bound. Only the cards runs were
# recorded on; a run on another card is left out of that plot until its figure is added here.
NOMINAL_BANDWIDTH = {"NVIDIA H200": 4.8e12}
COLORS = {"ours": "#1f77b4", "peer": "#d62728", "hf": "#ff7f0e", "ct2": "#d62728", "other": "#7f7f7f"}


def median(xs):
    return statistics.median(xs)


def read_jsonl(path: Path) -> list[dict]:
    return [dict(json.loads(line), file=path.stem) for line in path.read_text().splitlines() if line.strip()]


# ---- GPU records ----

def gpu_check_records() -> list[dict]:
    """Records of gpu_check.py's model and compile sections (not the probes' files, which have no section)."""
    out = []
    for path in sorted(GPU_RUNS.glob("*.jsonl")):
        out += [r for r in read_jsonl(path) if r.get("section") in ("model", "compile")]
    return out


def gpu_panels(records: list[dict]) -> dict:
    """(size, dtype, quantize) -> (run file, {side: {batch: tokens/s}}, that run's records of the model): for each
    model the latest run among those that measured the most sides of it (a run the device budget cut short shows
    fewer). A value measured twice in a run (a section rerun) is its last."""
    runs: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in records:
        if r.get("check") in GPU_SIDES and "batch" in r:
            key = (r["size"], r["dtype"], r.get("quantize"))
            runs[key][r["file"]][GPU_SIDES[r["check"]]][r["batch"]] = r["value"]
    panels = {}
    for key, by_file in runs.items():
        file = max(by_file, key=lambda f: (len(by_file[f]), f))
        model_records = [r for r in records if r["file"] == file and (r.get("size"), r.get("dtype"),
                                                                       r.get("quantize")) == key]
        panels[key] = (file, by_file[file], model_records)
    return dict(sorted(panels.items(), key=lambda kv: (float(kv[0][0].rstrip("b")), kv[0][1], kv[0][2] or "")))


def model_label(key) -> str:
    size, dtype, quantize = key
    return f"OPT-{size} {dtype}" + (f", {quantize} weights" if quantize else "")


def plot_gpu_tokens(plt, records, out: Path) -> str:
    panels = gpu_panels(records)
    if not panels:
        return "no gpu_check.py records in benchmark/results/gpu/"
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.9 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, (file, sides, _)) in zip(axes.flat, panels.items()):
        for side in SIDE_COLORS:
            by_batch = sides.get(side)
            if by_batch:
                batches = sorted(by_batch)
                ax.plot(batches, [by_batch[b] for b in batches], marker="o", label=side, color=SIDE_COLORS[side])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([1, 16, 64], ["1", "16", "64"])
        ax.set_xlabel("batch (rows; the engine: concurrent requests)", fontsize=8)
        ax.set_ylabel("new tokens/s", fontsize=8)
        ax.set_title(f"{model_label(key)}\n{file}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("One GPU: new tokens/s, prompt 32, 64 new tokens a row (each panel one run)")
    return save(fig, out / "gpu_tokens_per_s.png")


def plot_gpu_bound(plt, records, out: Path) -> str:
    """Batch 1 against reading every weight once a token at the card's nominal bandwidth."""
    rows, skipped = [], set()
    for key, (file, sides, model_records) in gpu_panels(records).items():
        load = next((r for r in model_records if r.get("check") == "jax_load_s" and "param_bytes" in r), None)
        if load is None:
            continue
        device = load["device"].removeprefix("gpu:")
        if device not in NOMINAL_BANDWIDTH:
            skipped.add(device)
            continue
        bound = NOMINAL_BANDWIDTH[device] / load["param_bytes"]
        for side in SIDE_COLORS:
            if 1 in sides.get(side, {}):
                rows.append((f"{model_label(key)}: {side}", sides[side][1], bound, f"{device}, {file}", side))
    if not rows:
        return "no batch-1 GPU rows with a known nominal bandwidth" + (f" (unknown: {sorted(skipped)})" if skipped
                                                                         else "")
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.6))
    labels = [r[0] for r in rows][::-1]
    shares = [100 * r[1] / r[2] for r in rows][::-1]
    bars = ax.barh(labels, shares, color=[SIDE_COLORS[r[4]] for r in rows[::-1]])
    for bar, r in zip(bars, rows[::-1]):
        ax.text(bar.get_width() + 1, bar.get_y() + bar.get_height() / 2,
                f"{bar.get_width():.0f}%: {r[1]:.0f} of {r[2]:.0f} tokens/s ({r[3]})", va="center", fontsize=7)
    ax.set_xlim(0, 140)
    ax.axvline(100, color="black", lw=0.8)
    ax.set_xlabel("% of the bound: the card's nominal bandwidth (" + ", ".join(
        f"{d} {b / 1e12:.1f} TB/s" for d, b in NOMINAL_BANDWIDTH.items()) + ") / the bytes of weights a token")
    ax.set_title("Batch 1 on one GPU against reading every weight once a token\n"
                 "(64 new tokens after a 32-token prompt; the prompt's pass is in the time)", fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    return save(fig, out / "gpu_batch1_bound.png")


def plot_gpu_int8(plt, records, out: Path) -> str:
    """int8 weights against float16 ones, both in one run."""
    by_file: dict = defaultdict(lambda: defaultdict(dict))
    for r in records:
        if r.get("check") == "engine_tokens_per_s":
            weights = f"{r['quantize']} weights" if r.get("quantize") else f"{r['dtype']} weights"
            by_file[r["file"]][(r["size"], weights)][r["batch"]] = r["value"]
    runs = {f: m for f, m in by_file.items() if any(w == "int8 weights" for _, w in m)}
    if not runs:
        return "no run with int8 weights in benchmark/results/gpu/"
    file = max(runs)
    models = runs[file]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (size, weights), by_batch in sorted(models.items()):
        batches = sorted(by_batch)
        ax.plot(batches, [by_batch[b] for b in batches], marker="o", label=f"OPT-{size}, {weights}")
    for size in sorted({size for size, _ in models}):
        base = models.get((size, "float16 weights"), {})
        for (s, weights), by_batch in models.items():
            if s == size and weights != "float16 weights":
                for b, v in by_batch.items():
                    if b in base:
                        ax.annotate(f"{v / base[b]:.2f}x", (b, v), textcoords="offset points", xytext=(0, -14),
                                    ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 16, 64], ["1", "16", "64"])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("new tokens/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Our engine on one GPU, float16 activations:\nint8 against float16 weights, one run ({file})",
                 fontsize=9)
    return save(fig, out / "gpu_int8.png")


def plot_gpu_joins(plt, out: Path) -> str:
    """gpu_engine_probe.py --admission: the engine's tokens/s with each way of letting prompts join steps."""
    runs = {}
    for path in sorted(GPU_RUNS.glob("*admission*.jsonl")):
        rows = [r for r in read_jsonl(path) if r.get("check") == "engine_tokens_per_s" and "variant" in r]
        if rows:
            runs[path.stem] = rows
    if not runs:
        return "no gpu_engine_probe.py --admission records in benchmark/results/gpu/"
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (file, rows) in zip(axes[0], runs.items()):
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        batches = sorted({r["batch"] for r in rows})
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            vals = {r["batch"]: r["value"] for r in rows if r["variant"] == v}
            ax.bar([j + i * width for j in range(len(batches))], [vals.get(b, 0) for b in batches], width, label=v)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
        ax.set_xlabel("concurrent requests")
        ax.set_title(f"OPT-{rows[0]['size']} {rows[0]['dtype']} ({file})", fontsize=9)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("new tokens/s")
    fig.suptitle("Our engine on one GPU: how prompts join decode steps")
    return save(fig, out / "gpu_join_blocks.png")


# ---- CPU tables (benchmark/results/cpu_tables.json) ----

def runs_panel(ax, rows, x_key, sides, ratio_of=None):
    """Each side's runs as dots and their medians as a line over the categorical x; the ratio of the medians of
    `ratio_of` = (a, b) written above each x."""
    xs = list(range(len(rows)))
    for side, label, color in sides:
        for x, row in zip(xs, rows):
            ax.scatter([x] * len(row[side]), row[side], s=10, color=color, alpha=0.5)
        ax.plot(xs, [median(row[side]) for row in rows], marker="o", color=color, label=label)
    if ratio_of:
        a, b = ratio_of
        top = max(max(row[a] + row[b]) for row in rows)
        for x, row in zip(xs, rows):
            ax.text(x, top * 1.08, f"{median(row[a]) / median(row[b]):.2f}x", ha="center", fontsize=8)
        ax.set_ylim(0, top * 1.2)
    ax.set_xticks(xs, [str(row[x_key]) for row in rows])
    ax.grid(True, axis="y", alpha=0.3)


def plot_cpu_peers(plt, tables, out: Path) -> str:
    hf, ct2 = tables.get("offline_hf"), tables.get("offline_ct2")
    if not hf or not ct2:
        return "offline_hf / offline_ct2 missing from cpu_tables.json"
    panels = [("Hugging Face transformers\nOPT-125m float32 (2026-11-23)", hf["rows"], "HF")]
    for size, dtype, when in (("opt-125m", "float32", "2026-11-25"), ("opt-125m", "int8", "2026-11-25"),
                              ("opt-1.3b", "float32", "2026-11-26"), ("opt-1.3b", "int8", "2026-11-26")):
        rows = [r for r in ct2["rows"] if r["size"] == size and r["dtype"] == dtype]
        panels.append((f"CTranslate2 4.8.5\n{size.replace('opt', 'OPT')} {dtype} ({when})", rows, "CTranslate2"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 4))
    for ax, (title, rows, peer) in zip(axes, panels):
        runs_panel(ax, rows, "batch", [("ours", "ours", COLORS["ours"]), ("peer", peer, COLORS["peer"])],
                   ratio_of=("ours", "peer"))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("batch")
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("new tokens/s (dots: runs, line: medians)")
    fig.suptitle("Offline on the 2-core AMD EPYC, each side in its own process, interleaved (ours / peer above)")
    return save(fig, out / "cpu_offline_peers.png")


def plot_cpu_bound(plt, tables, out: Path) -> str:
    t = tables.get("batch1_bound")
    if not t:
        return "batch1_bound missing from cpu_tables.json"
    labels, ours, peer, notes = [], [], [], []
    for r in t["rows"]:
        bound = median(r["bandwidth_gbs"]) / r["gb_per_token"]
        labels.append(f"{r['when']}, {r['dtype']}")
        ours.append(100 * median(r["ours"]) / bound)
        peer.append(100 * median(r["peer"]) / bound)
        notes.append(f"bound {bound:.1f} tokens/s ({median(r['bandwidth_gbs']):.1f} GB/s)")
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(labels) + 1.6))
    ys = list(range(len(labels)))[::-1]
    ax.barh([y + 0.2 for y in ys], ours, 0.4, color=COLORS["ours"], label="ours")
    ax.barh([y - 0.2 for y in ys], peer, 0.4, color=COLORS["ct2"], label="CTranslate2")
    for y, o, p, n in zip(ys, ours, peer, notes):
        ax.text(o + 1, y + 0.2, f"{o:.0f}%  {n}", va="center", fontsize=7)
        ax.text(p + 1, y - 0.2, f"{p:.0f}%", va="center", fontsize=7)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.axvline(100, color="black", lw=0.8)
    ax.set_xlim(0, 140)
    ax.set_xlabel("% of the bound: measured read bandwidth / bytes of weights a token (medians of the runs)")
    ax.set_title("OPT-1.3b at batch 1 on the 2-core AMD EPYC against reading every weight once a token", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return save(fig, out / "cpu_batch1_bound.png")


def plot_cpu_prefill(plt, tables, out: Path) -> str:
    t = tables.get("prefill")
    if not t:
        return "prefill missing from cpu_tables.json"
    rows = t["rows"]
    sides = [("ours", "ours", COLORS["ours"]), ("ct2", "CTranslate2", COLORS["ct2"]),
             ("hf", "Hugging Face", COLORS["hf"])]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, (key, label, color) in enumerate(sides):
        xs = [j + (i - 1) * width for j in range(len(rows)) if rows[j][key] is not None]
        ax.bar(xs, [r[key] for r in rows if r[key] is not None], width, label=label, color=color)
    for j, r in enumerate(rows):
        ax.text(j - width, r["ours"] + 40, f"TTFT\n{r['ours_ttft_ms']} ms", ha="center", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"{r['dtype']}, {r['prompt']} tokens" for r in rows])
    ax.set_ylabel("prompt tokens/s to the first token")
    ax.set_ylim(0, max(r["ours"] for r in rows) * 1.35)
    ax.legend(fontsize=8)
    ax.set_title("One prompt's prefill, OPT-125m, 2-core AMD EPYC (2026-11-25; no HF int8)", fontsize=10)
    return save(fig, out / "cpu_prefill.png")


def plot_cpu_bfloat16(plt, tables, out: Path) -> str:
    t = tables.get("bfloat16")
    if not t:
        return "bfloat16 missing from cpu_tables.json"
    fig, ax = plt.subplots(figsize=(6, 4))
    runs_panel(ax, t["rows"], "batch", [("float32", "float32", COLORS["other"]),
                                        ("bfloat16", "bfloat16", COLORS["ours"])], ratio_of=("bfloat16", "float32"))
    ax.set_xlabel("batch")
    ax.set_ylabel("new tokens/s (dots: runs, line: medians)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Our generate(), OPT-125m, 2-core AMD EPYC with AVX512_BF16 (2026-11-25)\n"
                 "bfloat16 / float32 above", fontsize=9)
    return save(fig, out / "cpu_bfloat16.png")


def plot_prefix_caching(plt, tables, out: Path) -> str:
    pc, lm = tables.get("prefix_caching"), tables.get("lm_eval")
    if not pc or not lm:
        return "prefix_caching / lm_eval missing from cpu_tables.json"
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = [COLORS["ours"], COLORS["other"]]
    for ax, (key, label) in zip(axes[:2], (("tokens_per_s", "output tokens/s"), ("ttft", "TTFT (ms)"))):
        if key == "ttft":
            width = 0.38
            for i, r in enumerate(pc["rows"]):
                for j, q in enumerate(("ttft_p50_ms", "ttft_p99_ms")):
                    ax.bar(j + (i - 0.5) * width, median(r[q]), width, color=colors[i],
                           label=r["server"] if j == 0 else None)
                    ax.scatter([j + (i - 0.5) * width] * len(r[q]), r[q], s=10, color="black")
            ax.set_xticks([0, 1], ["p50", "p99"])
        else:
            for i, r in enumerate(pc["rows"]):
                ax.bar(i, median(r[key]), color=colors[i], label=r["server"])
                ax.scatter([i] * len(r[key]), r[key], s=10, color="black")
            ax.set_xticks([0, 1], [r["server"] for r in pc["rows"]], fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[0].set_title("64 requests sharing a 448-token prefix,\n16 streams (2026-11-26)", fontsize=9)
    axes[1].set_title("the same: time to first token", fontsize=9)
    width = 0.38
    for i, r in enumerate(lm["rows"]):
        for j, q in enumerate(("in_requests_s", "wall_s")):
            ax = axes[2]
            ax.bar(j + (i - 0.5) * width, median(r[q]), width, color=colors[i], label=r["server"] if j == 0 else None)
            ax.scatter([j + (i - 0.5) * width] * len(r[q]), r[q], s=10, color="black")
    axes[2].set_xticks([0, 1], ["seconds in requests", "lm_eval's wall time"])
    axes[2].set_ylabel("seconds")
    axes[2].legend(fontsize=8)
    axes[2].set_title("lm-eval 5-shot multiple choice, 160 requests\n(2026-11-26; scores identical)", fontsize=9)
    fig.suptitle("Prefix caching, served, OPT-125m float32, 2-core AMD EPYC (bars: medians, dots: runs)")
    return save(fig, out / "prefix_caching.png")


# ---- served runs against vLLM (serve_vs_vllm.py --json) ----

def serve_vs_vllm_runs() -> dict:
    """(scenario, dtype) -> the latest serve_vs_vllm.py --json file's contents for it."""
    found = {}
    for path in sorted(RESULTS.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "scenario" in data and "runs" in data:
            key = (data["scenario"], data.get("dtype", "float32"))
            if key not in found or data.get("time", "") >= found[key][1].get("time", ""):
                found[key] = (path.name, data)
    return found


def plot_served(plt, out: Path) -> list[str]:
    found = serve_vs_vllm_runs()
    if not found:
        return ["no serve_vs_vllm.py --json results in benchmark/results/ (run it with --json "
                "benchmark/results/serve_vs_vllm-SCENARIO-DTYPE.json)"]
    written = []
    for (scenario, dtype), (name, data) in sorted(found.items()):
        servers = list(dict.fromkeys(r["server"] for r in data["runs"]))
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for ax, (key, label, scale) in zip(axes, (("tokens_per_s", "output tokens/s", 1),
                                                  ("ttft_p50_s", "TTFT p50 (ms)", 1e3),
                                                  ("ttft_p99_s", "TTFT p99 (ms)", 1e3))):
            for i, s in enumerate(servers):
                vals = [scale * r[key] for r in data["runs"] if r["server"] == s]
                color = COLORS["peer"] if s.startswith("vllm") else COLORS["ours"]
                ax.bar(i, median(vals), color=color, alpha=0.6 if s.endswith(("-defaults", "-no-prefix")) else 1)
                ax.scatter([i] * len(vals), vals, s=10, color="black")
            ax.set_xticks(range(len(servers)), servers, fontsize=8)
            ax.set_ylabel(label)
        fig.suptitle(f"Served, scenario {scenario}, {dtype}, {data.get('time', '')} ({name}; bars: medians, "
                     "dots: rounds)", fontsize=10)
        written.append(save(fig, out / f"served_{scenario}_{dtype}.png"))
    return written


def save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt
    plt.close(fig)
    return f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"


PLOTS = [
    ("gpu_tokens_per_s.png", "benchmark/results/gpu/*.jsonl (gpu_check.py): tokens/s by batch, HF eager and compiled, "
                             "our generate() and engine, one panel a model, from the latest run that measured the most sides of it"),
    ("gpu_batch1_bound.png", "the same runs: batch 1 against the card's nominal bandwidth over the weights' bytes"),
    ("gpu_int8.png", "the latest run with int8 weights: our engine, int8 against float16 weights"),
    ("gpu_join_blocks.png", "benchmark/results/gpu/*admission*.jsonl (gpu_engine_probe.py --admission)"),
    ("cpu_offline_peers.png", "cpu_tables.json offline_hf, offline_ct2: ours against HF and CTranslate2 by batch"),
    ("cpu_batch1_bound.png", "cpu_tables.json batch1_bound: OPT-1.3b batch 1 against the measured bandwidth"),
    ("cpu_prefill.png", "cpu_tables.json prefill: one prompt's prefill against CTranslate2 and HF, our TTFT"),
    ("cpu_bfloat16.png", "cpu_tables.json bfloat16: bfloat16 against float32 by batch"),
    ("prefix_caching.png", "cpu_tables.json prefix_caching, lm_eval: tokens/s and TTFT with and without the cache"),
    ("served_SCENARIO_DTYPE.png", "benchmark/results/*.json from serve_vs_vllm.py --json: ours against vLLM"),
]


def main(argv=None) -> int:
    global RESULTS, GPU_RUNS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(OUT), help="folder to write the PNGs in (default docs/img)")
    p.add_argument("--results", default=str(RESULTS), help="folder of cpu_tables.json and serve_vs_vllm.py runs")
    p.add_argument("--gpu-runs", default=str(GPU_RUNS), help="folder of the GPU check's .jsonl records")
    p.add_argument("--list", action="store_true", help="print what each plot reads, draw nothing")
    args = p.parse_args(argv)
    if args.list:
        for name, what in PLOTS:
            print(f"{name:26} {what}")
        return 0
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: .venv/bin/pip install -r requirements-docs.txt", file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    RESULTS, GPU_RUNS = Path(args.results), Path(args.gpu_runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables_path = RESULTS / "cpu_tables.json"
    tables = json.loads(tables_path.read_text()) if tables_path.exists() else {}
    records = gpu_check_records()
    lines = [plot_gpu_tokens(plt, records, out), plot_gpu_bound(plt, records, out), plot_gpu_int8(plt, records, out),
             plot_gpu_joins(plt, out), plot_cpu_peers(plt, tables, out), plot_cpu_bound(plt, tables, out),
             plot_cpu_prefill(plt, tables, out), plot_cpu_bfloat16(plt, tables, out),
             plot_prefix_caching(plt, tables, out), *plot_served(plt, out)]
    for line in lines:
        print(line if line.startswith("wrote") else f"skipped: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

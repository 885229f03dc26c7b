"""Small helpers shared by the two benchmark scripts: FLOPs, memory, statistics, result files."""
from __future__ import annotations

import csv
import json
import os
import platform
import resource
import time
from pathlib import Path

import numpy as np


def gpt_inference_tflops(batch_size: int, num_tokens: int, seq_len: int, num_layers: int,
                         hidden_size: int, vocab_size: int, latency_s: float,
                         num_devices: int = 1) -> float:
    """Alpa's `compute_gpt_tflops_inference_with_padding`, unchanged so figures compare with Alpa's.

    FLOPs = 24 * B * T * h^2 * L * (1 + S / (6h))  +  2 * B * T * h * V
      B = rows (batch x beams), T = tokens passed through the model per row (prompt + generated),
      S = the length every token is assumed to attend over (padded: prompt + generated),
      h = hidden size, L = layers, V = vocabulary.
    24 h^2 L is 2 FLOPs per multiply-add over the 12 h^2 weights of a layer (QKV, out, fc1, fc2);
    the S/(6h) term is attention's QK^T and AV (4 h S per token per layer); 2hV is the logits.
    Forward passes only, no KV cache credit: a decode step that reuses the cache is counted as
    doing the same work as re-running the token, which is what Alpa did.
    """
    flops = (24 * batch_size * num_tokens * hidden_size ** 2 * num_layers * (1 + seq_len / (6 * hidden_size))
             + 2 * batch_size * num_tokens * hidden_size * vocab_size)
    return flops / latency_s / num_devices / 1e12


def peak_rss_mb() -> float:
    """Process-wide peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    import psutil
    return psutil.Process(os.getpid()).memory_info().rss / 2 ** 20


def summarize(values) -> dict:
    """mean / median / p99 / min / max of a list of floats (NaN when empty)."""
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {k: float("nan") for k in ("mean", "median", "p99", "min", "max")}
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "min": float(a.min()), "max": float(a.max())}


def machine_description() -> str:
    """e.g. 'Linux x86_64, 2 CPU cores' plus accelerators when JAX or torch see any."""
    desc = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
    try:
        import torch
        if torch.cuda.is_available():
            desc += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return desc


def append_tsv(path: str | os.PathLike, row: dict) -> None:
    """Append one row; write the header when the file is new or empty.

    A file written with other columns gets a fresh header line before the row, so a reader can
    split on header lines instead of misreading columns.
    """
    path = Path(path)
    fields = list(row)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path) as f:
            header = None
            for line in f:
                if line.startswith("time\t"):
                    header = line.rstrip("\n").split("\t")
        new = header != fields
    with open(path, "a", newline="") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        if new:
            w.writerow(fields)
        w.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row.values()])


def write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")

"""benchmark_peers.py's sides driven in turn: each in a process of its own (peers_worker.py), warm-up calls, then
timed calls interleaved ABAB with the machine's other load measured beside each (/proc/stat)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from benchmark.peers.peers_build import REPO, WORKER, _ours_env

SIDES = {"ours": "ours", "ct2": "CTranslate2", "hf": "HF PyTorch"}


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_busy_s() -> float | None:
    """CPU seconds spent by every process on the machine so far (/proc/stat; None where there is none)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def ct2_backend_from_log(text: str) -> str:
    """'ISA AVX2, MKL false, SGEMM DNNL, GEMM_S8 DNNL' from CTranslate2's load log (CT2_VERBOSE=1)."""
    keys = {"Selected ISA": "ISA", "Use Intel MKL": "MKL", "SGEMM backend": "SGEMM", "GEMM_S8 backend": "GEMM_S8"}
    found = {}
    for line in text.splitlines():
        for key, short in keys.items():
            if f" - {key}: " in line:
                found[short] = line.split(f" - {key}: ", 1)[1].split(" (")[0].strip()
    return ", ".join(f"{k} {found[k]}" for k in keys.values() if k in found)


def wait_quiet(cores: float, most_s: float) -> None:
    """Sleep until everything on the machine (the sides are idle now) used less than `cores` over one second."""
    t0 = time.perf_counter()
    while True:
        b0 = machine_busy_s()
        if b0 is None:
            return
        time.sleep(1.0)
        busy = machine_busy_s() - b0
        if busy < cores:
            if time.perf_counter() - t0 > 1.5:
                print(f"  (waited {time.perf_counter() - t0:.0f} s for a quiet machine)", flush=True)
            return
        if time.perf_counter() - t0 > most_s:
            print(f"  (machine still busy after {most_s:g} s: other processes {busy:.2f} cores; going on)",
                  flush=True)
            return


class Unavailable(Exception):
    pass


class Side:
    """One side in its own process, loaded once; `call(ids, new)` -> (seconds, new ids)."""

    def __init__(self, kind: str, python: str, folder: str, dtype: str, args, log_dir: Path):
        self.kind, self.dtype = kind, dtype
        self.name = SIDES[kind]
        self.log_path = log_dir / f"{kind}-{dtype}.log"
        env = _ours_env(args) if kind == "ours" else dict(os.environ)
        if kind == "ours":
            env["OPT_SERVING_CPU_THREADS"] = str(args.threads)
        if kind == "ct2":
            env["CT2_VERBOSE"] = "1"  # it logs the ISA and GEMM backends it picked when it loads (nothing per call)
            env.update(kv.split("=", 1) for kv in args.ct2_env)
        self.log = open(self.log_path, "w")
        cmd = [python, str(WORKER), kind, "--model-dir", folder, "--dtype", dtype,
               "--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=args.ours_src if kind == "ours" else str(REPO))
        first = self._reply()
        if not first["ok"]:
            self.close()
            if first.get("unavailable"):
                raise Unavailable(first["error"])
            raise SystemExit(f"{self.name} ({dtype}) failed to load: {first['error']}\n{self._log_tail()}")
        self.load_s, self.info = first["load_s"], first["info"]
        if kind == "ct2":
            self.info["backend"] = self._ct2_backend()
            if args.ct2_env:
                self.info["env"] = list(args.ct2_env)

    def _ct2_backend(self) -> str:
        self.log.flush()
        return ct2_backend_from_log(self.log_path.read_text())

    def _log_tail(self) -> str:
        self.log.flush()
        try:
            return "".join(self.log_path.read_text().splitlines(keepends=True)[-30:])
        except OSError:
            return ""

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise SystemExit(f"{self.name} ({self.dtype}): its process died (exit {self.proc.returncode}); "
                             f"log {self.log_path}:\n{self._log_tail()}")
        return json.loads(line)

    def call(self, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        """-> (seconds, new ids); self.last_cores = (cores this side used, cores everything else used) during it."""
        busy0 = machine_busy_s()
        self.proc.stdin.write(json.dumps({"cmd": "generate", "ids": ids, "new": new}) + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        busy1 = machine_busy_s()
        if not r["ok"]:
            raise SystemExit(f"{self.name} ({self.dtype}): {r['error']}\n{self._log_tail()}")
        out = r["new_ids"]
        if len(out) != len(ids) or any(len(row) != new for row in out):
            raise SystemExit(f"{self.name} ({self.dtype}): expected {len(ids)} rows of exactly {new} new "
                             f"tokens, got lengths {sorted({len(row) for row in out})} in {len(out)} rows")
        own = r.get("cpu_s", 0.0) / r["seconds"]
        others = None if busy0 is None else max(0.0, (busy1 - busy0 - r.get("cpu_s", 0.0)) / r["seconds"])
        self.last_cores = (own, others)
        return r["seconds"], out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


KEEP = ("runs", "seconds", "median", "cores", "others_cores", "disturbed", "bandwidth")


def make_prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed * 1_000_003 + batch * 7919 + length)
    hi = min(vocab_size, 50265)  # ids 4.. skip <s>, <pad>, </s>, <unk>; below OPT's real vocabulary
    return [[rng.randrange(4, hi) for _ in range(length)] for _ in range(batch)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def start_sides(kinds, paths, dtype, args, log_dir) -> dict:
    sides = {}
    for kind in kinds:
        python = args.ours_python if kind in ("ours", "hf") else args.peer_python
        folder = {"ours": paths["ours"], "ct2": paths["ct2"].get(dtype), "hf": paths["hf"]}[kind]
        try:
            sides[kind] = Side(kind, python, folder, dtype, args, log_dir)
            print(f"{SIDES[kind]} {dtype}: loaded in {sides[kind].load_s:.2f} s {sides[kind].info}", flush=True)
        except Unavailable as e:
            print(f"{kind} {dtype}: not available ({e})", flush=True)  # "ours int8: not available (...)"
    return sides


def measure(sides: dict, ids, new: int, args, label: str, unit_tokens: int, bandwidth: bool = False) -> dict:
    """Warm-up calls per side, then `reps` rounds ABAB...; -> {kind: {"runs": [tokens/s], "out": last output}}.
    `bandwidth`: the read bandwidth before each round as well ({kind: {"bandwidth": [GB/s]}}), for a batch-1 row's
    bound: it moves too much between minutes here for one reading to stand for a row's runs."""
    res = {k: {"runs": [], "seconds": [], "cores": [], "others_cores": [], "out": None} for k in sides}
    for kind, side in sides.items():
        for i in range(args.warmup):
            dt, res[kind]["out"] = side.call(ids, new)
            print(f"  {label} {side.name}: warm-up {i + 1}/{args.warmup}: {dt:.3f} s", flush=True)
    readings = []
    for rep in range(args.reps):
        if bandwidth:
            readings.append(read_bandwidth_gbs(args.threads, reps=3))
            print(f"  {label}: read bandwidth {readings[-1]:.1f} GB/s", flush=True)
        for kind, side in sides.items():
            time.sleep(args.pause)
            if args.wait_quiet is not None:
                wait_quiet(args.wait_quiet, args.wait_max)
            dt, res[kind]["out"] = side.call(ids, new)
            own, others = side.last_cores
            res[kind]["seconds"].append(dt)
            res[kind]["runs"].append(unit_tokens / dt)
            res[kind]["cores"].append(own)
            res[kind]["others_cores"].append(others)
            busy = "" if others is None else f" (it used {own:.2f} cores, all other processes {others:.2f})"
            print(f"  {label} {side.name}: run {rep + 1}/{args.reps}: {dt:.3f} s, {unit_tokens / dt:.1f} tokens/s"
                  f"{busy}", flush=True)
    for r in res.values():
        limit = args.disturbed
        r["disturbed"] = [x is not None and x > limit for x in r["others_cores"]]
        clean = [v for v, d in zip(r["runs"], r["disturbed"]) if not d]
        r["median"] = statistics.median(clean or r["runs"]) if r["runs"] else None
        r["bandwidth"] = readings
    return res


def read_bandwidth_gbs(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """This machine's memory read bandwidth (GB/s), what a decode step at batch 1 is bound by: machine_bounds.py's
    reading (imported here, not at the top: the peers' runner processes never need it)."""
    from benchmark.machine_bounds import read_bandwidth_gbs as read
    return read(threads, gib, reps)

"""Where an engine run's time goes on a GPU, read from a JAX profiler trace (gpu_check.py model --profile DIR keeps
one a batch as DIR/engine-<size>-b<batch>-s<steps>/plugins/profile/*/perfetto_trace.json.gz):

  device     the span from the first kernel to the last, the time some kernel or copy ran, and the idle gaps over
             50 us, summed by the events either side (a gap between a call's last copy back and the next call's
             first copy in is the host's turn between calls)
  kernels    the device's busiest kernels
  host       the engine thread's Python frames and runtime calls, by time inside them (with Python tracing on,
             which slows the Python side: read them as shares, not as the run's times)

  python benchmark/gpu/trace_split.py TRACE.json.gz [--top 20]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json

GAP_US = 50


def load(path: str) -> list[dict]:
    t = json.load(gzip.open(path))
    return t["traceEvents"] if isinstance(t, dict) else t


def device_pids(events: list[dict]) -> set:
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "GPU" in str(e.get("args", {}).get("name", "")).upper()}


def split(events: list[dict], top: int) -> dict:
    """-> the device's span, busy and idle time, the gaps by their neighbours, the busiest kernels and the engine
    thread's busiest frames (all in ms)."""
    pids = device_pids(events)
    spans = [e for e in events if e.get("ph") == "X"]
    dev = sorted((e for e in spans if e["pid"] in pids), key=lambda e: e["ts"])
    if not dev:
        raise SystemExit("no device events in the trace (a CPU run's?)")
    gaps, kernels = collections.Counter(), collections.Counter()
    end = dev[0]["ts"] + dev[0]["dur"]
    for a, b in zip(dev, dev[1:]):
        end = max(end, a["ts"] + a["dur"])
        if b["ts"] - end > GAP_US:
            gaps[(a["name"][:40], b["name"][:40])] += b["ts"] - end
    for e in dev:
        kernels[e["name"][:60]] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in dev) - dev[0]["ts"]
    host = [e for e in spans if e["pid"] not in pids]
    threads = collections.Counter(e["tid"] for e in host if "scheduler.py" in e["name"])
    frames = collections.Counter()
    if threads:
        engine = threads.most_common(1)[0][0]
        for e in host:
            if e["tid"] == engine:
                frames[e["name"][:80]] += e["dur"]
    ms = lambda c: [(k, round(v / 1e3, 2)) for k, v in c.most_common(top)]  # noqa: E731
    return {"span_ms": round(span / 1e3, 2), "busy_ms": round(sum(e["dur"] for e in dev) / 1e3, 2),
            "idle_ms": round(sum(gaps.values()) / 1e3, 2), "gaps": ms(gaps), "kernels": ms(kernels),
            "host": ms(frames)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    r = split(load(a.trace), a.top)
    print(f"device: span {r['span_ms']} ms, busy {r['busy_ms']} ms, idle in gaps over {GAP_US} us {r['idle_ms']} ms")
    for title in ("gaps", "kernels", "host"):
        print(f"\n{title}:")
        for k, v in r[title]:
            print(f"  {v:9.2f} ms  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

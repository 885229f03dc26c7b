"""A soak run: hours of mixed traffic against `opt-serving serve`, watching for leaks and slow-downs.

    .venv/bin/python benchmark/faults/soak.py [--minutes 60] [--interval 300] [--clients 4] [-- SERVE ARGS...]

Starts `opt-serving serve` (default: the embedded tiny model, its own Ray, default settings) and sends, from
--clients clients with a short random pause between requests: short and long prompts (long ones as 200-400
token ids), streaming and not, on all three APIs (/v1/completions, /completions, /generate); streams the
client drops after a few events, requests it gives up on before their answer, and a few bad requests (bad
JSON, a negative max_tokens, a prompt longer than the context). Every --interval seconds it prints the model
replica's resident memory, open file descriptors and threads (and the resident memory of every process under
the server), and the latency p50/p99 of the requests answered in that interval (all of them, and the short
non-streaming ones alone, the steadiest comparison).

At the end: the first sample after warm-up (the end of the first interval) against the last (goal: memory and
descriptors within 5%), the first interval's latency against the last one's, and every answer the clients
got against the server's own count (`opt_serving_requests_total` in /metrics, by API and status; a request
given up on before its answer is counted as 499, or 200 when the answer was ready first).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
from pathlib import Path
import time
from collections import Counter

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark import harness  # noqa: E402
from opt_serving.testing.cli_server import REPLICA  # noqa: E402

WORDS = "the of and to in is was for on that with as by at from his her it an were are which this".split()
ROUTES = {"/v1/completions": "completions", "/completions": "metaseq", "/generate": "generate"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=300.0, help="seconds between samples")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--pause", type=float, default=0.5, help="most seconds a client waits between requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="file the server's output is copied to")
    p.add_argument("serve_args", nargs="*", help="more `opt-serving serve` arguments (after --)")
    return p.parse_args(argv)


class Traffic:
    """The clients: each request drawn from the mix, its answer noted as (route, status seen, kind, latency)."""

    def __init__(self, url: str, rng: random.Random):
        self.url, self.rng = url, rng
        self.answers: list[tuple[float, str, object, str, float]] = []  # (end, route, status, kind, latency)
        self.stop = asyncio.Event()

    def _prompt(self, long: bool):
        if long:  # token ids: the length is exact, whatever the tokenizer
            return [self.rng.randrange(4, 1000) for _ in range(self.rng.randint(200, 400))]
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(2, 12)))

    def _draw(self) -> tuple[str, str, dict | bytes]:
        """(kind, route, body) of the next request."""
        r = self.rng.random()
        if r < 0.05:  # bad requests: bad JSON, a negative max_tokens, a prompt past the context
            bad = self.rng.choice([b'{"prompt": "unfinished', {"prompt": "a", "max_tokens": -1},
                                   {"prompt": [5] * 600, "max_tokens": 8}])
            return "bad", "/v1/completions", bad
        if r < 0.10:
            return "metaseq", "/completions", {"prompt": self._prompt(False), "max_tokens": 16, "temperature": 0}
        if r < 0.15:
            return "generate", "/generate", {"prompt": [self._prompt(False)], "max_length": 16, "do_sample": False}
        long = 0.30 <= r < 0.50
        body = {"prompt": self._prompt(long), "max_tokens": self.rng.randint(8, 64 if long else 32),
                "temperature": self.rng.choice([0.0, 0.8]), "seed": self.rng.randrange(1 << 20)}
        if r < 0.25:  # (short prompts: 200 or 300 new tokens fit beside them)
            return "drop stream", "/v1/completions", {**body, "max_tokens": 200, "stream": True}
        if r < 0.30:
            return "give up", "/v1/completions", {**body, "max_tokens": 300, "min_tokens": 300, "ignore_eos": True}
        stream = self.rng.random() < 0.5
        kind = ("long" if long else "short") + (" stream" if stream else "")
        return kind, "/v1/completions", {**body, "stream": stream}

    async def client(self, http: httpx.AsyncClient, pause: float) -> None:
        while not self.stop.is_set():
            kind, route, body = self._draw()
            t = time.monotonic()
            try:
                async with asyncio.timeout(120):
                    status = await self._send(http, kind, route, body)
            except TimeoutError:
                status = "hung"
            except httpx.HTTPError as e:
                status = type(e).__name__
            end = time.monotonic()
            self.answers.append((end, route, status, kind, end - t))
            await asyncio.sleep(self.rng.uniform(0, pause))

    async def _send(self, http: httpx.AsyncClient, kind: str, route: str, body) -> object:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        if kind == "give up":  # the client leaves before the answer is ready
            try:
                r = await http.post(self.url + route, content=content, headers=headers, timeout=0.3)
                return r.status_code
            except httpx.TimeoutException:
                return "gave up"
        if not (isinstance(body, dict) and body.get("stream")):
            r = await http.post(self.url + route, content=content, headers=headers)
            return r.status_code
        async with http.stream("POST", self.url + route, content=content, headers=headers) as r:
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events += 1
                    if kind == "drop stream" and events >= 3:
                        return "dropped"  # leaving the block closes the connection
                    if "[DONE]" in line:
                        break
            return r.status_code


def sample(server: harness.Server) -> dict:
    replica = server.processes(REPLICA)
    out = {"replica_pid": replica[0].pid if replica else None}
    if replica:
        p = replica[0]
        out.update(rss_mb=p.memory_info().rss / 2 ** 20, fds=p.num_fds(), threads=p.num_threads())
    total = 0
    for p in server.processes():
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    out["tree_rss_mb"] = total / 2 ** 20
    return out


def latencies(answers, since: float, until: float, kinds=None) -> tuple[float, float, int]:
    lat = [a[4] for a in answers if since <= a[0] < until and a[2] == 200 and (kinds is None or a[3] in kinds)]
    if not lat:
        return float("nan"), float("nan"), 0
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), len(lat)


def server_counts(metrics: str) -> Counter:
    out = Counter()
    for m in re.finditer(r'^opt_serving_requests_total\{endpoint="(\w+)",status="(\d+)"\} ([0-9.e+]+)$', metrics,
                         re.M):
        out[(m.group(1), m.group(2))] += int(float(m.group(3)))
    return out


def client_counts(answers) -> tuple[Counter, Counter]:
    """(answers by (API, status) that the server must count exactly, given-up requests by API: 499 or 200)."""
    exact, gave_up = Counter(), Counter()
    for _, route, status, kind, _ in answers:
        api = ROUTES[route]
        if status == "gave up":
            gave_up[api] += 1
        elif status == "dropped":  # the 200 had gone out before the client left
            exact[(api, "200")] += 1
        else:
            exact[(api, str(status))] += 1
    return exact, gave_up


def account(answers, metrics: str) -> list[str]:
    exact, gave_up = client_counts(answers)
    server = server_counts(metrics)
    lines, ok = [], True
    for api in sorted({a for a, _ in exact} | {a for a, _ in server} | set(gave_up)):
        statuses = sorted({s for a, s in exact if a == api} | {s for a, s in server if a == api})
        mine = {s: exact[(api, s)] for s in statuses}
        theirs = {s: server[(api, s)] for s in statuses}
        # the given-up ones are the server's 499s plus the 200s beyond the clients' own
        extra_200 = theirs.get("200", 0) - mine.get("200", 0)
        matched = (all(theirs[s] == mine[s] for s in statuses if s not in ("200", "499"))
                   and extra_200 >= 0 and extra_200 + theirs.get("499", 0) - mine.get("499", 0) == gave_up[api])
        ok &= matched
        lines.append(f"  {api}: clients saw {mine} + {gave_up[api]} given up; server counted {theirs} "
                     f"-> {'every answer accounted for' if matched else 'MISMATCH'}")
    lines.insert(0, f"/metrics against the clients: {'all accounted for' if ok else 'MISMATCH'}")
    return lines


async def soak(a, server) -> list:
    rng = random.Random(a.seed)
    traffic = Traffic(server.url, rng)
    samples = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=64)) as http:
        clients = [asyncio.create_task(traffic.client(http, a.pause)) for _ in range(a.clients)]
        t0 = time.monotonic()
        print(f"{'min':>5} {'replica':>8} {'RSS MB':>7} {'fds':>4} {'thr':>4} {'tree MB':>8} {'answers':>8} "
              f"{'p50 s':>6} {'p99 s':>6} {'short p50':>9} {'short p99':>9}  statuses", flush=True)
        last = t0
        while time.monotonic() - t0 < a.minutes * 60 - 1:
            await asyncio.sleep(min(a.interval, t0 + a.minutes * 60 - time.monotonic()))
            now = time.monotonic()
            s = {"t": now - t0, **await asyncio.to_thread(sample, server)}
            s["all"] = latencies(traffic.answers, last, now)
            s["short"] = latencies(traffic.answers, last, now, {"short"})
            s["statuses"] = Counter(str(x[2]) for x in traffic.answers if last <= x[0] < now)
            samples.append(s)
            print(f"{s['t'] / 60:5.1f} {s['replica_pid'] or '-':>8} {s.get('rss_mb', 0):7.1f} {s.get('fds', 0):4d} "
                  f"{s.get('threads', 0):4d} {s['tree_rss_mb']:8.1f} {s['all'][2]:8d} {s['all'][0]:6.3f} "
                  f"{s['all'][1]:6.3f} {s['short'][0]:9.3f} {s['short'][1]:9.3f}  {dict(s['statuses'])}", flush=True)
            last = now
        traffic.stop.set()
        await asyncio.gather(*clients)
        await asyncio.sleep(5)  # the server notes a client that gave up when it notices
        metrics = (await http.get(server.url + "/metrics")).text
    return samples, traffic.answers, metrics


def verdict(samples) -> list[str]:
    if len(samples) < 2:
        return ["(fewer than two samples: no comparison)"]
    first, last = samples[0], samples[-1]

    def change(key):
        return 100.0 * (last[key] - first[key]) / first[key]
    out = [f"after warm-up ({first['t'] / 60:.1f} min) to the end ({last['t'] / 60:.1f} min): replica RSS "
           f"{first['rss_mb']:.1f} -> {last['rss_mb']:.1f} MB ({change('rss_mb'):+.1f}%), fds {first['fds']} -> "
           f"{last['fds']} ({change('fds'):+.1f}%), threads {first['threads']} -> {last['threads']}, every "
           f"process under the server {first['tree_rss_mb']:.0f} -> {last['tree_rss_mb']:.0f} MB "
           f"({change('tree_rss_mb'):+.1f}%)",
           f"latency, first interval -> last: all p50 {first['all'][0]:.3f} -> {last['all'][0]:.3f} s, p99 "
           f"{first['all'][1]:.3f} -> {last['all'][1]:.3f} s; short non-streaming p50 {first['short'][0]:.3f} -> "
           f"{last['short'][0]:.3f} s, p99 {first['short'][1]:.3f} -> {last['short'][1]:.3f} s"]
    if len({s['replica_pid'] for s in samples}) > 1:
        out.append(f"the replica was replaced during the run: {[s['replica_pid'] for s in samples]}")
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    print(f"soak: {a.minutes} min, {a.clients} clients (pause up to {a.pause} s), sample every {a.interval} s; "
          f"opt-serving serve {' '.join(a.serve_args) or '(defaults: the embedded tiny model)'}", flush=True)
    with harness.serve(["--num-cpus", "2", *a.serve_args], log=a.log) as server:
        print(f"server up after {server.start_s:.1f} s", flush=True)
        samples, answers, metrics = asyncio.run(soak(a, server))
    hung = sum(1 for x in answers if x[2] == "hung")
    by_kind: dict = {}
    for x in answers:
        by_kind.setdefault(x[3], Counter())[str(x[2])] += 1
    print(f"requests answered {len(answers)}, hung {hung}; by kind: "
          + "; ".join(f"{k} {dict(c)}" for k, c in sorted(by_kind.items())))
    for line in verdict(samples) + account(answers, metrics):
        print(line)
    print(f"left over after the server stopped: {server.left_over or 'nothing'}")
    return 1 if hung or server.left_over else 0


if __name__ == "__main__":
    sys.exit(harness.script(main))

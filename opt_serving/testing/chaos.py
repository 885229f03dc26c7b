"""Chaos under load (tests, benchmark/faults/chaos.py): streaming clients keep a server busy while a random component
(the model replica, a pipeline stage actor, Serve's proxy, Serve's controller) is SIGKILLed every 10-20 s.

Every request must end: a completion, or an error (a status, an error event in the stream, a stream cut
short, a refused connection) soon after the component it needed died. After each kill a probe sends a small
completion every half second until one is served, and the killed kind of process must be running again (a
new process) before the next kill, so each kill's recovery is measured on its own.

A request's time to its error is counted from the first kill after it started (or from its start, when it
started after the last kill): a request failed by a later kill is charged the longer time, never the shorter.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import httpx

from opt_serving.testing.cli_server import CONTROLLER, PROXY, REPLICA, STAGE

COMPLETED = "completed"
HUNG = "hung"
KINDS = {"replica": REPLICA, "stage": STAGE, "proxy": PROXY, "controller": CONTROLLER}  # what each kind runs


def targets(find: Callable[[str], list], kinds: Sequence[str]) -> dict[str, Callable[[], list[int]]]:
    """`run_chaos`'s targets: kind -> a function listing its live pids, from `find(marker)`: the live processes
    whose command line starts with `marker` (a server's own, or those under this process)."""
    return {k: (lambda marker=KINDS[k]: [p.pid for p in find(marker)]) for k in kinds}


@dataclass
class Outcome:
    start: float
    end: float
    kind: str      # completed | http <status> | stream error <code> | truncated | connect error | hung | ...
    tokens: int = 0


@dataclass
class Kill:
    target: str
    pid: int
    at: float
    before: list = field(default_factory=list)  # the kind's processes when it was killed
    served_again_s: Optional[float] = None  # a probe's first 200 after the kill
    replaced_s: Optional[float] = None      # the killed kind running again, without the killed process
    probes: list = field(default_factory=list)  # (s after the kill, answer) whenever the probe's answer changed


@dataclass
class ChaosReport:
    duration_s: float
    t0: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)

    @property
    def failed(self) -> Counter:
        return Counter(o.kind for o in self.outcomes if o.kind != COMPLETED)

    def time_to_error(self, o: Outcome) -> float:
        """Seconds from the first kill after the request started (or its start) to its end."""
        after = [k.at for k in self.kills if o.start <= k.at <= o.end]
        return o.end - (min(after) if after else o.start)

    @property
    def longest_time_to_error(self) -> float:
        return max((self.time_to_error(o) for o in self.outcomes if o.kind != COMPLETED), default=0.0)

    def kill_line(self, k: Kill) -> str:
        served = "never" if k.served_again_s is None else f"{k.served_again_s:.1f} s"
        back = "never" if k.replaced_s is None else f"{k.replaced_s:.1f} s"
        probes = ", ".join(f"{t:.1f} s {a}" for t, a in k.probes)
        return (f"  t={k.at - self.t0:6.1f} s killed {k.target} (pid {k.pid}): served again after {served}, "
                f"{k.target} running again after {back}; probe answers: {probes}")

    def completed_after(self, t: float) -> int:
        return sum(1 for o in self.outcomes if o.kind == COMPLETED and o.start >= t)

    def lines(self) -> list[str]:
        out = [f"requests sent {len(self.outcomes)}, completed "
               f"{sum(o.kind == COMPLETED for o in self.outcomes)}, failed {sum(self.failed.values())}"
               f" {dict(sorted(self.failed.items()))}; longest time to an error {self.longest_time_to_error:.2f} s"]
        out += [self.kill_line(k) for k in self.kills]
        return out


class Load:
    """`clients` streaming clients, each sending one completion after another until stopped."""

    def __init__(self, url: str, clients: int = 16, max_tokens: tuple[int, int] = (32, 96),
                 hang_s: float = 120.0, seed: int = 0):
        self.url, self.clients, self.max_tokens, self.hang_s = url, clients, max_tokens, hang_s
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._ended = asyncio.Condition()  # notified as each request ends

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.clients + 4)
        timeout = httpx.Timeout(self.hang_s, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            await asyncio.gather(*(self._client(client) for _ in range(self.clients)))

    def stop(self) -> None:
        self._stop.set()

    async def wait_completed_after(self, t: float, timeout: float) -> bool:
        """Until a request sent at `t` or later has completed (or `timeout` passes) -> whether one has."""
        def seen():
            return any(o.kind == COMPLETED and o.start >= t for o in self.outcomes)
        async with self._ended:
            try:
                await asyncio.wait_for(self._ended.wait_for(seen), timeout)
            except TimeoutError:
                pass
            return seen()

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                async with asyncio.timeout(self.hang_s):
                    kind, tokens = await self._one(client)
            except TimeoutError:
                kind, tokens = HUNG, 0
            async with self._ended:
                self.outcomes.append(Outcome(start, time.monotonic(), kind, tokens))
                self._ended.notify_all()
            if kind != COMPLETED:  # do not spin on a refused connection
                await asyncio.sleep(0.5)

    async def _one(self, client: httpx.AsyncClient) -> tuple[str, int]:
        n = self.rng.randint(*self.max_tokens)
        body = {"prompt": "The quick brown fox", "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                "temperature": 0, "stream": True}
        tokens, error, done = 0, None, False
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"http {r.status_code}", 0
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"].get("code") or event["error"].get("type")
                    else:
                        tokens += 1
        except httpx.ConnectError:
            return "connect error", tokens
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            return "truncated", tokens
        except httpx.TimeoutException:
            return HUNG, tokens
        if error is not None:
            return f"stream error {error}", tokens
        return (COMPLETED if done else "truncated"), tokens


async def probe_until_served(url: str, since: float, limit_s: float, seen: list) -> Optional[float]:
    """Seconds from `since` to the first small completion served (tried every 0.5 s); None past `limit_s`.
    `seen` gets (seconds, answer) each time the answer changes."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        while time.monotonic() - since < limit_s:
            try:
                r = await client.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
                answer = r.status_code
            except httpx.HTTPError as e:
                answer = type(e).__name__
            if not seen or seen[-1][1] != answer:
                seen.append((round(time.monotonic() - since, 1), answer))
            if answer == 200:
                return time.monotonic() - since
            await asyncio.sleep(0.5)
    return None


async def wait_replaced(find: Callable[[], list[int]], kill: Kill, limit_s: float) -> Optional[float]:
    """Seconds from the kill until its kind runs again without the killed process; None past `limit_s`.
    Stages: as many as before, all new (Serve rebuilds the replica with all its stages). Proxies: at least
    one (Serve keeps one on the head node and one on each node with a replica, which may now be fewer
    nodes). The others: one, new."""
    while time.monotonic() - kill.at < limit_s:
        pids = await asyncio.to_thread(find)
        if kill.pid not in pids and pids:
            if kill.target != "stage" or (len(pids) >= len(kill.before) and not set(pids) & set(kill.before)):
                return time.monotonic() - kill.at
        await asyncio.sleep(0.5)
    return None


async def run_chaos(url: str, targets: dict[str, Callable[[], list[int]]], duration_s: float,
                    interval_s: tuple[float, float] = (10.0, 20.0), clients: int = 16,
                    recover_limit_s: float = 240.0, seed: int = 0, log: Callable[[str], None] = print,
                    kill_order: Optional[Sequence[str]] = None, min_kills: int = 0,
                    max_kills: Optional[int] = None) -> ChaosReport:
    """Load the server at `url` with `clients` streaming clients for `duration_s`, killing (SIGKILL) one
    process of a random kind every `interval_s` (each kill waits for the previous one's recovery).
    `targets`: kind -> a function listing its live pids. `kill_order`: kinds to kill in this order
    (cycled), instead of at random. `min_kills`: go on past `duration_s` until this many kills were made
    (a slow recovery can push a kill past the end); `max_kills`: stop killing after this many, however soon the
    recoveries come. Returns when the last kill has recovered, a client's request
    sent after that has completed (or `recover_limit_s` has passed), and every request has ended."""
    rng = random.Random(seed)
    load = Load(url, clients=clients, seed=seed)
    t0 = time.monotonic()
    report = ChaosReport(duration_s, t0)
    loader = asyncio.create_task(load.run())
    try:
        next_at = t0 + rng.uniform(*interval_s)
        while ((next_at < t0 + duration_s or len(report.kills) < min_kills)
               and (max_kills is None or len(report.kills) < max_kills)):
            await asyncio.sleep(max(next_at - time.monotonic(), 0))
            kill = await _kill_one(targets, rng, kill_order, len(report.kills))
            if kill is None:
                log("chaos: nothing to kill")
                next_at = time.monotonic() + 1.0
                continue
            report.kills.append(kill)
            kill.served_again_s, kill.replaced_s = await asyncio.gather(
                probe_until_served(url, kill.at, recover_limit_s, kill.probes),
                wait_replaced(targets[kill.target], kill, recover_limit_s))
            log(report.kill_line(kill).strip())
            if kill.served_again_s is None or kill.replaced_s is None:
                break  # did not recover: nothing more to learn from further kills
            next_at = max(kill.at + rng.uniform(*interval_s), time.monotonic())
        await asyncio.sleep(max(t0 + duration_s - time.monotonic(), 0))
        last = report.kills[-1] if report.kills else None
        if last is not None and last.served_again_s is not None:
            # the clients, not only the probe, are served again after the last recovery, even one that came
            # past `duration_s` (a kill `min_kills` asked for after a slow recovery)
            await load.wait_completed_after(last.at + last.served_again_s, recover_limit_s)
    finally:
        load.stop()
        await loader
    report.outcomes = load.outcomes
    return report


async def _kill_one(targets, rng, order, i) -> Optional[Kill]:
    kinds = list(targets)
    if order:
        kinds = [order[i % len(order)]]
    rng.shuffle(kinds)
    for kind in kinds:
        pids = await asyncio.to_thread(targets[kind])
        if pids:
            pid = rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return Kill(kind, pid, time.monotonic(), list(pids))
    return None

"""Where a server's start goes: one line a phase (imports, Ray and Serve, the weights, each warm-up group with its
programs and how many of them XLA compiled or the persistent cache gave), so that a slow start says why.

`PHASES` is this process's record; `phase(name)` times a block into it and logs the line. A replica's record
goes back to `opt-serving serve`, which prints it with its own (service/cli.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Iterator, Optional

log = logging.getLogger("opt_serving.start")

# a program's executable asked for: compiled by XLA, or loaded from the persistent cache (the event times both)
REQUESTED = "/jax/core/compile/backend_compile_duration"
CACHE_HITS = "/jax/compilation_cache/cache_hits"  # an executable loaded from the persistent cache


@dataclasses.dataclass
class Phase:
    name: str
    seconds: float
    cpu_seconds: Optional[float] = None  # this process's CPU time (all threads): what a shared or paused machine
    # changes less than the wall time
    shapes: Optional[int] = None  # warm-up groups: the shapes run (runner/warmup.py)
    compiled: Optional[int] = None  # XLA compiles in this process during the phase (not from the cache)
    cache_hits: Optional[int] = None  # executables the persistent cache gave

    def line(self) -> str:
        more = "" if self.shapes is None else f": {self.shapes} shapes"
        if self.compiled is not None:
            more += f", {self.compiled} compiled, {self.cache_hits} from the compile cache"
        cpu = "" if self.cpu_seconds is None else f" (CPU {self.cpu_seconds:.1f} s)"
        return f"opt-serving start: {self.name} {self.seconds:.1f} s{cpu}{more}"


class _Compiles:
    """Executables asked for and persistent-cache hits in this process so far (jax.monitoring's events, counted
    from the first `watch`)."""

    def __init__(self):
        self.counts = {REQUESTED: 0, CACHE_HITS: 0}
        self._on = False
        self._lock = threading.Lock()

    def watch(self) -> None:
        with self._lock:
            if self._on:
                return
            from jax import monitoring
            monitoring.register_event_listener(self._event)
            monitoring.register_event_duration_secs_listener(self._duration)
            self._on = True

    def _event(self, event: str, **_) -> None:
        if event == CACHE_HITS:
            self.counts[CACHE_HITS] += 1

    def _duration(self, event: str, _secs: float, **_) -> None:
        if event == REQUESTED:
            self.counts[REQUESTED] += 1

    def now(self) -> tuple[int, int]:
        """(XLA compiles, cache hits) so far."""
        return self.counts[REQUESTED] - self.counts[CACHE_HITS], self.counts[CACHE_HITS]


COMPILES = _Compiles()


class Phases:
    """The phases of one process's start, in order."""

    def __init__(self):
        self.phases: list[Phase] = []

    def add(self, phase: Phase) -> Phase:
        self.phases.append(phase)
        log.info(phase.line())
        return phase

    @contextlib.contextmanager
    def phase(self, name: str, shapes: Optional[int] = None, compiles: bool = False) -> Iterator[Phase]:
        """Time the block as phase `name`; with `compiles`, count the XLA compiles and cache hits in it. The
        phase is yielded (its `shapes` may be set inside) and recorded when the block ends without error."""
        if compiles:
            COMPILES.watch()
        before, start, cpu = COMPILES.now(), time.monotonic(), time.process_time()
        p = Phase(name, 0.0, shapes=shapes)
        yield p
        p.seconds, p.cpu_seconds = time.monotonic() - start, time.process_time() - cpu
        if compiles:
            after = COMPILES.now()
            p.compiled, p.cache_hits = after[0] - before[0], after[1] - before[1]
        self.add(p)

    def since_process_start(self, name: str) -> Phase:
        """A phase from this process's start to now (its imports, for a command's first phase)."""
        import psutil
        return self.add(Phase(name, max(0.0, time.time() - psutil.Process(os.getpid()).create_time())))

    def as_dicts(self) -> list[dict]:
        return [dataclasses.asdict(p) for p in self.phases]

    def lines(self) -> list[str]:
        return [p.line() for p in self.phases]


PHASES = Phases()


def lines_of(dicts: list[dict]) -> list[str]:
    """Another process's phases (`Phases.as_dicts`) as lines."""
    return [Phase(**d).line() for d in dicts]

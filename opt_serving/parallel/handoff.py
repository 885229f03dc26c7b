"""The stages' calls through one Ray Compiled Graph (`ray.dag`): stage 0 -> stage 1 -> ... -> the driver over
channels compiled once per pipeline (shared memory on one node), instead of an actor task and an object ref per
call.

A compiled graph runs one fixed method per actor, so every call the driver makes (`RayStages.call`) goes through
the same graph: each execution carries a list of calls for every stage (`run_calls` runs them in the stage, in
the order the driver made them, then hands the rest on). A call whose result the next stage's call takes as an
argument (the hidden states of a decode, prefill or prefill chunk) hands it on inside the execution (`Prev`);
the other results ride to the driver. A stage runs an execution's calls in order and the executions in the order
they were sent, on the compiled graph's own thread, so a `free` or `insert` sent after a `decode` runs after it,
as Ray's per-caller task order guaranteed with object refs. Calls the driver does not wait for (`FIRE_AND_FORGET`)
wait in the calling thread's batch for its next chained call (a batch is sent when the last stage gets a call
whose result is wanted, or when the thread waits for a result), so a decode step costs one execution; their
errors surface at a later `get`, as before. Plain actor tasks (a health check's `ready`, `where`, `stats`) still
reach the stage beside the graph: Ray runs the graph's loop in the actor's `_ray_system` concurrency group, its
thread of its own, and those calls read nothing the graph's calls change.

A stage that raises returns the error (a `RayTaskError` naming the stage and call) in place of its result: a call
that takes it as an argument is skipped and passes it on, and `get` raises it as the cause's type, as with
object refs. A stage that dies breaks the graph (Ray's monitor tears it down, and a waiting `get` raises a
channel or actor error): `RayStages` turns that into `StageDied` naming the stage.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import traceback

import numpy as np

# the calls whose replies nobody waits for (their errors surface at a later get)
FIRE_AND_FORGET = frozenset({"insert", "free", "drop", "begin_warmup", "end_warmup", "store_prefix"})
# calls a thread's batch may hold before it is sent even without a chained call
MAX_BATCH_CALLS = 256


class Prev:
    """An argument of a stage's call: the result of call `index` of the previous stage in the same execution."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def run_calls(stage, payload):
    """The compiled graph's step in a stage actor: run this stage's calls of the execution in order ->
    (the later stages' calls, the results they take, the results for the driver) or, in the last stage, the
    results for the driver (one per call that hands nothing on, in stage and call order)."""
    calls, prev, out = owned(payload)
    forward = {}
    for j, (method, args, back) in enumerate(calls[0]):
        result = _run_one(stage, method, args, prev)
        if back:
            out.append(result)
        else:
            forward[j] = result
    return (calls[1:], forward, out) if len(calls) > 1 else out


def owned(x):
    """`x` with every numpy array in it (in tuples, lists, dicts and dataclasses) copied: what a channel read
    gives is a read-only view of the channel's shared memory, and while one is kept (in a stage's state, or a
    hidden state XLA aliases) Ray cannot reuse the buffer, and the graph stops once every buffer is held."""
    if isinstance(x, np.ndarray):
        return x if x.flags.writeable and x.flags.owndata else x.copy()
    if isinstance(x, (tuple, list)):  # (the same object where nothing in it changed)
        items = [owned(a) for a in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        items = {k: owned(v) for k, v in x.items()}
        return x if all(items[k] is v for k, v in x.items()) else items
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changed = {f.name: owned(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        changed = {k: v for k, v in changed.items() if v is not getattr(x, k)}
        return dataclasses.replace(x, **changed) if changed else x
    return x


def _run_one(stage, method: str, args, prev):
    from ray.exceptions import RayTaskError
    args = [prev[a.index] if isinstance(a, Prev) else a for a in args]
    failed = next((a for a in args if isinstance(a, RayTaskError)), None)
    if failed is not None:  # the call before it failed: so does this one, with the same error
        return failed
    try:
        return getattr(stage, method)(*args)
    except Exception as e:
        return RayTaskError(f"{getattr(stage, 'name', 'stage')}.{method}", traceback.format_exc(), e)


class Future:
    """A call's result in a compiled-graph execution (what `CompiledChain.call` returns)."""
    __slots__ = ("batch", "stage", "index")

    def __init__(self, batch: "_Batch", stage: int, index: int):
        self.batch, self.stage, self.index = batch, stage, index


class _Batch:
    """One execution's calls, per stage: [method, args, back] (back: its result goes to the driver)."""

    def __init__(self, n: int):
        self.calls: list[list[list]] = [[] for _ in range(n)]
        self.size = 0
        self.ref = None          # the CompiledDAGRef once sent
        self.results: dict | None = None  # (stage, index) -> result, once read

    def backs(self) -> list[tuple[int, int]]:
        return [(i, j) for i, calls in enumerate(self.calls) for j, c in enumerate(calls) if c[2]]


class CompiledChain:
    """The driver's side: `call`/`get` over one compiled graph of the stage actors' `run_calls`, compiled here.
    `max_inflight`: executions sent and not read back before the oldest is read (the micro-batches in flight,
    plus the calls nobody waits for)."""

    def __init__(self, actors, max_inflight: int = 16):
        from ray.dag import InputNode
        with InputNode() as inp:
            node = inp
            for a in actors:
                node = a.run_calls.bind(node)
        # no submit/get timeouts: a long prefill is not a hang; a dead stage breaks the channels instead
        self.dag = node.experimental_compile(_submit_timeout=-1, _max_inflight_executions=max_inflight)
        self.n, self.max_inflight = len(actors), max_inflight
        self._local = threading.local()      # each driver thread's batch being built
        self._lock = threading.Lock()        # execute and read, in order
        self._sent: collections.deque = collections.deque()  # sent and not read back, oldest first
        self._late: list = []                # errors of calls nobody waits for, read back
        self.broken: BaseException | None = None

    def call(self, i: int, method: str, args: tuple) -> Future:
        # a result from elsewhere than the previous stage of this batch comes to the driver and goes on by value
        args = tuple(self._value(a) if isinstance(a, Future) and not self._chained(a, i) else a for a in args)
        batch = self._batch()
        prev = []
        for a in args:
            if isinstance(a, Future):  # the previous stage's result in this batch: handed on in the stage
                batch.calls[i - 1][a.index][2] = False
                prev.append(Prev(a.index))
            else:
                prev.append(a)
        batch.calls[i].append([method, tuple(prev), True])
        batch.size += 1
        fut = Future(batch, i, len(batch.calls[i]) - 1)
        if (i == self.n - 1 and method not in FIRE_AND_FORGET) or batch.size >= MAX_BATCH_CALLS:
            self.flush()
        return fut

    def _chained(self, a: Future, i: int) -> bool:
        return a.batch is getattr(self._local, "batch", None) and a.stage == i - 1

    def _batch(self) -> _Batch:
        batch = getattr(self._local, "batch", None)
        if batch is None:
            batch = self._local.batch = _Batch(self.n)
        return batch

    def flush(self) -> None:
        """Send this thread's batch (its calls nobody waits for included) as one execution."""
        batch = getattr(self._local, "batch", None)
        if batch is None or not batch.size:
            return
        self._local.batch = None
        payload = ([[tuple(c) for c in calls] for calls in batch.calls], {}, [])
        with self._lock:
            self._check()
            while len(self._sent) >= self.max_inflight - 1:  # room for this one: read the oldest back
                self._read_until(self._sent[0])
            batch.ref = self._run(self.dag.execute, payload)
            self._sent.append(batch)

    def get(self, fut: Future):
        """The call's result (its error raised as the cause's type); the errors of calls nobody waited for
        that came back since are raised first."""
        if fut.batch is getattr(self._local, "batch", None):
            self.flush()
        with self._lock:
            self._read_until(fut.batch)
            late, self._late = self._late, []
        if late:
            raise late[0].as_instanceof_cause()
        key = (fut.stage, fut.index)
        if key not in fut.batch.results:
            raise RuntimeError(f"stage {fut.stage}'s {fut.batch.calls[fut.stage][fut.index][0]} result was handed "
                               "on to the next stage, not to the driver")
        from ray.exceptions import RayTaskError
        out = fut.batch.results[key]
        if isinstance(out, RayTaskError):
            raise out.as_instanceof_cause()
        return out

    def _value(self, fut: Future):
        return self.get(fut)

    def _read_until(self, batch: _Batch) -> None:
        """Read executions back, oldest first, up to `batch` (under the lock)."""
        while batch.results is None:
            self._check()
            if not self._sent:
                raise RuntimeError("a result of a call another thread has not sent yet")
            oldest = self._sent.popleft()
            out = owned(self._run(oldest.ref.get, -1))  # (what the driver keeps must not hold the channel)
            oldest.ref = None
            oldest.results = dict(zip(oldest.backs(), out))
            self._late += [r for (i, j), r in oldest.results.items()
                           if oldest.calls[i][j][0] in FIRE_AND_FORGET and isinstance(r, Exception)]

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as e:  # a broken graph stays broken: every later call raises the same
            self.broken = e
            raise

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def teardown(self) -> None:
        """Stop the graph (a thread waiting in `get` gets a channel error); not under the lock, which that
        thread holds."""
        teardown(self.dag)


def teardown(dag) -> None:
    try:
        dag.teardown()
    except Exception:  # Ray already gone, or the graph torn down by its monitor after a stage died
        pass

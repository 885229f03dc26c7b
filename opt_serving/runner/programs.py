"""A stage's jitted programs, which warm-up compiles without running (`Programs`).

Warm-up used to run every shape serving runs: a prefill of every width up to the longest prompt, chunked prompts
into every cache size. Running them cost more than compiling them once the compile cache was full. Here a stage
makes its programs with `Programs.jit`, and between `begin` and `end` a call only compiles: it lowers the program
for its arguments (tracing it as the call would), hands the lowering to a compile thread, and returns zeros of the
program's outputs without running it, so the host code driving warm-up goes on to the next shape at once.

- A later call with the same arguments' shapes finds the executable the compile made (JAX keeps it with the
  lowering, in the same caches its own calls fill), so a warmed stage compiles nothing at a request.
- An output the program writes into a donated argument (a cache, the sampler's state) is that argument itself,
  unchanged: nothing was written, and nothing of its size is allocated again.
- The compiles run on `threads` threads while the next shapes are traced and lowered. An output's sharding is
  known before its compile only where every argument lies on one device alone (the outputs do too), so a call on a
  mesh (tensor-parallel, or a pipeline stage's mesh of one device) waits for its compile; `end` waits for every
  compile and raises the first one's error.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Optional

import jax
import numpy as np

from opt_serving.settings import Settings


class Programs:
    """A stage's switch between running its programs and only compiling them (the module docstring)."""

    def __init__(self):
        self.compiling = False
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._compiles: dict[int, tuple[Any, concurrent.futures.Future]] = {}  # a lowering's id -> its compile

    def jit(self, fn: Callable, **jit_kwargs) -> "Program":
        return Program(self, jax.jit(fn, **jit_kwargs), jit_kwargs.get("donate_argnums", ()))

    def begin(self, threads: Optional[int] = None) -> None:
        """From now until `end`, a call compiles its program and does not run it, on `threads` threads (default: the
        kernels' threads, every CPU this process may run on; XLA's compile releases the GIL)."""
        self.compiling = True
        self._pool = concurrent.futures.ThreadPoolExecutor(threads or Settings.from_env().threads(),
                                                           thread_name_prefix="opt-compile")

    def end(self) -> None:
        """Wait for every compile begun (raising the first error), and run programs again."""
        pool, compiles = self._pool, self._compiles
        self.compiling, self._pool, self._compiles = False, None, {}
        try:
            for _, done in compiles.values():
                done.result()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def compile_only(self, program: "Program", args: tuple, kwargs: dict):
        lowered = program.jitted.lower(*args, **kwargs)
        key = getattr(lowered, "_lowering", lowered)  # (a shape warm-up runs twice lowers to the same one)
        program.warmed[id(key)] = key
        device = _one_device(args, kwargs)
        if device is None:  # the outputs' shardings come from the compile: wait for it
            outs = lowered.compile().out_info
            place = lambda s: s.sharding  # noqa: E731
        else:
            if id(key) not in self._compiles:
                self._compiles[id(key)] = (key, self._pool.submit(lowered.compile))
            alone = jax.sharding.SingleDeviceSharding(device)
            outs, place = lowered.out_info, lambda s: alone  # noqa: E731
        donated = [leaf for i in program.donate for leaf in jax.tree_util.tree_leaves(args[i])
                   if isinstance(leaf, jax.Array)]
        return jax.tree_util.tree_map(lambda s: _written(s, donated, place(s)), outs)


class Program:
    """One jitted program of a stage: `jax.jit`'s, or while its `Programs` compiles, a compile (see there)."""

    def __init__(self, programs: Programs, jitted, donate):
        self.programs, self.jitted = programs, jitted
        self.warmed: dict[int, Any] = {}  # the lowerings of the shapes warm-up compiled it for, by id
        self.donate = (donate,) if isinstance(donate, int) else tuple(donate)

    def __call__(self, *args, **kwargs):
        if self.programs.compiling:
            return self.programs.compile_only(self, args, kwargs)
        return self.jitted(*args, **kwargs)


def _one_device(args: tuple, kwargs: dict) -> Optional[Any]:
    """The one device every array argument lies on, each placed on it alone (a SingleDeviceSharding: the outputs
    are too), or None (several devices, a mesh even of one device, or no array)."""
    shardings = {leaf.sharding for leaf in jax.tree_util.tree_leaves((args, kwargs)) if isinstance(leaf, jax.Array)}
    if len(shardings) != 1 or not isinstance(next(iter(shardings)), jax.sharding.SingleDeviceSharding):
        return None
    return next(iter(next(iter(shardings)).device_set))


def _written(out, donated: list, where: jax.sharding.Sharding) -> jax.Array:
    """What a run would have returned as `out`, unwritten: the donated argument of its shape it would be written
    into (taken from `donated`), else zeros; placed `where` the output is (a later program compiles apart for each
    placement, and for an array committed to its devices, as a program's outputs are, and one that is not)."""
    for i, leaf in enumerate(donated):
        if leaf.shape == out.shape and leaf.dtype == out.dtype:
            leaf = donated.pop(i)
            return leaf if leaf.committed and leaf.sharding == where else jax.device_put(leaf, where)
    return jax.device_put(np.zeros(out.shape, out.dtype), where)

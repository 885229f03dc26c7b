"""Compiled steps kept on disk between runs: JAX's persistent compilation cache, on by default.

An engine compiles every prefill width, cache window and joining block before it serves (Engine.warmup),
about a minute for OPT-125m at a 2048-token context on two cores, most of it XLA compiling the same
programs it compiled at the last start. With the cache a restart (a new `serve`, a Serve replica replaced
after a failure, a pipeline stage actor) loads them instead. An executable is only reused for the same
program, JAX, XLA flags and device kind (the cache key), so a hit runs what a compile would have made.

OPT_SERVING_COMPILE_CACHE: the folder (default: $XDG_CACHE_HOME/opt_serving/xla, else
~/.cache/opt_serving/xla); "0" (or "off") turns the cache off. A user's own jax_compilation_cache_dir wins.

A pipeline stage's actor uses the cache only where OPT_SERVING_COMPILE_CACHE names it (`enable(default=False)`):
a model is pipelined because memory is short, and a stage's programs loaded from the cache held several times the
memory of the same programs compiled in the process (XLA:CPU's loaded executables; benchmark/README.md, "A model
too big for one node"), for a warm-up a third shorter at OPT-1.3b.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from opt_serving.settings import Settings

log = logging.getLogger(__name__)

MAX_BYTES = 2 << 30  # least recently used entries go past this (and with a size, JAX locks the folder's writes)


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opt_serving" / "xla"


def enable(default: bool = True) -> Optional[Path]:
    """Point JAX's persistent compilation cache at OPT_SERVING_COMPILE_CACHE's folder (see the module
    docstring) -> the folder in use, None where off. Call before the first compile; later, it resets JAX's
    view of the cache so the next compile uses it. `default`: where OPT_SERVING_COMPILE_CACHE is not set, use
    the default folder (True) or no cache (False: a pipeline stage's actor)."""
    import jax
    from jax._src import compilation_cache  # reset_cache: the cache is looked at once, at the first compile

    current = jax.config.jax_compilation_cache_dir
    if current:  # the user's (or an earlier call's): kept
        return Path(current)
    value = Settings.from_env().compile_cache
    if value is None or (value == "" and not default):  # off, or not named where the default is no cache
        return None
    folder = Path(value).expanduser() if value else default_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: serve anyway, compiling as before
        log.warning("compile cache off: cannot create %s (%s)", folder, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # most steps compile in under 1 s
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    compilation_cache.reset_cache()
    return folder


def drop_staging_caches() -> bool:
    """Free what JAX keeps of each function it compiled besides the executable its C++ dispatch calls: the
    traced jaxprs and lowered modules (with their MLIR contexts), about 1 MB a program on a CPU, which a warmed
    engine of a few hundred programs never reads again: a call with shapes compiled before still runs its
    executable, one with new shapes traces, lowers and compiles as before (or loads from this cache).
    -> whether they were dropped (not where this JAX has no such function)."""
    try:
        from jax._src import util
    except ImportError:
        return False
    clear = getattr(util, "clear_all_caches", None)
    if clear is None:
        return False
    clear()
    return True

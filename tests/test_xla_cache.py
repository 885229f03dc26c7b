"""xla_cache: compiled steps kept on disk, so a second start loads what the first compiled."""
import json
import os
import subprocess
import sys
import textwrap

# One process: enable the cache as the engine does, compile a few programs, report the cache's hits and misses
# and where it pointed JAX.
CHILD = textwrap.dedent("""
    import json, jax, jax.numpy as jnp
    from jax import monitoring
    counts = {"hits": 0}
    def on(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1
    monitoring.register_event_listener(on)
    from opt_serving import xla_cache
    import os
    folder = xla_cache.enable(default=os.environ.get("CHILD_STAGE") != "1")
    for n in (3, 5, 7):
        jax.jit(lambda x: jnp.tanh(x) * n + jnp.arange(n, dtype=x.dtype).sum())(jnp.ones(n)).block_until_ready()
    print(json.dumps({"folder": None if folder is None else str(folder), **counts,
                      "dir": jax.config.jax_compilation_cache_dir}))
""")


def _start(**env_vars):
    """A process with these environment variables (None: unset)."""
    env = {k: v for k, v in {**os.environ, "JAX_PLATFORMS": "cpu", **env_vars}.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def test_a_second_start_loads_what_the_first_compiled(tmp_path):
    folder = tmp_path / "xla"
    first, second = (_start(OPT_SERVING_COMPILE_CACHE=str(folder)) for _ in range(2))
    assert first["folder"] == second["folder"] == first["dir"] == str(folder)
    assert first["hits"] == 0 and second["hits"] >= 3  # the three programs (and the arrays' own) loaded
    assert any(folder.iterdir())


def test_the_cache_lives_under_the_users_cache_folder_unless_turned_off(tmp_path):
    default = _start(OPT_SERVING_COMPILE_CACHE=None, XDG_CACHE_HOME=str(tmp_path))
    assert default["folder"] == str(tmp_path / "opt_serving" / "xla")
    off = _start(OPT_SERVING_COMPILE_CACHE="0", XDG_CACHE_HOME=str(tmp_path / "other"))
    assert off["folder"] is None and off["dir"] in (None, "") and off["hits"] == 0
    assert not (tmp_path / "other").exists()


def test_a_pipeline_stage_uses_the_cache_only_where_it_is_named(tmp_path):
    """A stage actor (enable(default=False)) compiles its steps unless OPT_SERVING_COMPILE_CACHE names a cache:
    loaded from the cache, a stage's programs held more memory (xla_cache.py)."""
    unnamed = _start(OPT_SERVING_COMPILE_CACHE=None, XDG_CACHE_HOME=str(tmp_path / "home"), CHILD_STAGE="1")
    assert unnamed["folder"] is None and unnamed["dir"] in (None, "")
    assert not (tmp_path / "home").exists()
    folder = tmp_path / "named"
    named = [_start(OPT_SERVING_COMPILE_CACHE=str(folder), CHILD_STAGE="1") for _ in range(2)]
    assert named[0]["folder"] == named[1]["dir"] == str(folder) and named[1]["hits"] >= 3


def test_a_corrupt_cache_entry_is_compiled_again(tmp_path):
    """A truncated or overwritten entry (a process killed while writing it, a full disk) costs a compile and a
    warning naming it, never a failed start."""
    folder = tmp_path / "xla"
    _start(OPT_SERVING_COMPILE_CACHE=str(folder))
    entries = [p for p in folder.iterdir() if p.name.endswith("-cache")]
    assert entries
    for p in entries:
        p.write_bytes(b"not an executable")
    again = _start(OPT_SERVING_COMPILE_CACHE=str(folder))
    assert again["hits"] == 0 and again["folder"] == str(folder)
    assert "Error reading persistent compilation cache entry" in again["stderr"]


DROP_CHILD = textwrap.dedent("""
    import ctypes, gc, json, jax, jax.numpy as jnp, numpy as np
    from jax import monitoring
    from opt_serving import xla_cache
    from opt_serving.parallel.stage_actor import process_memory
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    fs = [jax.jit(lambda x, k=k: jnp.tanh(x @ x.T).sum(0) + k) for k in range(40)]
    x = jnp.ones((7, 64))
    before = [np.asarray(f(x)) for f in fs]
    gc.collect(); ctypes.CDLL(None).malloc_trim(0); rss = process_memory()["rss"]
    dropped = xla_cache.drop_staging_caches()
    gc.collect(); ctypes.CDLL(None).malloc_trim(0); freed = rss - process_memory()["rss"]
    n = len(compiles)
    after = [np.asarray(f(x)) for f in fs]  # the shapes compiled before: their executables, no compile
    again = len(compiles) - n
    new = np.asarray(fs[0](jnp.ones((9, 64))))  # a new shape: traced, lowered and compiled as before
    print(json.dumps({"dropped": dropped, "freed": freed, "again": again, "new_compiles": len(compiles) - n - again,
                      "same": all(np.array_equal(a, b) for a, b in zip(before, after)),
                      "new_right": bool(np.allclose(new, np.tanh(np.full((9, 9), 64.0)).sum(0)))}))
""")


def test_dropping_the_staging_caches_keeps_the_executables_and_frees_memory(tmp_path):
    """What JAX keeps of each compiled program besides its executable goes (at least 0.3 MB a program here), and
    the same functions called again with the same shapes run without compiling, with the same results."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OPT_SERVING_COMPILE_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", DROP_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dropped"] and got["same"] and got["new_right"]
    assert got["again"] == 0 and got["new_compiles"] >= 1
    assert got["freed"] > 40 * 0.3e6, got["freed"]

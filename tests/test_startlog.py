"""startlog.py: a start's phases timed, with the compiles and compile-cache hits of each; and a warm-up that runs
again on the same compile cache (a restart) compiles nothing: its programs' cache keys are the same in every
process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from opt_serving import startlog

# A process warms up a small model (one stage on the CPU kernels, a prefix cache, four slots, chunks of 16, four
# steps a call: test_runner_warmup.py's) on the compile cache OPT_SERVING_COMPILE_CACHE names, and prints its
# phases.
CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    from conftest import SMALL
    from opt_serving import startlog, xla_cache
    xla_cache.enable()
    from opt_serving.model import param_tree
    from opt_serving.parallel.pipeline import stage_specs
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.stage import LocalStages, StageSlots
    params = param_tree.init_params(SMALL, seed=3, std=0.3)
    with startlog.PHASES.phase("stages", compiles=True):
        stages = [StageSlots(SMALL, params, s, 4, 1, 64, prefix_blocks=16) for s in stage_specs(SMALL, 1)]
        model = Slots(SMALL, LocalStages(stages), 4, 1, 64, prefix_blocks=16)
    model.warmup(16, decode_steps=4)
    print(json.dumps(startlog.PHASES.as_dicts()))
""")


def _warm_up(cache) -> list[dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OPT_SERVING_COMPILE_CACHE": str(cache)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_phase_counts_the_compiles_in_it():
    import jax
    import jax.numpy as jnp
    phases = startlog.Phases()
    with phases.phase("a program", shapes=1, compiles=True):
        jax.jit(lambda x: jnp.sin(x) * 1234.5)(jnp.ones(7)).block_until_ready()  # new here: compiled or loaded
    with phases.phase("nothing", compiles=True):
        pass
    (a, nothing) = phases.phases
    assert a.compiled + a.cache_hits >= 1 and nothing.compiled == nothing.cache_hits == 0
    assert a.line().startswith("opt-serving start: a program ") and ": 1 shapes, " in a.line()
    assert startlog.lines_of(phases.as_dicts()) == phases.lines()


@pytest.mark.cpu_kernels
def test_a_second_warm_up_on_the_same_cache_compiles_nothing(tmp_path):
    """Each warm-up group is reported; the first start compiles, the second loads every program from the cache
    (nothing that differs between processes enters a program)."""
    cache = tmp_path / "xla"
    first, second = _warm_up(cache), _warm_up(cache)
    names = [p["name"] for p in first]
    assert names == [p["name"] for p in second]
    assert {"warm-up prefills", "warm-up chunked prefills", "warm-up window 64"} <= set(names), names
    assert sum(p["compiled"] for p in first) > 0
    assert [(p["name"], p["compiled"]) for p in second if p["compiled"]] == []
    assert sum(p["cache_hits"] for p in second) >= sum(p["compiled"] for p in first)

"""runner/programs.py: between begin and end a stage's programs compile without running; afterwards a call with the
same shapes runs the executable that compile made."""
import jax
import jax.numpy as jnp
import numpy as np

from conftest import xla_compiles


def test_a_call_between_begin_and_end_compiles_and_does_not_run():
    from opt_serving.runner.programs import Programs
    ran = []

    def step(cache, x):  # [rows, n] cache written at x's row, and a sum of x
        jax.debug.callback(lambda: ran.append(1))
        return cache.at[0].add(x), x.sum()

    programs = Programs()
    program = programs.jit(step, donate_argnums=(0,))
    cpu = jax.devices()[0]
    cache, x = jax.device_put(jnp.zeros((4, 3)), cpu), jax.device_put(jnp.arange(3.0), cpu)
    programs.begin(threads=2)
    with xla_compiles() as asked:
        written, total = program(cache, x)
        programs.end()
    assert ran == [] and len(asked) == 1 and len(program.warmed) == 1
    # the donated cache comes back as it went in (nothing was written), the other output zeros of its shape
    assert written is cache and float(total) == 0.0 and total.shape == () and total.dtype == jnp.float32
    assert total.committed and total.sharding == cache.sharding
    with xla_compiles() as asked:
        written, total = program(cache, x)
    assert asked == [] and ran == [1]  # the compile's executable, run now
    np.testing.assert_array_equal(np.asarray(written)[0], [0.0, 1.0, 2.0])
    assert float(total) == 3.0


def test_a_shape_lowered_twice_compiles_once():
    from opt_serving.runner.programs import Programs
    programs = Programs()
    program = programs.jit(lambda x: x * 2)
    x, longer = (jax.device_put(np.ones(n, np.float32), jax.devices()[0]) for n in (5, 6))
    programs.begin()
    with xla_compiles() as asked:
        program(x)
        program(x)
        program(longer)
        programs.end()
    assert len(asked) == 2 and len(program.warmed) == 2

"""backend/: the settings read from the environment, the Backend chosen for where params lie, and the
model running the same numbers whichever backend runs it."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opt_serving.backend import Backend, choose, for_params
from opt_serving.backend.cpu import _lib, head
from opt_serving.model import layout, opt, param_tree
from opt_serving.settings import Settings

from conftest import TINY

pytestmark = pytest.mark.cpu_kernels  # on the CPU device wherever JAX runs (conftest.py)

CFG = TINY
needs_kernels = pytest.mark.skipif(_lib.load() is None, reason="opt_serving/_cpu_kernels.so not built")
CPU, GPU = types.SimpleNamespace(platform="cpu"), types.SimpleNamespace(platform="gpu")


def test_a_backend_is_a_static_value():
    assert Backend.xla() == Backend() and hash(Backend.xla()) == hash(Backend())
    assert not any((Backend.xla().products, Backend.xla().attention, Backend.xla().greedy_head))
    with pytest.raises(ValueError, match="comes with float32 or bfloat16 packed products"):
        Backend(greedy_head=True)
    with pytest.raises(ValueError, match="comes with float32 or bfloat16 packed products"):
        Backend(products=True, greedy_head=True, weights="int8")  # int8 has its own int8 head
    assert Backend(products=True, greedy_head=True, weights="bfloat16").greedy_head
    with pytest.raises(ValueError, match="packed products take weights in"):
        Backend(products=True, weights="float8")


@needs_kernels
def test_the_kernels_run_on_one_cpu_device_in_float32():
    one = choose([CPU], jnp.float32)
    assert one == Backend(products=True, attention=True, greedy_head=head.supported(), cpu_argmax=True)
    # a CPU mesh or another dtype: only the argmax kernel; other platforms: plain XLA
    assert choose([CPU, CPU], jnp.float32) == choose([CPU], jnp.float16) == Backend(cpu_argmax=True)
    assert choose([GPU], jnp.float32) == choose([CPU, GPU], jnp.float32) == Backend.xla()
    assert choose([CPU], jnp.float32, Settings(bf16_screen=False)) == \
        Backend(products=True, attention=True, cpu_argmax=True)
    assert choose([CPU], jnp.float32, Settings(kernels=False)) == Backend.xla()
    # bfloat16 products keep a float32 LM head: greedy steps take the screened head as float32's do
    if head.supported():
        assert choose([CPU], jnp.float32, weights="bfloat16") == Backend(
            products=True, attention=True, greedy_head=True, cpu_argmax=True, weights="bfloat16")


@needs_kernels
def test_the_backend_follows_the_params():
    params = param_tree.init_params(CFG, seed=1)
    assert for_params(params) == choose(jax.devices("cpu")[:1], jnp.float32)
    half = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
    backend, same = layout.runtime_params(half)
    assert backend == Backend(cpu_argmax=True) and "kernel" in same["layers_0"]["fc1"]
    off = Settings(kernels=False)
    backend, plain = layout.runtime_params(params, off)
    assert backend == Backend.xla() and "kernel" in plain["layers_0"]["fc1"] and "lm_head" not in plain
    # the same numbers through either backend (argmax: the kernel's and XLA's pick the first maximum)
    x = jnp.asarray([[0.0, 3.0, 3.0, 1.0]])
    assert int(Backend.xla().argmax(x)[0]) == int(Backend(cpu_argmax=True).argmax(x)[0]) == 1


@needs_kernels
def test_the_screen_is_left_out_where_the_settings_say():
    backend, packed = layout.runtime_params(param_tree.init_params(CFG, seed=1), Settings(bf16_screen=False))
    assert backend.products and not backend.greedy_head and sorted(packed["lm_head"]) == ["packed"]


def test_init_declares_plain_kernels_and_a_packed_backend_refuses_to_init():
    tree = param_tree.param_tree_shapes(CFG)
    assert sorted(tree["layers_0"]["fc1"]) == ["bias", "kernel"]
    b = jnp.zeros((1, 1), jnp.int32)
    attends = [lambda q, k, v: (q, None)] * CFG.num_hidden_layers
    with pytest.raises(ValueError, match="packed weights come from Backend.prepare"):
        opt.OPT(CFG, backend=Backend(products=True)).init(jax.random.PRNGKey(0), b, b, attends)
    h = jnp.ones((1, CFG.word_embed_proj_dim))
    assert np.isfinite(np.asarray(Backend.xla().logits(param_tree.init_params(CFG), h))).all()

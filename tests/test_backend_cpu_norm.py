"""The CPU kernels' layer norm (backend/cpu/norm.py): nn.LayerNorm's numbers, each row's the same whatever the rows
beside it, so a speculative check of several positions computes each as the decode step of that position does, int8
weights included (whose row quantization turns a last-bit difference into a step of the quantized value)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opt_serving.backend.cpu import _lib, norm
from opt_serving.config import OPTConfig

pytestmark = [pytest.mark.cpu_kernels,  # on the CPU device wherever JAX runs (conftest.py)
              pytest.mark.skipif(_lib.load() is None, reason="opt_serving/_cpu_kernels.so not built")]


def _params(d, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32),
            jnp.asarray(0.1 * rng.standard_normal(d), jnp.float32))


# a decode step's rows, a check's, a prompt chunk's (above the size that runs across the kernels' team), a width
# that is no multiple of 16
@pytest.mark.parametrize("rows,d", [(1, 768), (5, 2048), (400, 768), (7, 33)])
def test_layer_norm_gives_flax_s_numbers_and_each_row_alone_the_same(rows, d):
    scale, bias = _params(d)
    x = jnp.asarray(3 * np.random.default_rng(1).standard_normal((rows, d)) + 0.5, jnp.float32)
    f = jax.jit(lambda x: norm.layer_norm(x, scale, bias, 1e-5))
    got = np.asarray(f(x))
    want = nn.LayerNorm(epsilon=1e-5).apply({"params": {"scale": scale, "bias": bias}}, x)
    np.testing.assert_allclose(got, np.asarray(want), atol=2e-5, rtol=1e-5)
    alone = np.concatenate([np.asarray(f(x[i:i + 1])) for i in range(rows)])
    assert np.array_equal(got, alone)  # bit for bit
    np.testing.assert_array_equal(np.asarray(f(x.reshape(1, rows, d))).reshape(rows, d), got)  # any leading dims


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_speculative_check_computes_each_position_as_its_decode_step(quantize):
    """Five tokens after a prompt, in one check (steps.extend_step, each query's attention as its own decode
    step's) and in five decode steps: the same final hidden states, bit for bit. OPT-1.3b's width: there XLA's
    layer norm gave them different last bits (a row's sums vectorised by the step's shape), and int8 checks then
    refused drafts plain decoding would have chosen."""
    from opt_serving.model import loader, sources, steps
    from opt_serving.model.kv_cache import cache_dtype, init_cache
    cfg = OPTConfig(vocab_size=512, hidden_size=2048, num_hidden_layers=1, num_attention_heads=32, ffn_dim=2048,
                    max_position_embeddings=128)
    dtype, fmt = loader._weights_format(loader.model_dtype("float32"), quantize)
    m = loader.load_model(cfg, sources.RandomSource(0), dtype, quantize, fmt)
    params, backend = m.fused_params, m.backend
    assert backend.products
    rng = np.random.default_rng(0)
    prompt, nxt = rng.integers(4, 500, (1, 20)).astype(np.int32), rng.integers(4, 500, (1, 5)).astype(np.int32)
    cache = init_cache(cfg, 1, 64, cache_dtype(params, backend))
    _, cache = jax.jit(lambda p, c, x: steps.prefill_step(cfg, p, c, x, jnp.ones_like(x), all_logits=False,
                                                          return_hidden=True, backend=backend))(params, cache, prompt)
    check, _ = jax.jit(lambda p, c, x: steps.extend_step(cfg, p, c, x, 20, jnp.ones_like(x), return_hidden=True,
                                                         backend=backend, per_query=True))(
        params, jax.tree_util.tree_map(jnp.copy, cache), nxt)
    decode = jax.jit(lambda p, c, t, at: steps.decode_step(cfg, p, c, t, at, at, jnp.int32(64), return_hidden=True,
                                                           backend=backend))
    hidden = []
    for i in range(5):
        h, cache = decode(params, cache, nxt[:, i], np.array([20 + i], np.int32))
        hidden.append(np.asarray(h))
    np.testing.assert_array_equal(np.asarray(check)[0], np.concatenate(hidden))

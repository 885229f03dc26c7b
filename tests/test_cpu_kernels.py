"""The CPU kernels (opt_serving/_cpu_kernels.cc via cpu_kernels.py): oneDNN products on packed
weights, and argmax, against numpy; packing the params and undoing it."""
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opt_serving.config import OPTConfig
from opt_serving.model import cpu_kernels, opt

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="opt_serving/_cpu_kernels.so not built")
CFG = OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                ffn_dim=64, max_position_embeddings=64)


def test_built_where_the_requirements_install_onednn():
    # requirements.txt installs oneDNN on Linux x86_64 and build.sh compiles against it there
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert cpu_kernels.available(), f"{cpu_kernels.LIBRARY} missing or not loadable: run ./build.sh"


@needs_kernels
@pytest.mark.parametrize("m,k,n", [(1, 32, 96), (5, 33, 70), (17, 768, 300), (64, 64, 16)])
def test_packed_product_equals_numpy(m, k, n):
    rng = np.random.default_rng(m)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
    packed = cpu_kernels.pack(w)
    assert packed.dtype == jnp.uint8
    ref = x.astype(np.float64) @ w.astype(np.float64) + b
    got = jax.jit(lambda x, p, b: cpu_kernels.matmul(x, p, n, b))(x, packed, b)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)
    relu = cpu_kernels.matmul(jnp.asarray(x), packed, n, jnp.asarray(b), relu=True)
    np.testing.assert_allclose(np.asarray(relu), np.maximum(ref, 0), rtol=1e-5, atol=1e-4)
    no_bias = cpu_kernels.matmul(jnp.asarray(x)[None], packed, n)  # leading dims kept: [1, m, n]
    assert no_bias.shape == (1, m, n)
    np.testing.assert_allclose(np.asarray(no_bias)[0], ref - b, rtol=1e-5, atol=1e-4)
    assert np.array_equal(cpu_kernels.unpack(packed, k, n), w)  # packing only moves the numbers


@needs_kernels
def test_transposed_packing_is_the_tied_lm_head():
    rng = np.random.default_rng(0)
    emb, h = rng.standard_normal((96, 32), np.float32), rng.standard_normal((3, 32), np.float32)
    got = cpu_kernels.matmul(jnp.asarray(h), cpu_kernels.pack(emb, transposed=True), 96)
    np.testing.assert_allclose(np.asarray(got), h @ emb.T, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_a_packed_buffer_of_the_wrong_size_is_refused():
    packed = cpu_kernels.pack(np.ones((32, 96), np.float32))
    with pytest.raises(Exception, match="packed weight has"):
        jax.block_until_ready(cpu_kernels.matmul(jnp.ones((2, 32)), packed[:-64], 96))
    with pytest.raises(ValueError, match=r"not a packed \[48, 96\] weight"):
        cpu_kernels.unpack(packed, 48, 96)


@needs_kernels
def test_argmax_is_numpys_first_maximum_and_first_nan():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 50272)).astype(np.float32)
    x[1, 7] = x[1, 9] = x[1].max() + 1          # a tie: the first index wins
    x[2, 40000] = np.nan                         # a NaN wins, as in np.argmax
    x[2, 50000] = np.nan
    x[3] = -np.inf                               # all -inf: index 0
    x[4, -1] = np.inf                            # in the last, partial chunk of 1024
    x[5, 1500] = x[5, 3000] = x[5].max() + 1     # a tie across chunks: the first chunk's wins
    got = np.asarray(jax.jit(cpu_kernels.argmax)(x))
    assert got.dtype == np.int32
    assert np.array_equal(got, np.argmax(x, -1)), (got, np.argmax(x, -1))
    assert list(got[1:6]) == [7, 40000, 0, 50271, 1500]
    batched = x[:4].reshape(2, 2, -1)  # leading dims kept
    assert np.array_equal(np.asarray(cpu_kernels.argmax(jnp.asarray(batched))), np.argmax(batched, -1))


@needs_kernels
def test_pack_params_round_trip_and_where_it_applies():
    params = opt.fuse_qkv(opt.init_params(CFG, seed=1))
    packed = opt.runtime_params(opt.init_params(CFG, seed=1))
    assert cpu_kernels.is_packed(packed) and opt.runtime_params(packed) is packed  # idempotent
    layer = packed["layers_0"]
    assert sorted(layer["fc1"]) == ["bias", "packed"] and sorted(layer["self_attn"]["qkv_proj"]) == ["bias", "packed"]
    assert cpu_kernels.has_head(packed) == cpu_kernels.head_available()
    back = cpu_kernels.unpack_params(packed)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(back),
                                                     jax.tree_util.tree_leaves(params)))
    # float16 params stay as they are: the kernels are float32
    half = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)
    assert not cpu_kernels.is_packed(cpu_kernels.pack_params(half))
    # the packed forward pass gives the plain one's numbers
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 96, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(opt.forward(CFG, packed, ids)),
                               np.asarray(opt.forward(CFG, params, ids)), rtol=1e-5, atol=1e-5)


needs_head = pytest.mark.skipif(not cpu_kernels.head_available(),
                                reason="no native bfloat16 products on this CPU (or the kernels are not built)")


def _bf16(a):
    """Round float32 to bfloat16 (nearest even) and back, as the screen's products see their inputs."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


@needs_head
def test_screened_greedy_tokens_are_the_exact_argmax():
    rng = np.random.default_rng(0)
    v, k, m = 3000, 64, 48
    e = (rng.standard_normal((v, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    # near-ties bfloat16 cannot tell apart: for rows 0-31 a pair of tokens whose logits differ by
    # ~1e-4 (bfloat16's own error is ~1e-2 here), both far above every other token
    for r in range(32):
        a, b = 2 * r, 2 * r + 1
        e[a] = x[r] / np.linalg.norm(x[r]) * 0.5
        nudge = rng.standard_normal(k).astype(np.float32)
        nudge -= nudge @ x[r] / (x[r] @ x[r]) * x[r]  # orthogonal to x: only the scale below moves the logit
        e[b] = e[a] * np.float32(1 + (1 if r % 2 else -1) * 2e-4) + 1e-3 * nudge
    head = cpu_kernels.pack_head(e)
    params = {"lm_head": head, "embed_tokens": {"embedding": jnp.asarray(e)}}
    got = np.asarray(jax.jit(cpu_kernels.greedy_tokens)(params, x))
    exact = x.astype(np.float64) @ e.T.astype(np.float64)
    np.testing.assert_array_equal(got, exact.argmax(-1))
    assert (got[:32:2] == np.arange(0, 64, 4)).all() and (got[1:32:2] == np.arange(3, 64, 4)).all()
    # the bfloat16 products alone get some of the near-ties wrong: the exact rescoring decided them
    screen = _bf16(x).astype(np.float64) @ _bf16(e).T.astype(np.float64)
    assert (screen.argmax(-1)[:32] != got[:32]).any()
    # a token left out (EOS held back): the exact argmax of the others; in a near-tie, the other of the pair
    exclude = np.where(np.arange(m) % 3 == 0, exact.argmax(-1), -1).astype(np.int32)
    got = np.asarray(cpu_kernels.greedy_tokens(params, jnp.asarray(x), jnp.asarray(exclude)))
    masked = exact.copy()
    masked[np.arange(m)[exclude >= 0], exclude[exclude >= 0]] = -np.inf
    np.testing.assert_array_equal(got, masked.argmax(-1))
    assert (got[0:32:6] == np.arange(0, 64, 12) + 1).all()
    # leading dimensions are kept, and the row norms bound every row of e from above
    assert cpu_kernels.greedy_tokens(params, jnp.asarray(x)[None]).shape == (1, m)
    assert (np.asarray(head["row_norms"]) >= np.linalg.norm(e.astype(np.float64), axis=1)).all()


@needs_head
def test_screened_greedy_tokens_on_inputs_the_bound_does_not_cover():
    rng = np.random.default_rng(1)
    e = rng.standard_normal((500, 16)).astype(np.float32)
    params = {"lm_head": cpu_kernels.pack_head(e), "embed_tokens": {"embedding": jnp.asarray(e)}}
    x = rng.standard_normal((3, 16)).astype(np.float32)
    x[0] = 0.0         # every logit ties at 0: the first token, as jnp.argmax
    x[1, 3] = np.nan   # every logit NaN: the first NaN wins, as jnp.argmax
    got = np.asarray(cpu_kernels.greedy_tokens(params, jnp.asarray(x)))
    assert got.tolist() == [0, 0, int(np.argmax(x[2].astype(np.float64) @ e.T.astype(np.float64)))]
    # a weight with no finite norm has no error bound: no screened head for it
    e[7, 2] = np.inf
    assert cpu_kernels.pack_head(e) is None


@needs_kernels
def test_lm_argmax_with_and_without_the_screened_head():
    params = opt.init_params(CFG, seed=3)
    packed = opt.runtime_params(params)
    h = jnp.asarray(np.random.default_rng(2).standard_normal((4, CFG.word_embed_proj_dim)), jnp.float32)
    logits = np.asarray(opt.lm_logits(params, h), np.float64)
    exclude = jnp.asarray([logits[0].argmax(), -1, 5, logits[3].argmax()], jnp.int32)
    logits[[0, 2, 3], [int(exclude[0]), 5, int(exclude[3])]] = -np.inf
    for p in (params, packed):  # the plain logits path, and the screen where this CPU has one
        assert np.asarray(jax.jit(opt.lm_argmax)(p, h, exclude)).tolist() == logits.argmax(-1).tolist()


@needs_head
def test_the_screen_is_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("OPT_SERVING_BF16_SCREEN", "0")
    assert not cpu_kernels.head_available()
    packed = opt.runtime_params(opt.init_params(CFG, seed=1))
    assert cpu_kernels.is_packed(packed) and not cpu_kernels.has_head(packed)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("OPT_SERVING_ONEDNN", "0")
    cpu_kernels._lib.cache_clear()
    try:
        assert not cpu_kernels.available()
        params = opt.init_params(CFG, seed=1)
        assert not cpu_kernels.is_packed(opt.runtime_params(params))
        x = jnp.asarray([[0.0, 3.0, 3.0, 1.0]])
        assert int(cpu_kernels.argmax(x)[0]) == 1  # the plain jnp.argmax path
    finally:
        monkeypatch.undo()
        cpu_kernels._lib.cache_clear()


@needs_kernels
@pytest.mark.parametrize("d, n", [(16, 11), (64, 11), (64, 16), (64, 33), (128, 17), (128, 40)])
def test_decode_attention_reads_only_the_written_entries(d, n):
    """head_dim 64 and 128 take the AVX-512 code where the CPU has it (16 keys at a time: n across
    a block edge), other sizes the portable code."""
    rng = np.random.default_rng(0)
    b, h, t = 3, 4, 48
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(2))
    mask = np.zeros((b, t), bool)
    mask[:, :n] = True
    mask[1, :4] = False  # a left-padded row
    mask[2, 3] = False  # a hole
    k[:, :, n:], v[:, :, n:] = 1e30, np.nan  # past read_len: must never be read
    ref_scores = np.einsum("bhd,bhtd->bht", q, k[:, :, :n]).astype(np.float64)
    ref_scores[~np.broadcast_to(mask[:, None, :n], ref_scores.shape)] = -np.inf
    p = np.exp(ref_scores - ref_scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bht,bhtd->bhd", p, v[:, :, :n])
    zeros = lambda q, k, v, m: jnp.zeros_like(q)  # noqa: E731  (the non-CPU fallback: must not be what runs)
    got = jax.jit(lambda *a: cpu_kernels.decode_attention(*a, jnp.int32(n), zeros))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell 1 thread from all")
def test_kernels_use_every_cpu_whatever_omp_num_threads_says():
    # a Ray worker (a Serve replica) gets OMP_NUM_THREADS=1 from Ray; the kernels must still use every CPU,
    # as XLA's own pool does, unless OPT_SERVING_CPU_THREADS says otherwise
    probe = ("from opt_serving.model import cpu_kernels as k; lib = k._lib(); "
             "print(lib.opt_cpu_kernels_team_size(), k.threads())")
    def team(**env):
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, check=True,
                             capture_output=True, text=True).stdout.split()
        return int(out[0]), int(out[1])
    cpus = len(os.sched_getaffinity(0))
    assert team(OMP_NUM_THREADS="1") == (cpus, cpus)
    assert team(OMP_NUM_THREADS="1", OPT_SERVING_CPU_THREADS="1") == (1, 1)

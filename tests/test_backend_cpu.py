"""The CPU kernels (opt_serving/csrc via backend/cpu/), module by module, against numpy: products on packed
weights (products.py), the decode attention (attention.py), argmax and the screened greedy head (head.py),
and the extension's loading and threads (_lib.py); glibc's heap kept for the steps (heap.py)."""
import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opt_serving.backend import Backend, for_params, sampling
from opt_serving.backend.cpu import _lib, attention, head, products
from opt_serving.model import layout, opt, param_tree, steps
from opt_serving.settings import Settings

from conftest import TINY

pytestmark = pytest.mark.cpu_kernels  # on the CPU device wherever JAX runs (conftest.py)

needs_kernels = pytest.mark.skipif(_lib.load() is None, reason="opt_serving/_cpu_kernels.so not built")
needs_head = pytest.mark.skipif(not head.supported(),
                                reason="no native int8 (VNNI, AMX) or bfloat16 products on this CPU (or no kernels)")
CFG = TINY


def test_built_where_the_requirements_install_onednn():
    # requirements.txt installs oneDNN on Linux x86_64 and build.sh compiles against it there
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert _lib.load() is not None, f"{_lib.LIBRARY} missing or not loadable: run ./build.sh"


# ---- products.py ----

@pytest.fixture
def f32_kernel(request):
    """Which kernel runs float32 products of 9-96 rows: "onednn" (its own) or "tiles" (ours); the default is put
    back after."""
    if request.param == "tiles" and not products.f32_tile_rows():
        pytest.skip("our float32 kernel needs AVX-512")
    products.f32_tile_rows(96 if request.param == "tiles" else 0)
    yield request.param
    products.f32_tile_rows(-1)


@needs_kernels
@pytest.mark.parametrize("f32_kernel", ["onednn", "tiles"], indirect=True)
@pytest.mark.parametrize("m,k,n", [(1, 32, 96), (3, 40, 100), (5, 33, 70), (6, 64, 200), (8, 100, 130),
                                   (9, 130, 70), (17, 768, 300), (64, 64, 16), (40, 200, 1000), (96, 520, 200),
                                   (97, 64, 16)])
def test_packed_product_equals_numpy(m, k, n, f32_kernel):
    rng = np.random.default_rng(m)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
    packed = products.pack(w)
    assert packed.dtype == jnp.uint8
    ref = x.astype(np.float64) @ w.astype(np.float64) + b
    got = jax.jit(lambda x, p, b: products.matmul(x, p, n, b))(x, packed, b)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)
    relu = products.matmul(jnp.asarray(x), packed, n, jnp.asarray(b), relu=True)
    np.testing.assert_allclose(np.asarray(relu), np.maximum(ref, 0), rtol=1e-5, atol=1e-4)
    no_bias = products.matmul(jnp.asarray(x)[None], packed, n)  # leading dims kept: [1, m, n]
    assert no_bias.shape == (1, m, n)
    np.testing.assert_allclose(np.asarray(no_bias)[0], ref - b, rtol=1e-5, atol=1e-4)
    assert np.array_equal(products.unpack(packed, k, n), w)  # packing only moves the numbers


@needs_kernels
def test_float32_rows_sum_the_same_whatever_the_rows_beside_them():
    """Where AVX-512 is not used (a CPU without it; with it, OPT_SERVING_NO_AVX512 in a child) every float32
    product runs our strips of 16 columns (csrc/products_f32.cc, f32_panels): a row's numbers are the same bits in
    a product of 1 row or of 70 (one group of rows or several, groups of uneven sizes, a partial last strip, k
    padded), wherever the row sits, and numpy's within rounding."""
    if products.f32_tile_rows(-1):  # (0 only without AVX-512) oneDNN's kernels run here: rows sum with their batch
        probe = ("import sys; sys.path.insert(0, 'tests'); import test_backend_cpu as t; "
                 "t.test_float32_rows_sum_the_same_whatever_the_rows_beside_them()")
        run_child(probe, OPT_SERVING_NO_AVX512="1")
        return
    rng = np.random.default_rng(7)
    k, n = 300, 200
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((70, k), (k, n), (n,)))
    packed = products.pack(w)
    product = jax.jit(lambda x, p, b: products.matmul(x, p, n, b, relu=True))
    full = np.asarray(product(x, packed, b))
    np.testing.assert_allclose(full, np.maximum(x.astype(np.float64) @ w + b, 0), rtol=1e-5, atol=1e-4)
    for first, m in ((0, 1), (5, 1), (0, 5), (3, 6), (1, 7), (0, 13), (29, 33)):
        assert np.array_equal(np.asarray(product(x[first:first + m], packed, b)), full[first:first + m]), (first, m)


needs_bf16 = pytest.mark.skipif(not head.supported(), reason="no native bfloat16 products on this CPU")


@pytest.fixture
def int8_kernel(request):
    """Which kernel runs int8 products: "onednn" (its own) or "vnni" (ours, tiles taken as the threads free up),
    for every row count; the default is put back after."""
    if request.param == "vnni" and not products.s8_vnni_reads(768, 300):
        pytest.skip("oneDNN packs int8 weights here in a layout our VNNI kernel does not read (or no AVX512_VNNI)")
    products.s8_vnni_rows(1 if request.param == "vnni" else 0)
    yield request.param
    products.s8_vnni_rows(-1)


@needs_kernels
@pytest.mark.parametrize("int8_kernel", ["onednn", "vnni"], indirect=True)
@pytest.mark.parametrize("m,k,n", [(1, 32, 96), (3, 33, 70), (17, 768, 300), (64, 3072, 48), (7, 100, 130)])
def test_int8_product_is_the_row_quantized_product(m, k, n, int8_kernel):
    # the kernel's own arithmetic, in numpy: each row of x to int8 with scale max|x|/127 (7 bits, max|x|/63, on a CPU
    # whose int8 products sum pairs in int16: products.int8_row_levels), exact int32 sums, scaled
    rng = np.random.default_rng(m)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
    x[0] *= 100  # rows of very different sizes keep their own scales
    scale = np.abs(w).max(0) / 127
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    packed = products.pack(q, weights="int8")
    assert np.array_equal(products.unpack(packed, k, n, "int8"), q)
    levels = products.int8_row_levels()
    sx = np.abs(x).max(1) / levels
    qx = np.clip(np.rint(x / sx[:, None]), -levels, levels)
    ref = (qx @ q.astype(np.float64)) * sx[:, None] * scale + b
    got = jax.jit(lambda x, p, s, b: products.matmul(x, p, n, b, relu=True, weights="int8", scales=s))(
        x, packed, scale, b)
    np.testing.assert_allclose(np.asarray(got), np.maximum(ref, 0), rtol=1e-4, atol=1e-3 * np.abs(ref).max())
    # and close to the float32 product: ~1% of its size (two roundings of 1/254 of a row's max each)
    exact = x.astype(np.float64) @ w + b
    assert np.abs(np.asarray(products.matmul(jnp.asarray(x), packed, n, jnp.asarray(b), weights="int8",
                                             scales=jnp.asarray(scale))) - exact).max() \
        < 0.03 * np.abs(exact).max()


@needs_kernels
@pytest.mark.parametrize("m,k,n", [(32, 768, 2304), (13, 3072, 200), (1, 33, 70), (256, 64, 64)])
def test_int8_kernels_give_the_same_numbers(m, k, n):
    """Our VNNI kernel and oneDNN's: the same int32 sums (the same rows, uint8-shifted and compensated back) and
    the same float32 scaling, so the same bits without a bias; with one, the last step (y * s_row + bias) may be
    one fused multiply-add in one and two roundings in the other (oneDNN's path adds the bias in a vectorized
    loop whose remainder columns are not fused)."""
    if not products.s8_vnni_reads(k, n):
        pytest.skip("our VNNI kernel does not read oneDNN's int8 layout here (or no AVX512_VNNI)")
    rng = np.random.default_rng(m + k)
    x, b = rng.standard_normal((m, k)).astype(np.float32) * 3, rng.standard_normal(n).astype(np.float32)
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = (rng.random(n) * 0.01).astype(np.float32)
    packed = products.pack(q, weights="int8")
    outs = {}
    try:
        for rows in (0, 1):  # oneDNN's, then ours for every row count
            products.s8_vnni_rows(rows)
            outs[rows] = [np.asarray(products.matmul(jnp.asarray(x), packed, n, bias, relu=relu, weights="int8",
                                                     scales=jnp.asarray(scale)))
                          for bias, relu in ((jnp.asarray(b), True), (None, False))]
    finally:
        products.s8_vnni_rows(-1)
    (biased, plain), (biased_ref, plain_ref) = outs[1], outs[0]
    assert np.array_equal(plain, plain_ref)
    assert (plain < 0).any()  # (no ReLU there)
    np.testing.assert_allclose(biased, biased_ref, rtol=1e-6, atol=1e-6 * np.abs(biased_ref).max())


@needs_kernels
def test_f32_tiles_setting_is_kept_until_set_again_and_sums_as_closely_as_onednn():
    default = products.f32_tile_rows()
    try:
        assert products.f32_tile_rows(0) == 0 and products.f32_tile_rows() == 0
        rng = np.random.default_rng(3)
        x, w = rng.standard_normal((32, 3072), np.float32), rng.standard_normal((3072, 768), np.float32)
        ref, packed = x.astype(np.float64) @ w.astype(np.float64), products.pack(w)
        errors = {}
        for rows in (0, 96):  # oneDNN's, then ours (when this CPU runs it)
            products.f32_tile_rows(rows)
            errors[products.f32_tile_rows()] = np.abs(np.asarray(products.matmul(x, packed, 768)) - ref).max()
        # slices of 128 terms summed apart, then added: no further from the exact sums than oneDNN's
        assert max(errors.values()) <= 1.5 * errors[0]
    finally:
        products.f32_tile_rows(-1)
    assert products.f32_tile_rows() == default


@needs_kernels
def test_f32_tiles_default_follows_the_cpu():
    """Where oneDNN's kernel catches up with the tiles was measured per CPU maker: 48 rows on AMD, 96 on
    Intel, never without AVX-512 (the tiles' only code)."""
    flags = vendor = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = value.split()
        if key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
    expected = 0 if "avx512f" not in flags else 48 if vendor == "AuthenticAMD" else 96
    assert products.f32_tile_rows(-1) == expected


def test_int8_vnni_setting_is_kept_until_set_again():
    before = products.s8_vnni_rows()
    try:
        assert products.s8_vnni_rows(5) == 5 and products.s8_vnni_rows() == 5
        assert products.s8_vnni_rows(0) == 0
    finally:
        assert products.s8_vnni_rows(-1) == before == 1  # the default, as at load


@pytest.fixture
def bf16_kernel(request):
    """Which kernel runs bfloat16 products: "onednn" (its native bfloat16 ones) or "fma" (ours: the weights
    widened in registers, float32 FMAs), for every row count; this CPU's default is put back after."""
    if request.param == "fma" and not products.bf16_fma_reads(768, 300):
        pytest.skip("oneDNN packs bfloat16 weights here in a layout the FMA kernel does not read (or no AVX512BW)")
    products.bf16_fma_rows(1 if request.param == "fma" else 0)
    yield request.param
    products.bf16_fma_rows(-1)


@needs_kernels
@needs_bf16
@pytest.mark.parametrize("bf16_kernel", ["onednn", "fma"], indirect=True)
@pytest.mark.parametrize("m,k,n", [(1, 32, 96), (5, 768, 300), (64, 64, 16), (13, 33, 70), (27, 3072, 200)])
def test_bfloat16_product_rounds_both_factors_and_sums_in_float32(m, k, n, bf16_kernel):
    """Either kernel: rows and weights rounded to bfloat16, exact products, float32 sums; odd K, K off a
    block of 32, N off a block of 64 and row counts off the FMA kernel's tiles of 12 included."""
    import ml_dtypes
    rng = np.random.default_rng(m)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
    packed = products.pack(w, weights="bfloat16")
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(products.unpack(packed, k, n, "bfloat16"), bf(w).astype(np.float32))
    ref = bf(x) @ bf(w) + b
    got = np.asarray(products.matmul(jnp.asarray(x), packed, n, jnp.asarray(b), relu=True, weights="bfloat16"))
    np.testing.assert_allclose(got, np.maximum(ref, 0), rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # without the bias and the ReLU: every column written (the FMA kernel stores 32 at a time, masked at N)
    plain = np.asarray(products.matmul(jnp.asarray(x), packed, n, weights="bfloat16"))
    np.testing.assert_allclose(plain, bf(x) @ bf(w), rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@needs_kernels
@needs_bf16
def test_bfloat16_fma_setting_is_kept_until_set_again():
    before = products.bf16_fma_rows()
    try:
        assert products.bf16_fma_rows(5) == 5 and products.bf16_fma_rows() == 5
        assert products.bf16_fma_rows(0) == 0
    finally:
        assert products.bf16_fma_rows(-1) == before  # the CPU's default, as at load


@needs_kernels
@pytest.mark.skipif(head.supported(), reason="this CPU has native bfloat16 products")
def test_packing_bfloat16_weights_without_bfloat16_products_says_so():
    with pytest.raises(ValueError, match="no bfloat16 products on this CPU"):
        products.pack(np.ones((8, 4), np.float32), weights="bfloat16")


@needs_kernels
def test_int8_weights_need_their_scales_and_nothing_else_takes_them():
    w = np.ones((8, 4), np.int8)
    with pytest.raises(ValueError, match="scales"):
        products.matmul(jnp.ones((1, 8)), products.pack(w, weights="int8"), 4, weights="int8")
    with pytest.raises(ValueError, match="scales"):
        products.matmul(jnp.ones((1, 8)), products.pack(w.astype(np.float32)), 4, scales=jnp.ones(4))
    with pytest.raises(ValueError, match="float16"):
        products.pack(w, weights="float16")


@needs_kernels
def test_transposed_packing_is_the_tied_lm_head():
    rng = np.random.default_rng(0)
    emb, h = rng.standard_normal((96, 32), np.float32), rng.standard_normal((3, 32), np.float32)
    got = products.matmul(jnp.asarray(h), products.pack(emb, transposed=True), 96)
    np.testing.assert_allclose(np.asarray(got), h @ emb.T, rtol=1e-5, atol=1e-4)


@needs_kernels
def test_a_packed_buffer_of_the_wrong_size_or_format_is_refused():
    packed = products.pack(np.ones((32, 96), np.float32))
    with pytest.raises(Exception, match="packed weight has"):
        jax.block_until_ready(products.matmul(jnp.ones((2, 32)), packed[:-64], 96))
    with pytest.raises(ValueError, match=r"not a packed \[48, 96\] float32 weight"):
        products.unpack(packed, 48, 96)
    with pytest.raises(ValueError, match="packed products take weights in"):
        products.pack(np.ones((32, 96), np.float32), weights="float8")


@needs_kernels
def test_pack_params_round_trip():
    params = layout.fuse_qkv(param_tree.init_params(CFG, seed=1))
    backend, packed = layout.runtime_params(param_tree.init_params(CFG, seed=1))
    assert backend.products and backend.greedy_head == head.supported()
    layer = packed["layers_0"]
    assert sorted(layer["fc1"]) == ["bias", "packed"] and sorted(layer["self_attn"]["qkv_proj"]) == ["bias", "packed"]
    screen = {"int8": ["l1_norms", "s8", "s8_scales"], "bfloat16": ["bf16"]}[head.screens()[0]] \
        if backend.greedy_head else []
    assert sorted(packed["lm_head"]) == sorted(["packed"] + (["row_norms"] + screen if screen else []))
    back = backend.plain(packed, param_tree.param_tree_shapes(CFG, fused_qkv=True))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(back),
                                                     jax.tree_util.tree_leaves(params)))
    # the packed forward pass gives the plain one's numbers
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 96, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(steps.forward(CFG, packed, ids, backend=backend)),
                               np.asarray(steps.forward(CFG, params, ids)), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_350m_projections_are_packed_too():
    cfg = CFG.replace(word_embed_proj_dim=16, do_layer_norm_before=False)
    params = param_tree.init_params(cfg, seed=2)
    backend, packed = layout.runtime_params(params)
    assert sorted(packed["project_in"]) == sorted(packed["project_out"]) == ["packed"]
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 96, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(steps.forward(cfg, packed, ids, backend=backend)),
                               np.asarray(steps.forward(cfg, params, ids)), rtol=1e-5, atol=1e-5)
    back = layout.checkpoint_params(cfg, backend, packed)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(back),
                                                     jax.tree_util.tree_leaves(params)))


# ---- head.py ----

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
    argmax = lambda x: head.argmax(x, sampling.argmax)  # noqa: E731
    got = np.asarray(jax.jit(argmax)(x))
    assert got.dtype == np.int32
    assert np.array_equal(got, np.argmax(x, -1)), (got, np.argmax(x, -1))
    assert list(got[1:6]) == [7, 40000, 0, 50271, 1500]
    batched = x[:4].reshape(2, 2, -1)  # leading dims kept
    assert np.array_equal(np.asarray(argmax(jnp.asarray(batched))), np.argmax(batched, -1))


def _bf16(a):
    """Round float32 to bfloat16 (nearest even) and back, as the screen's products see their inputs."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def _near_ties(rng, v, k, m):
    """An embedding e [v, k] and rows x [m, k] where rows 0-31 each have a pair of tokens whose logits differ
    by ~1e-4 (bfloat16's own error is ~1e-2 here), both far above every other token."""
    e = (rng.standard_normal((v, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    for r in range(32):
        a, b = 2 * r, 2 * r + 1
        e[a] = x[r] / np.linalg.norm(x[r]) * 0.5
        nudge = rng.standard_normal(k).astype(np.float32)
        nudge -= nudge @ x[r] / (x[r] @ x[r]) * x[r]  # orthogonal to x: only the scale below moves the logit
        e[b] = e[a] * np.float32(1 + (1 if r % 2 else -1) * 2e-4) + 1e-3 * nudge
    return e, x


def _int8(a):
    """Each row rounded to int8 with its own scale (max |a| / 127), as the int8 screen does."""
    s = np.abs(a).max(-1, keepdims=True).astype(np.float64) / 127
    return np.round(a / s) * s


@needs_head
@pytest.mark.parametrize("kind", head.screens() if head.supported() else ["none"])
@pytest.mark.parametrize("portable", [False, True])
def test_screened_greedy_tokens_are_the_exact_argmax(kind, portable):
    """Near-ties decided exactly, a token held back, structured output's masks; the passes over the vocabulary's
    bounds in their AVX-512 code where the CPU has it and with OPT_SERVING_NO_AVX512 in the portable code (a
    child), over a vocabulary that is no multiple of their blocks."""
    if portable:
        probe = ("import sys; sys.path.insert(0, 'tests'); import test_backend_cpu as t; "
                 f"t.test_screened_greedy_tokens_are_the_exact_argmax({kind!r}, False)")
        run_child(probe, OPT_SERVING_NO_AVX512="1")
        return
    m = 48
    e, x = _near_ties(np.random.default_rng(0), 3000, 64, m)
    packed_head = head.pack_head(e, kind=kind)
    params = {"lm_head": packed_head, "embed_tokens": {"embedding": jnp.asarray(e)}}
    got = np.asarray(jax.jit(head.greedy_tokens)(params, x))
    exact = x.astype(np.float64) @ e.T.astype(np.float64)
    np.testing.assert_array_equal(got, exact.argmax(-1))
    assert (got[:32:2] == np.arange(0, 64, 4)).all() and (got[1:32:2] == np.arange(3, 64, 4)).all()
    # the bfloat16 or int8 products alone get some of the near-ties wrong: the exact rescoring decided them
    rounded = _bf16 if kind == "bfloat16" else _int8
    screen = rounded(x).astype(np.float64) @ rounded(e).T.astype(np.float64)
    assert (screen.argmax(-1)[:32] != got[:32]).any()
    # a token left out (EOS held back): the exact argmax of the others; in a near-tie, the other of the pair
    exclude = np.where(np.arange(m) % 3 == 0, exact.argmax(-1), -1).astype(np.int32)
    got = np.asarray(head.greedy_tokens(params, jnp.asarray(x), jnp.asarray(exclude)))
    masked = exact.copy()
    masked[np.arange(m)[exclude >= 0], exclude[exclude >= 0]] = -np.inf
    np.testing.assert_array_equal(got, masked.argmax(-1))
    assert (got[0:32:6] == np.arange(0, 64, 12) + 1).all()
    # structured output's masks: each masked row's exact argmax over its allowed tokens (a near-tie's other token
    # when the best is masked out); a row of -1 allows every token
    rng = np.random.default_rng(5)
    allowed = rng.random((m, 3000)) < 0.3
    allowed[0:32:4, exact.argmax(-1)[0:32:4]] = False
    allowed[np.arange(0, 32, 4), exact.argmax(-1)[0:32:4] ^ 1] = True  # (the pairs: 2r and 2r + 1)
    allowed[1] = True
    words = np.zeros((m, (3000 + 31) // 32), np.uint32)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    words[1] = 0xFFFFFFFF
    got = np.asarray(jax.jit(head.greedy_tokens)(params, x, None, words.view(np.int32)))
    np.testing.assert_array_equal(got, np.where(allowed, exact, -np.inf).argmax(-1))
    assert (got[0:32:4] == exact.argmax(-1)[0:32:4] ^ 1).all()
    with pytest.raises(Exception, match="allowed must be"):
        np.asarray(head.greedy_tokens(params, x, None, words[:, :5].view(np.int32)))
    # leading dimensions are kept, and the row norms bound every row of e from above
    assert head.greedy_tokens(params, jnp.asarray(x)[None]).shape == (1, m)
    assert (np.asarray(packed_head["row_norms"]) >= np.linalg.norm(e.astype(np.float64), axis=1)).all()
    if kind == "int8":
        assert (np.asarray(packed_head["l1_norms"]) >= np.abs(e.astype(np.float64)).sum(1)).all()


@needs_head
@pytest.mark.parametrize("kind", head.screens() if head.supported() else ["none"])
def test_screened_greedy_tokens_on_inputs_the_bound_does_not_cover(kind):
    rng = np.random.default_rng(1)
    e = rng.standard_normal((500, 16)).astype(np.float32)
    params = {"lm_head": head.pack_head(e, kind=kind), "embed_tokens": {"embedding": jnp.asarray(e)}}
    x = rng.standard_normal((3, 16)).astype(np.float32)
    x[0] = 0.0         # every logit ties at 0: the first token, as jnp.argmax
    x[1, 3] = np.nan   # every logit NaN: the first NaN wins, as jnp.argmax
    got = np.asarray(head.greedy_tokens(params, jnp.asarray(x)))
    assert got.tolist() == [0, 0, int(np.argmax(x[2].astype(np.float64) @ e.T.astype(np.float64)))]
    # a weight with no finite norm has no error bound: no screened head for it
    e[7, 2] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        head.pack_head(e, kind=kind)
    tree = param_tree.init_params(CFG, seed=1)
    tree["embed_tokens"] = {"embedding": jnp.asarray(tree["embed_tokens"]["embedding"]).at[3, 1].set(jnp.nan)}
    backend = for_params(tree)
    assert backend.products and not backend.greedy_head
    assert sorted(backend.prepare(tree)["lm_head"]) == ["packed"]


@needs_kernels
def test_lm_argmax_with_and_without_the_screened_head():
    params = param_tree.init_params(CFG, seed=3)
    backend, packed = layout.runtime_params(params)
    h = jnp.asarray(np.random.default_rng(2).standard_normal((4, CFG.word_embed_proj_dim)), jnp.float32)
    logits = np.asarray(opt.lm_logits(params, h), np.float64)
    exclude = jnp.asarray([logits[0].argmax(), -1, 5, logits[3].argmax()], jnp.int32)
    logits[[0, 2, 3], [int(exclude[0]), 5, int(exclude[3])]] = -np.inf
    # the plain logits path, the packed one with the CPU argmax, and the screen where this CPU has one
    # structured output's masks on rows 1 and 2 (row 1's best left out), none on rows 0 and 3
    allowed = np.zeros((4, (CFG.vocab_size + 31) // 32), np.int32)
    allowed[1, :] = -1
    allowed[1, int(logits[1].argmax()) // 32] &= ~(1 << (int(logits[1].argmax()) % 32))
    allowed[2, 0] = 0b1010_0000
    constrained = np.array([False, True, True, False])
    masked = np.where(np.asarray(sampling.unpack_bitmask(jnp.asarray(allowed), CFG.vocab_size)) | ~constrained[:, None],
                      logits, -np.inf)
    for p, b in ((params, Backend.xla()), (packed, Backend(products=True, cpu_argmax=True)), (packed, backend)):
        got = jax.jit(opt.lm_argmax, static_argnums=(3,))(p, h, exclude, b)
        assert np.asarray(got).tolist() == logits.argmax(-1).tolist()
        got = jax.jit(opt.lm_argmax, static_argnums=(3,))(p, h, exclude, b, (allowed, constrained))
        assert np.asarray(got).tolist() == masked.argmax(-1).tolist()
    assert masked.argmax(-1)[2] in (5, 7)


# ---- attention.py ----

@needs_kernels
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "bits"])
@pytest.mark.parametrize("d, n", [(16, 11), (64, 11), (64, 16), (64, 33), (128, 17), (128, 40)])
def test_decode_attention_reads_only_the_written_entries(d, n, cache):
    """head_dim 64 and 128 take the AVX-512 code where the CPU has it (16 keys at a time: n across
    a block edge), other sizes the portable code; a bfloat16 cache is read as the float32 numbers it holds."""
    rng = np.random.default_rng(0)
    b, h, t = 3, 4, 48
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    dtype = jnp.dtype("float32" if cache == "float32" else "bfloat16")  # bits: bfloat16 kept as uint16
    k, v = (rng.standard_normal((b, h, t, d)).astype(dtype).astype(np.float32) for _ in range(2))
    mask = np.zeros((b, t), bool)
    mask[:, :n] = True
    mask[1, :4] = False  # a left-padded row
    mask[2, 3] = False  # a hole
    mask[0, n - 3:] = False  # a row whose entries end early (each row reads to its own last valid entry)
    k[:, :, n:], v[:, :, n:] = 1e30, np.nan  # past read_len: must never be read
    ref_scores = np.einsum("bhd,bhtd->bht", q, k[:, :, :n]).astype(np.float64)
    ref_scores[~np.broadcast_to(mask[:, None, :n], ref_scores.shape)] = -np.inf
    p = np.exp(ref_scores - ref_scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bht,bhtd->bhd", p, v[:, :, :n])
    k[0, :, n - 3:], v[0, :, n - 3:] = np.nan, np.nan  # past row 0's end: never read
    zeros = lambda q, k, v, m: jnp.zeros_like(q)  # noqa: E731  (the non-CPU fallback: must not be what runs)
    k, v = k.astype(dtype), v.astype(dtype)  # exact: they hold bfloat16 numbers
    if cache == "bits":
        k, v = k.view(np.uint16), v.view(np.uint16)
    got = jax.jit(lambda *a: attention.decode_attention(*a, jnp.int32(n), zeros))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("d", [16, 64])
def test_decode_attention_of_several_queries_a_cache_row_reads_that_row(d):
    """A speculative check's C queries of a row (q and mask [B * C, ...] over a [B, H, T, D] cache): each query
    gives what it gives as a decode step over its own copy of the row's cache, reading to its own last entry."""
    rng = np.random.default_rng(1)
    b, c, h, t = 2, 3, 4, 24
    q = rng.standard_normal((b * c, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(2))
    mask = np.zeros((b * c, t), bool)
    for i in range(b * c):
        mask[i, :10 + i % c + 2 * (i // c)] = True  # query j of row r reads 10 + 2 r + j entries (causal)
    k[:, :, 20:], v[:, :, 20:] = np.nan, np.nan  # past read_len: never read
    raising = lambda q, k, v, m: jnp.full_like(q, jnp.nan)  # noqa: E731  (the fallback: must not be what runs)
    got = jax.jit(lambda *a: attention.decode_attention(*a, jnp.int32(20), raising))(q, k, v, mask)
    each = jax.jit(lambda *a: attention.decode_attention(*a, jnp.int32(20), raising))(
        q, np.repeat(k, c, 0), np.repeat(v, c, 0), mask)
    assert np.array_equal(np.asarray(got), np.asarray(each))
    assert not np.isnan(np.asarray(got)).any()
    for r, j in [(0, 0), (1, 2)]:  # against numpy for two of them
        i, n = r * c + j, int(mask[r * c + j].sum())
        s_ = np.einsum("hd,htd->ht", q[i], k[r, :, :n]).astype(np.float64)
        p = np.exp(s_ - s_.max(-1, keepdims=True))
        ref = np.einsum("ht,htd->hd", p / p.sum(-1, keepdims=True), v[r, :, :n])
        np.testing.assert_allclose(np.asarray(got)[i], ref, rtol=1e-5, atol=1e-5)


def ragged_reference(q, k, v, rows, ends, pool_k, pool_v, ptab, plen):
    """The ragged step's attention in numpy (float64): query i over entries [0, ends[i]) of row rows[i], a row's
    first plen entries from its pool blocks."""
    out, bs = np.zeros(q.shape), pool_k.shape[2]
    for i, (r, e) in enumerate(zip(rows, ends)):
        if r >= k.shape[0] or e <= 0:
            continue
        keys, values = k[r, :, :e].astype(np.float64), v[r, :, :e].astype(np.float64)  # [H, e, D]
        for x in range(min(plen[r], e)):
            keys[:, x], values[:, x] = pool_k[:, ptab[r, x // bs], x % bs], pool_v[:, ptab[r, x // bs], x % bs]
        s = np.einsum("hd,hed->he", q[i], keys)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[i] = np.einsum("he,hed->hd", p / p.sum(-1, keepdims=True), values)
    return out


@needs_kernels
@pytest.mark.parametrize("cache", ["float32", "bits"])
@pytest.mark.parametrize("d", [8, 64, 128])
@pytest.mark.parametrize("code", ["native", "no_amx", "portable"])
def test_ragged_attention_reads_each_querys_own_row_up_to_its_end(d, cache, code):
    """Decode rows (one query each), a prompt's part continuing its row (queries reading one entry more each:
    causal), a part after a cached prefix read from the pool, and padding, against numpy; entries past each
    query's end and the row entries a pool prefix stands for are NaN (never read). head_dim 64 and 128 take the
    AVX-512 code where the CPU has it (a prompt's part over a bfloat16 cache: the AMX tiles where it has those, and
    with OPT_SERVING_NO_AMX in a child the AVX-512 ones), else (and with OPT_SERVING_NO_AVX512, in a child) the
    vector loops built for AVX2; other sizes the portable code."""
    if code != "native":
        if code == "no_amx" and not _lib.lib().opt_ragged_amx():
            pytest.skip("this CPU's ragged attention has no AMX tiles: native runs the AVX-512 ones")
        probe = ("import sys; sys.path.insert(0, 'tests'); import test_backend_cpu as t; "
                 f"t.test_ragged_attention_reads_each_querys_own_row_up_to_its_end({d}, {cache!r}, 'native')")
        run_child(probe, **({"OPT_SERVING_NO_AMX": "1"} if code == "no_amx" else {"OPT_SERVING_NO_AVX512": "1"}))
        return
    rng = np.random.default_rng(d)
    b, h, t, p, bs = 5, 3, 96, 10, 16
    dtype = jnp.dtype("float32" if cache == "float32" else "bfloat16")
    k, v = (rng.standard_normal((b, h, t, d)).astype(dtype).astype(np.float32) for _ in range(2))
    pk, pv = (rng.standard_normal((h, p, bs, d)).astype(dtype).astype(np.float32) for _ in range(2))
    ptab = rng.integers(0, p, (b, t // bs)).astype(np.int32)
    plen = np.array([0, 32, 0, 48, 16], np.int32)
    # decode rows 0-4, a part of row 2 at entries 10..49 (more than a tile of 32), one of row 3 after its
    # prefix (entries 48..60: 13 queries, the vector loops' last score pass of 4 reads 3 past them), padding
    rows = np.array([0, 1, 2, 3, 4] + [2] * 40 + [3] * 13 + [b, b], np.int32)
    ends = np.array([7, 40, 10, 48, 1] + list(range(11, 51)) + list(range(49, 62)) + [0, 0], np.int32)
    q = (0.3 * rng.standard_normal((len(rows), h, d))).astype(np.float32)
    want = ragged_reference(q, k, v, rows, ends, pk, pv, ptab, plen)
    longest = np.zeros(b, int)
    np.maximum.at(longest, rows[rows < b], ends[rows < b])
    for r in range(b):
        k[r, :, longest[r]:], v[r, :, longest[r]:] = np.nan, np.nan  # past the row's last query: never read
        k[r, :, :plen[r]], v[r, :, :plen[r]] = np.nan, np.nan  # read from the pool instead
    k, v, pk, pv = (a.astype(dtype) for a in (k, v, pk, pv))
    if cache == "bits":
        k, v, pk, pv = (a.view(np.uint16) for a in (k, v, pk, pv))
    got = jax.jit(attention.ragged_attention)(q, k, v, rows, ends, pk, pv, ptab, plen)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_ragged_attention_refuses_a_prefix_that_is_not_whole_blocks():
    q = np.zeros((1, 1, 8), np.float32)
    k = np.zeros((1, 1, 32, 8), np.float32)
    pool = np.zeros((1, 2, 16, 8), np.float32)
    with pytest.raises(Exception, match="whole pool blocks"):
        jax.jit(attention.ragged_attention)(q, k, k, np.zeros(1, np.int32), np.ones(1, np.int32), pool, pool,
                                            np.zeros((1, 2), np.int32), np.array([8], np.int32)).block_until_ready()


# ---- _lib.py ----

def run_child(probe: str, drop: tuple = (), **env) -> str:
    """The output of `probe` run in a fresh Python: this environment without `drop`, with `env`."""
    base = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run([sys.executable, "-c", probe], env={**base, **env}, check=True, capture_output=True,
                          text=True).stdout


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell 1 thread from all")
def test_kernels_use_every_cpu_whatever_omp_num_threads_says():
    # a Ray worker (a Serve replica) gets OMP_NUM_THREADS=1 from Ray; the kernels must still use every CPU,
    # as XLA's own pool does, unless OPT_SERVING_CPU_THREADS says otherwise
    probe = ("import jax; from opt_serving.backend import choose; from opt_serving.settings import Settings; "
             "from opt_serving.backend.cpu import _lib; s = Settings.from_env(); "
             "choose(jax.devices('cpu')[:1], 'float32', s); "
             "print(_lib.load().opt_cpu_kernels_team_size(), s.threads())")

    def team(**env):
        out = run_child(probe, **env).split()
        return int(out[0]), int(out[1])
    cpus = len(os.sched_getaffinity(0))
    assert team(OMP_NUM_THREADS="1") == (cpus, cpus)
    assert team(OMP_NUM_THREADS="1", OPT_SERVING_CPU_THREADS="1") == (1, 1)
    assert Settings(cpu_threads=3).threads() == 3


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for a team to pin")
def test_the_kernel_team_holds_a_cpu_each_and_nothing_else_is_pinned():
    # left to the scheduler, the kernel thread and its worker sometimes shared one CPU and took turns in
    # time slices; the team is pinned (the i-th thread to the i-th CPU the process may use), the process's
    # other threads are not, and OPT_SERVING_PIN_THREADS=0 pins nothing
    probe = """
import json, os, jax
from opt_serving.backend import choose
from opt_serving.settings import Settings
from opt_serving.backend.cpu import _lib
choose(jax.devices('cpu')[:1], 'float32', Settings.from_env())
team = _lib.load().opt_cpu_kernels_team_size()
sets = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')]
print(json.dumps([team, sorted(os.sched_getaffinity(0)), sorted(s[0] for s in sets if len(s) == 1)]))
"""

    def run(**env):
        return json.loads(run_child(probe, **env))
    team, allowed, pinned = run()
    assert team == len(allowed) and pinned == allowed  # one thread on each CPU
    team, allowed, pinned = run(OPT_SERVING_PIN_THREADS="0")
    assert team == len(allowed) and pinned == []
    team, allowed, pinned = run(OPT_SERVING_CPU_THREADS="1")
    assert team == 1 and pinned == []  # one thread: the scheduler places it


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for a team of workers")
def test_kernels_called_from_many_threads_share_one_team():
    # XLA calls custom calls from whichever of its pool threads is free. When each such thread started its
    # own parallel regions, libgomp grew a team per thread (more threads than cores: it put every worker to
    # sleep between calls). Every kernel runs on the kernel thread instead: callers on eight threads add that
    # thread and its team's workers, and no more.
    probe = """
import os, threading
from opt_serving.backend.cpu import _lib
lib = _lib.load()
before = len(os.listdir('/proc/self/task'))
sizes, ready, hold = [], threading.Barrier(9), threading.Event()
def call():
    sizes.append(lib.opt_cpu_kernels_team_size())
    ready.wait()
    hold.wait()
callers = [threading.Thread(target=call) for _ in range(8)]
for t in callers:
    t.start()
ready.wait()
print(len(os.listdir('/proc/self/task')) - before - len(callers), min(sizes), max(sizes))
hold.set()
"""
    out = run_child(probe).split()
    added, smallest, largest = map(int, out)
    team = Settings.from_env().threads()
    assert smallest == largest == team
    assert added == team  # the kernel thread and its team's team - 1 workers


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="glibc's malloc only")
def test_keep_heap_lets_a_step_reuse_its_scratch_block_without_faulting_it_in_again():
    # XLA allocates a call's temporaries as one block and frees it when the call ends; at 32 slots the token
    # choice's block is larger than glibc keeps in its heap, so every decode step mapped it afresh and faulted
    # its pages in again. keep_heap keeps such a block in the heap: a second round faults nothing in
    probe = """
import ctypes, json, resource
from opt_serving.backend.cpu import heap

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
kept = heap.keep_heap()
faults = []
for _ in range(3):  # a step: its scratch block allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(48 << 20)
    ctypes.memset(p, 1, 48 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([kept, faults]))
"""

    def run(**env):
        own = ("OPT_SERVING_KEEP_HEAP", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
        return json.loads(run_child(probe, drop=own, **env))
    kept, faults = run()
    assert kept and max(faults[1:]) < 16  # the block stays in the heap: written again, nothing faults in
    kept, faults = run(OPT_SERVING_KEEP_HEAP="0")
    assert not kept and min(faults) > 16  # glibc's own rule: mapped afresh each time (24 with 2 MB pages)
    kept, faults = run(MALLOC_TRIM_THRESHOLD_="131072")  # the user's own setting is left alone
    assert not kept and min(faults) > 16

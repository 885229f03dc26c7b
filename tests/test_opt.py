"""Flax OPT vs Hugging Face: prefill and every cached decode step, pre-LN and 350m-style."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from opt_serving.backend import Backend
from opt_serving.model import attends, kv_cache, layout, opt, param_tree, steps, weights, wrapper
from opt_serving.runner.generate import Generation

from conftest import TINY as PRE_LN, TINY_POST_LN as POST_LN, hf_model, on_cpu


def left_padded(rng, lengths, width, vocab, pad=1):
    ids = np.full((len(lengths), width), pad, np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.randint(3, vocab, n)
        mask[i, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("fused", [False, True, "packed"], ids=["qkv_split", "qkv_fused", "packed"])
@pytest.mark.parametrize("cfg", [PRE_LN, POST_LN], ids=["pre_ln", "post_ln_350m"])
def test_prefill_and_decode_match_hf(cfg, fused):
    hf = hf_model(cfg)
    params = weights.params_from_hf_state_dict(cfg, hf.state_dict())
    backend = Backend.xla()
    if fused == "packed":  # what runs on a CPU: fused, and every dense weight packed for oneDNN
        backend, params = layout.runtime_params(on_cpu(params))
        if not backend.products:
            pytest.skip("opt_serving/_cpu_kernels.so not built")
        assert "packed" in params["layers_1"]["fc2"]
    elif fused:  # the single-device layout generate() and the engine run: one [D, 3D] q/k/v matmul
        split = params
        params = layout.fuse_qkv(params)
        back = layout.unfuse_qkv(params)  # what OPTModel.params shows: the checkpoint's layout again
        assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(split)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(back),
                                                         jax.tree_util.tree_leaves(split)))
        attn = params["layers_1"]["self_attn"]
        assert sorted(attn) == ["out_proj", "qkv_proj"] and attn["qkv_proj"]["kernel"].shape == (32, 96)
        assert layout.fuse_qkv(params) == params  # already fused: unchanged
    rng = np.random.RandomState(0)
    ids, mask = left_padded(rng, [8, 5, 2], 8, cfg.vocab_size)
    decodes = 5
    cache = kv_cache.init_cache(cfg, 3, 16)
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(ids), jnp.asarray(mask), backend=backend)
    with torch.no_grad():
        out = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask), use_cache=True)
    real = mask == 1
    np.testing.assert_allclose(np.asarray(logits)[real], out.logits.numpy()[real], atol=1e-4)
    past, hf_mask = out.past_key_values, torch.tensor(mask)
    n_real = mask.sum(1)
    for t in range(decodes):
        tok = rng.randint(3, cfg.vocab_size, 3).astype(np.int32)
        logits, cache = steps.decode(cfg, params, cache, jnp.asarray(tok),
                                     jnp.asarray(n_real + t, jnp.int32), jnp.full((3,), 8 + t, jnp.int32),
                                     backend=backend)
        hf_mask = torch.cat([hf_mask, torch.ones((3, 1), dtype=hf_mask.dtype)], 1)
        with torch.no_grad():
            out = hf(torch.tensor(tok[:, None], dtype=torch.long), attention_mask=hf_mask,
                     past_key_values=past, use_cache=True)
        past = out.past_key_values
        np.testing.assert_allclose(np.asarray(logits), out.logits[:, -1].numpy(), atol=1e-4)


def test_cached_decoding_equals_full_forward():
    cfg = PRE_LN
    params = param_tree.init_params(cfg, seed=1)
    rng = np.random.RandomState(1)
    seq = rng.randint(3, cfg.vocab_size, (2, 12)).astype(np.int32)
    full = np.asarray(steps.forward(cfg, params, seq))
    cache = kv_cache.init_cache(cfg, 2, 16)
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(seq[:, :4]), jnp.ones((2, 4), jnp.int32),
                                  all_logits=False)
    np.testing.assert_allclose(np.asarray(logits), full[:, 3], atol=1e-5)
    for t in range(4, 12):
        pos = jnp.full((2,), t, jnp.int32)
        logits, cache = steps.decode(cfg, params, cache, jnp.asarray(seq[:, t]), pos, pos)
        np.testing.assert_allclose(np.asarray(logits), full[:, t], atol=1e-5)


def test_a_long_prompts_attention_by_query_blocks_equals_the_whole():
    """Past PREFILL_BLOCKED_FROM tokens the queries go in blocks, each over the keys before its end (the last
    block shorter here); every real token's output is that of the whole masked S x S attention."""
    s = attends.PREFILL_BLOCKED_FROM + 37
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, s, 3, 8)).astype(np.float32) for _ in range(3))
    mask = np.ones((2, s), np.int32)
    mask[1, :5] = 0  # a left-padded row
    got = np.asarray(jax.jit(attends.causal_attention)(q, k, v, mask))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k).astype(np.float64)
    allowed = np.tril(np.ones((s, s), bool))[None, None] & mask[:, None, None, :].astype(bool)
    scores = np.where(allowed, scores, -np.inf)
    with np.errstate(invalid="ignore"):  # a pad query attends to nothing: NaN here, and never compared
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], rtol=2e-5, atol=2e-5)
    assert s > attends.PREFILL_QUERY_BLOCK * 4  # more than one block ran


def test_rows_decode_at_their_own_cache_index():
    """Two rows at different lengths in one decode batch each match their own single-row run."""
    cfg = PRE_LN
    params = param_tree.init_params(cfg, seed=2)
    rng = np.random.RandomState(2)
    a = rng.randint(3, cfg.vocab_size, 9).astype(np.int32)
    b = rng.randint(3, cfg.vocab_size, 5).astype(np.int32)
    full_a = np.asarray(steps.forward(cfg, params, a[None]))[0]
    full_b = np.asarray(steps.forward(cfg, params, b[None]))[0]
    # row 0 holds a[:8] at entries 0..7, row 1 holds b[:4] at entries 0..3 (right-aligned storage)
    cache = kv_cache.init_cache(cfg, 2, 16)
    ids = np.ones((2, 8), np.int32)
    mask = np.zeros((2, 8), np.int32)
    ids[0], mask[0] = a[:8], 1
    ids[1, :4], mask[1, :4] = b[:4], 1
    _, cache = steps.prefill(cfg, params, cache, jnp.asarray(ids), jnp.asarray(mask))
    # entries of row 1's positions 4..7 hold pads marked invalid; it writes its next token at entry 4
    logits, cache = steps.decode(cfg, params, cache, jnp.asarray([a[8], b[4]]),
                                 jnp.asarray([8, 4], jnp.int32), jnp.asarray([8, 4], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits)[0], full_a[8], atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits)[1], full_b[4], atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_float32(dtype):
    cfg = PRE_LN
    hf = hf_model(cfg)
    with torch.no_grad():  # peaked distributions, as a trained model has, so argmax is meaningful
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    p32 = weights.params_from_hf_state_dict(cfg, hf.state_dict())
    p16 = weights.params_from_hf_state_dict(cfg, hf.state_dict(), dtype=dtype)
    assert opt.param_dtype(p16) == jnp.dtype(dtype)
    seq = np.random.RandomState(3).randint(3, cfg.vocab_size, (8, 32)).astype(np.int32)
    l32 = np.asarray(steps.forward(cfg, p32, seq))
    l16 = np.asarray(steps.forward(cfg, p16, seq))
    assert l16.dtype == np.float32  # logits always come back in float32
    diff = np.abs(l32 - l16).max()
    agree = (l32.argmax(-1) == l16.argmax(-1)).mean()
    # free-running greedy decoding: the share of generated tokens that agree
    m32, m16 = (Generation.of(wrapper.OPTModel(cfg, p)) for p in (p32, p16))
    g32 = m32.generate(seq[:4, :8], max_new_tokens=16, eos_token_id=None)[:, 8:]
    g16 = m16.generate(seq[:4, :8], max_new_tokens=16, eos_token_id=None)[:, 8:]
    gen_agree = (g32 == g16).mean()
    print(f"{dtype} vs float32: max logit diff {diff:.4f} (logits span {l32.min():.2f}..{l32.max():.2f}), "
          f"teacher-forced argmax agreement {agree:.3f} over {l32[..., 0].size} positions, "
          f"greedy generation agreement {gen_agree:.3f} over {g32.size} tokens")
    assert diff < 0.05 * (l32.max() - l32.min())
    assert agree >= 0.9 and gen_agree >= 0.75


@pytest.mark.parametrize("per_row", [False, True], ids=["start_scalar", "start_per_row"])
@pytest.mark.parametrize("cfg", [PRE_LN, POST_LN], ids=["pre_ln", "post_ln_350m"])
def test_a_prefill_in_chunks_gives_the_whole_prefill(cfg, per_row):
    """Chunks of 8 over a 21-token prompt (the last one padded, and with a cache of 22 entries running
    past it): the last position's logits, every stage's hidden states and the cache's valid entries are
    the whole prefill's; two stages chained chunk by chunk give the same."""
    params = weights.params_from_hf_state_dict(cfg, hf_model(cfg).state_dict())
    n, c, size = 21, 8, 22 if per_row else 32
    ids = np.random.RandomState(4).randint(3, cfg.vocab_size, n).astype(np.int32)
    whole_ids, whole_mask = np.ones((1, size), np.int32), (np.arange(size) < n).astype(np.int32)[None]
    whole_ids[0, :n] = ids
    want, want_cache = steps.prefill_step(cfg, params, kv_cache.init_cache(cfg, 1, size), whole_ids, whole_mask)
    specs = [opt.StageSpec(0, 1, True, False), opt.StageSpec(1, 2, False, True)]
    parts = [param_tree.stage_params(params, s) for s in specs]
    cache = kv_cache.init_cache(cfg, 1, size)
    staged = [kv_cache.init_cache(cfg.replace(num_hidden_layers=1), 1, size) for _ in specs]
    for start in range(0, n, c):
        x, mask = np.ones((1, c), np.int32), (np.arange(c) < n - start).astype(np.int32)[None]
        x[0, :mask.sum()] = ids[start:start + c]
        at = np.array([start], np.int32) if per_row else np.int32(start)
        logits, cache = steps.extend_step(cfg, params, cache, x, at, mask)
        h = x
        for i, (s, p) in enumerate(zip(specs, parts)):
            h, staged[i] = steps.extend_step(cfg, p, staged[i], h, at, mask, stage=s)
    last = (n - 1) % c
    np.testing.assert_allclose(np.asarray(logits[0, last]), np.asarray(want[0, n - 1]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(h[0, last]), np.asarray(want[0, n - 1]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache["mask"]), np.asarray(want_cache["mask"]))
    np.testing.assert_array_equal(np.asarray(staged[1]["mask"]), np.asarray(want_cache["mask"]))
    got_k = list(cache["k"]) + list(cache["v"])
    staged_k = [staged[0]["k"][0], staged[1]["k"][0], staged[0]["v"][0], staged[1]["v"][0]]
    for a, b, s in zip(got_k, list(want_cache["k"]) + list(want_cache["v"]), staged_k):
        np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b)[:, :, :n], atol=1e-5)
        np.testing.assert_allclose(np.asarray(s)[:, :, :n], np.asarray(b)[:, :, :n], atol=1e-5)


@pytest.mark.parametrize("cfg", [PRE_LN, POST_LN], ids=["pre_ln", "post_ln_350m"])
def test_a_ragged_step_keeping_some_tokens_gives_their_hidden_states_and_the_same_cache(cfg):
    # three prompts of 5, 7 and 3 tokens in one ragged step, one padding token; kept: each prompt's last token
    backend, params = layout.runtime_params(param_tree.init_params(cfg, seed=1))
    assert backend.ragged
    lengths = (5, 7, 3)
    rows = np.concatenate([np.full(n, r, np.int32) for r, n in enumerate(lengths)] + [np.array([3], np.int32)])
    entries = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths] + [np.array([0], np.int32)])
    ids = np.random.RandomState(0).randint(3, cfg.vocab_size, rows.shape[0]).astype(np.int32)
    empty = np.zeros(0, np.int32)
    pool = kv_cache.init_pool(cfg, 0, 16)  # no cached prefix
    prefix = (pool["k"], pool["v"], np.zeros((3, 2), np.int32), np.zeros(3, np.int32))
    run = jax.jit(steps.ragged_step, static_argnums=(0,), static_argnames=("backend",))
    new_cache = lambda: kv_cache.init_cache(cfg, 3, 32, kv_cache.cache_dtype(params, backend))  # noqa: E731
    whole, whole_cache = run(cfg, params, new_cache(), empty, empty, empty, (ids, rows, entries), prefix,
                             backend=backend)
    keep = np.array([4, 11, 14, 4], np.int32)  # (a row without a token of its own takes another's)
    kept, kept_cache = run(cfg, params, new_cache(), empty, empty, empty, (ids, rows, entries), prefix,
                           backend=backend, keep=keep)
    assert kept.shape == (4, cfg.word_embed_proj_dim)
    np.testing.assert_allclose(np.asarray(kept), np.asarray(whole)[keep], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(kept_cache), jax.tree_util.tree_leaves(whole_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

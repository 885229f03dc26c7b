"""The KV cache: bucketed lengths, inserting a prefilled prompt into an engine slot, freeing it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opt_serving.model import kv_cache, param_tree, steps

from conftest import TINY

CFG = TINY


def test_init_cache_layout():
    c = kv_cache.init_cache(CFG, batch=3, max_len=16, dtype=jnp.bfloat16)
    assert len(c["k"]) == len(c["v"]) == CFG.num_hidden_layers
    assert c["k"][0].shape == (3, CFG.num_attention_heads, 16, CFG.head_dim)
    assert c["k"][0].dtype == jnp.bfloat16
    assert c["mask"].shape == (3, 16) and not bool(c["mask"].any())


def test_bucket_length():
    assert [kv_cache.bucket_length(n, 64) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert kv_cache.bucket_length(40, 48) == 48  # capped at the model's positions
    with pytest.raises(ValueError, match="exceeds the limit of 64"):
        kv_cache.bucket_length(65, 64)


def _prefilled(params, tokens, bucket):
    """Batch-1 prefill of `tokens`, left-padded to `bucket`."""
    ids = np.ones((1, bucket), np.int32)
    mask = np.zeros((1, bucket), np.int32)
    ids[0, bucket - len(tokens):], mask[0, bucket - len(tokens):] = tokens, 1
    cache = kv_cache.init_cache(CFG, 1, bucket)
    logits, cache = steps.prefill(CFG, params, cache, jnp.asarray(ids), jnp.asarray(mask),
                                  all_logits=False)
    return logits[0], cache


def test_insert_into_slot_then_decode_matches_full_forward():
    params = param_tree.init_params(CFG, seed=0)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, CFG.vocab_size, n).astype(np.int32) for n in (5, 11, 3)]
    nxt = rng.randint(3, CFG.vocab_size, 3).astype(np.int32)
    decode_cache = kv_cache.init_cache(CFG, 3, 32)
    # fill slot 1 with an unrelated longer request first: insert must wipe its entries
    _, other = _prefilled(params, rng.randint(3, CFG.vocab_size, 30).astype(np.int32), 32)
    decode_cache = kv_cache.insert(decode_cache, other, jnp.int32(1))
    # reference: one left-padded forward over prompt + next token (checked against HF in test_opt)
    ref_ids = np.ones((3, 12), np.int32)
    ref_mask = np.zeros((3, 12), np.int32)
    for i, p in enumerate(prompts):
        ref_ids[i, 11 - len(p):] = np.concatenate([p, nxt[i:i + 1]])
        ref_mask[i, 11 - len(p):] = 1
    ref = np.asarray(steps.forward(CFG, params, ref_ids, ref_mask))
    buckets = [kv_cache.bucket_length(len(p), CFG.max_position_embeddings) for p in prompts]
    for slot, (p, bucket) in enumerate(zip(prompts, buckets)):
        first, pc = _prefilled(params, p, bucket)
        np.testing.assert_allclose(np.asarray(first), ref[slot, -2], atol=1e-5)
        decode_cache = kv_cache.insert(decode_cache, pc, jnp.int32(slot))
    # every slot writes at its own entry (its bucket), at its own position (its prompt length)
    logits, decode_cache = steps.decode(CFG, params, decode_cache, jnp.asarray(nxt),
                                        jnp.asarray([len(p) for p in prompts], jnp.int32),
                                        jnp.asarray(buckets, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), ref[:, -1], atol=1e-5)
    # slot is traced: four inserts into three slots compiled once per prefill bucket (32, 16)
    assert kv_cache.insert._cache_size() == 2
    freed = kv_cache.free_slot(decode_cache, 1)
    assert not bool(freed["mask"][1].any()) and bool(freed["mask"][0].any())


def test_insert_rejects_wrong_shapes():
    big = kv_cache.init_cache(CFG, 1, 64)
    small = kv_cache.init_cache(CFG, 2, 32)
    with pytest.raises(ValueError, match="prefill cache holds 64 entries"):
        kv_cache.insert(small, big, 0)
    with pytest.raises(ValueError, match="batch-1"):
        kv_cache.insert(kv_cache.init_cache(CFG, 2, 64), small, 0)


def test_resize_keeps_entries_and_adds_invalid_ones():
    rng = np.random.RandomState(3)
    cache = kv_cache.init_cache(CFG, 2, 16)
    filled = {"k": tuple(jnp.asarray(rng.randn(*a.shape), jnp.float32) for a in cache["k"]),
              "v": tuple(jnp.asarray(rng.randn(*a.shape), jnp.float32) for a in cache["v"]),
              "mask": jnp.asarray(rng.rand(2, 16) < 0.5)}
    grown = kv_cache.resize(filled, 32)
    assert kv_cache.cache_max_len(grown) == 32
    assert not np.asarray(grown["mask"])[:, 16:].any()  # the new entries are invalid
    back = kv_cache.resize(grown, 16)
    for name in ("k", "v"):
        for a, b in zip(filled[name], back[name]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(filled["mask"]), np.asarray(back["mask"]))


@pytest.mark.parametrize("row", [0, 2])
def test_store_blocks_writes_a_rows_kept_blocks_into_their_pool_blocks_and_nothing_else(row):
    # TINY's heads and head size; a cache of 3 rows x 64 entries, a pool of 6 blocks of 16
    h, d, bs = TINY.num_attention_heads, TINY.head_dim, 16
    pool = kv_cache.init_pool(TINY, 6, bs)
    rng = np.random.default_rng(row)
    ks = [rng.normal(size=(3, h, 64, d)).astype(np.float32) for _ in range(TINY.num_hidden_layers)]
    vs = [rng.normal(size=(3, h, 64, d)).astype(np.float32) for _ in range(TINY.num_hidden_layers)]
    cache = {"k": tuple(map(jnp.asarray, ks)), "v": tuple(map(jnp.asarray, vs)), "mask": jnp.ones((3, 64), bool)}
    ids = np.array([4, 6, 1, -1], np.int32)  # block 0 -> 4, block 1 past the pool, block 2 -> 1, block 3 kept out
    out = jax.jit(kv_cache.store_blocks)(pool, cache, ids, np.int32(row))
    for layer in range(TINY.num_hidden_layers):
        for got, src in ((out["k"][layer], ks[layer]), (out["v"][layer], vs[layer])):
            want = np.zeros((h, 6, bs, d), np.float32)
            want[:, 4] = src[row, :, 0:16]
            want[:, 1] = src[row, :, 32:48]
            np.testing.assert_array_equal(np.asarray(got), want)

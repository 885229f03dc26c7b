"""Prefix caching: the index of cached blocks (runner/prefix.py) and the slot model's use of it (runner/slots.py,
runner/stage.py): a prompt that starts as an earlier one did computes only the rest, with the outputs it gets
without the cache, across evictions, on one device, over pipeline stages and in every cache format."""
import threading

import numpy as np
import pytest

from opt_serving.config import OPTConfig
from opt_serving.engine.scheduler import Engine, OPTSlots, SlotSettings
from opt_serving.runner.prefix import BLOCK_SIZE, PrefixCache

from conftest import hf_model, xla_compiles

# vocabulary 128 and positions 128: prompts of several blocks with shared prefixes
CFG = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                max_position_embeddings=128)
MAX_SEQ = 96


# ---- the index ----
def test_a_blocks_key_names_every_token_before_its_end():
    pc = PrefixCache(8)
    a = list(range(40))
    b = a[:16] + [99] + a[17:]
    keys_a, keys_b = pc.keys(a), pc.keys(b)
    assert len(keys_a) == 40 // BLOCK_SIZE  # full blocks only
    assert keys_a[0] == keys_b[0] and keys_a[1] != keys_b[1]
    # the same sixteen tokens after another first block are another block
    assert pc.keys([7] * 16 + a[16:32])[1] != keys_a[1]


def test_match_gives_the_longest_held_run_and_claim_what_is_missing():
    pc = PrefixCache(8)
    keys = pc.keys(range(64))  # four blocks
    assert pc.match(keys) == []
    first = pc.claim(keys[:2])
    assert [j for j, _ in first] == [0, 1] and len({b for _, b in first}) == 2
    assert pc.match(keys) == [b for _, b in first]
    assert pc.match(pc.keys([5] + list(range(1, 64)))) == []  # another first token: another prefix
    rest = pc.claim(keys)
    assert [j for j, _ in rest] == [2, 3]
    assert pc.match(keys) == [b for _, b in first + rest] and len(pc) == 4


def test_the_least_recently_used_prompt_goes_first_and_its_later_blocks_before_its_first():
    pc = PrefixCache(4)
    a, b = pc.keys([1] * 32), pc.keys([2] * 32)
    pc.claim(a)
    pc.claim(b)
    pc.match(a)  # a used last: b is the least recently used
    held = lambda keys: len(pc.match(keys, touch=False))  # noqa: E731
    pc.claim(pc.keys([3] * 16))  # one block wanted: b's second goes
    assert pc.evictions == 1 and held(b) == 1 and held(a) == 2
    pc.claim(pc.keys([4] * 16))  # then b's first
    assert (pc.evictions, held(b), held(a)) == (2, 0, 2)


def test_a_prompt_longer_than_the_pool_keeps_its_first_blocks():
    pc = PrefixCache(3)
    keys = pc.keys(range(80))  # five blocks
    claims = pc.claim(keys)
    assert [j for j, _ in claims] == [0, 1, 2]
    assert pc.match(keys) == [b for _, b in claims]


def test_scored_matches_stop_at_the_first_block_without_scores_and_forgotten_blocks_are_free():
    pc = PrefixCache(4)
    keys = pc.keys(range(48))
    blocks = [b for _, b in pc.claim(keys)]
    pc.set_scores(blocks[0], ("scores",))
    assert pc.match(keys, scored=True) == blocks[:1] and pc.match(keys) == blocks
    pc.forget(blocks[1:])
    assert pc.match(keys) == blocks[:1] and len(pc) == 1
    assert len(pc.claim(pc.keys([5] * 48))) == 3  # the forgotten blocks (and the free one) are handed out again


def test_blocks_rows_read_in_place_are_never_evicted_until_released():
    pc = PrefixCache(2)
    a = pc.keys([1] * 32)
    blocks = [b for _, b in pc.claim(a)]
    pc.hold(blocks)
    pc.hold(blocks[:1])  # two rows read the first
    assert pc.claim(pc.keys([2] * 16)) == [] and pc.evictions == 0  # nothing to take
    pc.release(blocks)
    assert [b for _, b in pc.claim(pc.keys([3] * 16))] == blocks[1:]  # the second is free to go, the first held
    pc.release(blocks[:1])
    assert [b for _, b in pc.claim(pc.keys([4] * 16))] == blocks[:1]


# ---- the slot model ----
@pytest.fixture(scope="module")
def hf():
    import torch
    import transformers
    torch.manual_seed(0)
    # a wide init so the argmax is decisive (no near-ties for float noise to flip)
    return transformers.OPTForCausalLM(transformers.OPTConfig(**{**CFG.to_hf_dict(), "init_std": 0.3})).eval()


@pytest.fixture(scope="module")
def params(hf):
    from opt_serving.model import weights
    return weights.params_from_hf_state_dict(CFG, hf.state_dict())


@pytest.fixture(scope="module")
def plain(params):
    """num_slots -> the slot model without a prefix cache that outputs are checked against, one of each size for
    the module's tests: their runs reuse its compiled steps (each run frees every slot, and no cache is kept)."""
    made = {}

    def get(num_slots):
        if num_slots not in made:
            made[num_slots] = OPTSlots(CFG, params, num_slots=num_slots, max_seq_len=MAX_SEQ)
        return made[num_slots]
    return get


class Collect:
    def __init__(self):
        self.tokens, self.prompt, self.finish, self.cached = [], None, None, None
        self.done = threading.Event()

    def __call__(self, out):
        if out.cached_tokens is not None:
            self.cached = out.cached_tokens
        if out.is_prompt:
            self.prompt = out.tokens
        else:
            self.tokens += out.tokens
        if out.finish_reason is not None:
            self.finish = out.finish_reason
            self.done.set()

    @property
    def ids(self):
        return [t.id for t in self.tokens]


def one_by_one(model, jobs, chunk):
    """Each job after the one before has finished (so it finds its blocks); `chunk`: the engine's prefill_chunk."""
    e = Engine(model, prefill_chunk=chunk)
    try:
        cols = []
        for prompt, settings in jobs:
            c = Collect()
            e.submit(prompt, settings, c)
            assert c.done.wait(120), "request did not finish"
            cols.append(c)
    finally:
        e.close()
    return cols


def shared_prefix_jobs(seed=0, n=8):
    """Prompts over a few shared prefixes (greedy, sampled, penalised, scored for echo), each prefix coming back
    after the others may have pushed it out of a small cache."""
    rng = np.random.default_rng(seed)
    bases = [[2] + rng.integers(4, 128, 70).tolist() for _ in range(3)]
    jobs = []
    for i in range(n):
        base = bases[i % 3]
        tail = rng.integers(4, 128, int(rng.integers(1, 12))).tolist()
        jobs += [(base[:33 + 5 * i] + tail, SlotSettings(max_tokens=5)),
                 (base[:50] + tail, SlotSettings(max_tokens=4, temperature=1.3, top_p=0.9, seed=i)),
                 (base[:49] + tail, SlotSettings(max_tokens=3, repetition_penalty=1.3)),
                 (base[:47] + tail, SlotSettings(max_tokens=2, prompt_logprobs=True))]
    return jobs


def assert_same_outputs(got, want, jobs, hf=None, tolerance=1e-4):
    from test_engine import hf_greedy
    for (prompt, s), a, b in zip(jobs, got, want):
        assert (a.ids, a.finish) == (b.ids, b.finish)
        assert [t.logprob for t in a.tokens] == pytest.approx([t.logprob for t in b.tokens], abs=tolerance)
        if s.prompt_logprobs:
            assert [t.id for t in a.prompt] == [t.id for t in b.prompt] == prompt
            assert [t.logprob for t in a.prompt] == pytest.approx([t.logprob for t in b.prompt], abs=tolerance)
            tops = [[[i for i, _ in t.top] for t in c.prompt[1:]] for c in (a, b)]
            if tolerance > 1e-4:  # (near-tied alternatives may swap places)
                tops = [[sorted(t[:5]) for t in top] for top in tops]
            assert tops[0] == tops[1]
        if hf is not None and s.temperature == 0 and s.repetition_penalty == 1.0:
            assert a.ids == hf_greedy(hf, prompt, s.max_tokens)


@pytest.mark.parametrize("chunk", [None, 16])
def test_outputs_with_the_prefix_cache_equal_those_without_it_across_evictions(params, hf, plain, chunk):
    """Greedy tokens (Hugging Face's), seeded samples, a penalty, the tokens' logprobs and echo's prompt scores
    are those without the cache, whether the rest of a prompt is prefilled in the engine's chunks (16) or
    whole (None: the slot model's own chunks); a cache of six blocks evicts and prefixes come back."""
    jobs = shared_prefix_jobs()
    without = one_by_one(plain(3), jobs, chunk)
    model = OPTSlots(CFG, params, num_slots=3, max_seq_len=MAX_SEQ, prefix_blocks=6)
    model.warmup(prefill_chunk=chunk)
    got = one_by_one(model, jobs, chunk)
    assert_same_outputs(got, without, jobs, hf)
    assert all(c.cached == 0 for c in without)
    cached = [c.cached for c in got]
    assert model.prefix.evictions > 0
    # after its prefix was evicted a prompt computes it again and the next one with it hits again
    assert cached[:4] == [0, 32, 48, 0]  # the first is a miss; the scored one finds no scores kept yet
    assert sum(cached) > sum(len(p) for p, _ in jobs) // 3


def test_a_prompt_computes_at_least_its_last_token_and_a_scored_one_its_last_cached_token_too(params):
    """A prompt of exactly three blocks sent again reuses two (its last token is computed: it gives the first
    token); with its scores asked, 31 (the last cached token is computed again to score the next one)."""
    prompt = [2] + list(range(10, 57))  # 48 tokens
    model = OPTSlots(CFG, params, num_slots=2, max_seq_len=MAX_SEQ, prefix_blocks=8)
    model.warmup()
    jobs = [(prompt, SlotSettings(max_tokens=3)), (prompt, SlotSettings(max_tokens=3)),
            (prompt, SlotSettings(max_tokens=2, prompt_logprobs=True)),
            (prompt + [50], SlotSettings(max_tokens=2, prompt_logprobs=True))]
    got = one_by_one(model, jobs, None)
    assert [c.cached for c in got] == [0, 32, 0, 47]
    assert got[1].ids == got[0].ids and model.prompt_cost(prompt, SlotSettings()) == 16


def test_a_burst_sharing_a_prefix_computes_it_once_and_reads_it_in_place(params, hf, plain):
    """Eight prompts sharing a 50-token prefix, queued at once on ragged stages: the first computes it, the others
    wait for its blocks (not computing them again) and read them from the pool in place, never copied into their
    rows; every output is what the engine gives without the cache (and HF's greedy)."""
    rng = np.random.default_rng(5)
    base = [2] + rng.integers(4, 128, 49).tolist()
    jobs = [(base + rng.integers(4, 128, 6).tolist(), SlotSettings(max_tokens=4)) for _ in range(8)]

    def burst(model):
        e = Engine(model, prefill_chunk=16)
        try:
            cols = [Collect() for _ in jobs]
            for (p, s), c in zip(jobs, cols):
                e.submit(p, s, c)
            assert all(c.done.wait(120) for c in cols)
            return cols, e.stats()
        finally:
            e.close()
    without, _ = burst(plain(4))
    model = OPTSlots(CFG, params, num_slots=4, max_seq_len=MAX_SEQ, prefix_blocks=12)
    assert model.ragged
    got, stats = burst(model)
    assert_same_outputs(got, without, jobs, hf)
    assert sorted(c.cached for c in got) == [0] + [48] * 7  # three whole blocks; the 49th token on is computed
    assert stats.joined_tokens == sum(len(p) for p, _ in jobs) - 7 * 48 and stats.cached_tokens == 7 * 48
    stage = model.stages.stages[0]
    assert not model.joins.waiting(0) and not model._promised and not stage.plen[0].any()  # all let go


def test_warm_up_compiles_every_shape_a_cached_prefix_runs(params):
    """After warm-up, prompts that hit, miss, evict and are scored, prefilled whole and in chunks, compile
    nothing (XLA's backend compiles are counted)."""
    with xla_compiles() as compiles:
        for chunk in (16, None):  # (the chunk sets which steps run: a model is warmed up for its engine's)
            compiles.clear()
            model = OPTSlots(CFG, params, num_slots=3, max_seq_len=MAX_SEQ, prefix_blocks=6)
            e = Engine(model, start=False, prefill_chunk=chunk)
            e.warmup()
            warm = len(compiles)
            jobs = shared_prefix_jobs(seed=1, n=6) + [([2] + list(range(4, 90)), SlotSettings(max_tokens=3))]
            one_by_one(model, jobs, chunk)
            assert model.prefix.evictions > 0 and warm > 0
            assert len(compiles) == warm, chunk


def test_pipeline_stages_keep_their_own_layers_blocks(params, plain):
    """Two stages (layers 0 and 1, in this process) each keep their layers' KV in their own pool under the
    same block numbers: the one-device tokens without a cache, prefixes reused."""
    from opt_serving.model import param_tree
    from opt_serving.parallel.stage_weights import stage_specs
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.stage import LocalStages, StageSlots
    jobs = shared_prefix_jobs(seed=2, n=4)
    want = one_by_one(plain(4), jobs, 16)
    stages = [StageSlots(CFG, param_tree.stage_params(params, s), s, 2, 2, MAX_SEQ, prefix_blocks=8)
              for s in stage_specs(CFG, 2)]
    piped = Slots(CFG, LocalStages(stages), 4, 2, MAX_SEQ, prefix_blocks=8)
    piped.warmup(prefill_chunk=16)
    got = one_by_one(piped, jobs, 16)
    assert_same_outputs(got, want, jobs)
    assert sum(c.cached for c in got) > 0
    assert all(not s.pending for s in stages)


@pytest.mark.parametrize("fmt", [{"quantize": "int8"}, {"dtype": "bfloat16"}, {}])
def test_every_weight_format_keeps_its_cache_dtype_in_the_pool(fmt):
    """int8, bfloat16 and float32 weights (the embedded model; int8 and bfloat16 keep a bfloat16 cache as its
    bits where the CPU kernels run): the pool holds the cache's dtype and outputs equal those without it."""
    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.model import kv_cache
    from opt_serving.runner.load import load_slots
    from opt_serving.spec import ModelSpec
    path = ensure_embedded_model()
    spec = ModelSpec.parse("jax/opt-tiny", path, quantize=fmt.get("quantize"))
    models = [load_slots(spec, num_slots=2, max_seq_len=64, prefix_caching=on, dtype=fmt.get("dtype", "auto"))
              for on in (False, True)]  # (not warmed up: each compiles only what these prompts run)
    stage = models[1].stages.stages[0]
    assert stage.pool["k"][0].dtype == kv_cache.cache_dtype(stage.params, stage.backend)
    rng = np.random.default_rng(3)
    base = [2] + rng.integers(4, 1000, 40).tolist()
    jobs = [(base + rng.integers(4, 1000, k).tolist(), SlotSettings(max_tokens=4, prompt_logprobs=p))
            for k, p in ((3, False), (5, False), (7, True), (2, True))]
    want, got = (one_by_one(m, jobs, None) for m in models)
    # int8 and bfloat16 round each product's rows: a prompt whose prefix came from the cache computes its tail in
    # a step of another shape than the whole prompt's, and the last ulp of a row can round a number the other way
    assert_same_outputs(got, want, jobs, tolerance=2e-2 if fmt else 1e-4)
    assert [c.cached for c in got] == [0, 32, 0, 31]

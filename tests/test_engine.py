"""The continuous-batching engine on a random tiny OPT, against Hugging Face's OPTForCausalLM."""
import threading
from typing import Optional

import jax
import numpy as np
import pytest
import torch
import transformers

from opt_serving.config import OPTConfig
from opt_serving.engine.scheduler import MAX_TOP_LOGPROBS, Engine, EngineClosed, OPTSlots, QueueFull, SlotSettings
from opt_serving.backend.cpu import head
from opt_serving.model import weights
from opt_serving.runner.types import JOIN_PROMPTS
from conftest import xla_compiles, xla_slots
from opt_serving.runner.joins import Part

CFG = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                max_position_embeddings=64)
MAX_SEQ = 32  # prefill buckets 8, 16 and 32


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    # a wide init so the argmax is decisive (no near-ties for float noise to flip)
    return transformers.OPTForCausalLM(transformers.OPTConfig(**{**CFG.to_hf_dict(), "init_std": 0.3})).eval()


@pytest.fixture(scope="module")
def model(hf):
    m = OPTSlots(CFG, weights.params_from_hf_state_dict(CFG, hf.state_dict()), num_slots=3, max_seq_len=MAX_SEQ)
    m.warmup()
    return m


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model)
    yield e
    e.close()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


def hf_greedy(hf, prompt, n, processor=None):
    ids = list(prompt)
    for _ in range(n):
        scores = torch.tensor(hf_logits(hf, ids)[-1:])
        if processor is not None:
            scores = processor(torch.tensor([ids]), scores)
        ids.append(int(scores.argmax()))
    return ids[len(prompt):]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class Collect:
    """Blocking callback: gathers a request's outputs; `cancel_after` cancels it from inside."""

    def __init__(self, engine=None, cancel_after=None):
        self.tokens, self.prompt, self.finish, self.error = [], None, None, None
        self.done = threading.Event()
        self.engine, self.cancel_after, self.req = engine, cancel_after, None

    def __call__(self, out):
        if out.is_prompt:
            self.prompt = out.tokens
            return
        self.tokens += out.tokens
        if len(self.tokens) == self.cancel_after:
            self.engine.cancel(self.req)
            self.done.set()
        if out.finish_reason is not None:
            self.finish, self.error = out.finish_reason, out.error
            self.done.set()

    @property
    def ids(self):
        return [t.id for t in self.tokens]


def run_all(engine, jobs, collect=None):
    cols = []
    for prompt, settings in jobs:
        c = (collect or Collect)(engine)
        c.req = engine.submit(prompt, settings, c)
        cols.append(c)
    for c in cols:
        assert c.done.wait(120), "request did not finish"
    return cols


PROMPTS = [[2, 5, 6, 7], [2] + list(range(10, 27)), [2, 40], [2] + list(range(50, 60)), [2, 99, 98, 97, 96, 95]]


def test_greedy_matches_hf_with_requests_joining_and_leaving(engine, hf):
    before = engine.stats()
    # 5 requests on 3 slots with different lengths: two wait, and join as the first ones leave
    max_tokens = [12, 9, 4, 15, 7]
    cols = run_all(engine, [(p, SlotSettings(max_tokens=m)) for p, m in zip(PROMPTS, max_tokens)])
    for p, m, c in zip(PROMPTS, max_tokens, cols):
        assert (c.ids, c.finish) == (hf_greedy(hf, p, m), "length")
    after = engine.stats()
    steps, step_tokens = after.steps - before.steps, after.step_tokens - before.step_tokens
    # the first tokens of prompts prefilled on their own come from prefill; of those that joined, from a step
    assert after.joined - before.joined == sum(len(p) <= engine.model.join_tokens for p in PROMPTS) > 0
    assert step_tokens == sum(max_tokens) - len(PROMPTS) + after.joined - before.joined
    assert step_tokens > steps  # slots shared decode steps
    assert after.running == 0


def test_logprobs_match_hf(engine, hf):
    prompt = PROMPTS[3]
    [c] = run_all(engine, [(prompt, SlotSettings(max_tokens=5, prompt_logprobs=True))])
    lp = log_softmax(hf_logits(hf, prompt + c.ids[:-1]))
    for i, tok in enumerate(c.tokens):
        row = lp[len(prompt) - 1 + i]
        assert tok.logprob == pytest.approx(row[tok.id], abs=1e-4)
        assert [t for t, _ in tok.top] == list(np.argsort(-row)[:MAX_TOP_LOGPROBS])
        assert [v for _, v in tok.top] == pytest.approx(np.sort(row)[::-1][:MAX_TOP_LOGPROBS], abs=1e-4)
    assert c.prompt[0].logprob is None and [t.id for t in c.prompt] == prompt
    assert [t.logprob for t in c.prompt[1:]] == pytest.approx(
        [lp[i, prompt[i + 1]] for i in range(len(prompt) - 1)], abs=1e-4)


def test_unscored_requests_get_the_same_tokens_and_no_logprobs(engine, hf):
    """logprob=False: the greedy tokens are HF's and carry no scores (whether or not the step made the
    logits); a request beside them that wants scores gets its own."""
    prompt = PROMPTS[1]
    unscored = SlotSettings(max_tokens=6, top_logprobs=False, logprob=False)
    alone_a, alone_b = run_all(engine, [(prompt, unscored), (PROMPTS[4], unscored)])
    mixed, scored = run_all(engine, [(prompt, unscored), (PROMPTS[4], SlotSettings(max_tokens=6))])
    assert alone_a.ids == mixed.ids == hf_greedy(hf, prompt, 6)
    assert alone_b.ids == scored.ids == hf_greedy(hf, PROMPTS[4], 6)
    assert all(t.logprob is None and t.top == [] for c in (alone_a, alone_b, mixed) for t in c.tokens)
    lp = log_softmax(hf_logits(hf, PROMPTS[4] + scored.ids[:-1]))
    assert [t.logprob for t in scored.tokens] == pytest.approx(
        [lp[len(PROMPTS[4]) - 1 + i, t.id] for i, t in enumerate(scored.tokens)], abs=1e-4)


@pytest.mark.skipif(not head.supported(), reason="no screened greedy head on this CPU")
def test_a_step_skips_the_logits_only_when_every_active_row_is_plainly_greedy(model):
    import jax.numpy as jnp
    from opt_serving.backend import sampling
    from opt_serving.model import opt
    if jax.default_backend() != "cpu":
        pytest.skip("the screened greedy head is a CPU kernel, and this module's model is on the default device")
    backend = model.stages.stages[0].backend
    assert backend.greedy_head
    # what project_out gives
    h = jnp.asarray(np.random.default_rng(0).standard_normal((3, CFG.word_embed_proj_dim)), jnp.float32)
    expect = np.asarray(opt.lm_logits(model.params, h, backend)).argmax(-1)
    ids = jnp.asarray([[2, 5, 6]] * 3, jnp.int32)

    def choose(settings, active, want_scores=False):
        state = sampling.init_state(ids, jnp.ones_like(ids), CFG.vocab_size, MAX_SEQ)
        from opt_serving.runner.sampler import settings_rows
        sampler = model.stages.stages[0].sampler
        _, (tok, lp, _, _) = sampler._choose(model.params, h, state, settings_rows(settings, 3),
                                             np.array(active), np.bool_(want_scores), np.bool_(False))
        return np.asarray(tok), np.asarray(lp)

    greedy, sampled = SlotSettings(), SlotSettings(temperature=1.0)
    penalised = SlotSettings(repetition_penalty=1.5)
    eos_held = SlotSettings(min_tokens=4, stop_token_ids=(int(expect[2]),))  # its argmax is its EOS
    tok, lp = choose([greedy, greedy, sampled], [True, True, False])  # the sampled row is free
    assert np.isnan(lp).all() and (tok[:2] == expect[:2]).all()      # no logits made: no scores
    tok, lp = choose([greedy, greedy, eos_held], [True] * 3)         # the screen leaves the held-back EOS out
    assert np.isnan(lp).all() and (tok[:2] == expect[:2]).all() and tok[2] != expect[2]
    held = tok[2]
    for settings, active, want in [([greedy, greedy, sampled], [True] * 3, False),    # a row samples
                                   ([greedy, greedy, penalised], [True] * 3, False),  # a processor acts
                                   ([greedy, greedy, eos_held], [True] * 3, True),    # scores wanted
                                   ([greedy] * 3, [True] * 3, True)]:
        tok, lp = choose(settings, active, want)
        assert np.isfinite(lp).all() and (tok[:2] == expect[:2]).all()
        if settings[2] is eos_held:
            assert tok[2] == held  # the logits path holds the EOS back the same way
    assert tok[2] == expect[2]


def test_top_alternatives_only_for_requests_that_want_them(engine, hf):
    """Skipping the top-k keeps the chosen tokens and their logprobs; a step shared with a request that
    wants alternatives gives them to that request only."""
    prompt = PROMPTS[1]
    plain = SlotSettings(max_tokens=6, top_logprobs=False)
    alone, with_top, beside = run_all(engine, [(prompt, plain), (prompt, SlotSettings(max_tokens=6)),
                                               (PROMPTS[0], plain)])
    lp = log_softmax(hf_logits(hf, prompt + alone.ids[:-1]))
    assert alone.ids == with_top.ids == hf_greedy(hf, prompt, 6)
    for i, tok in enumerate(alone.tokens):
        assert tok.top == [] and tok.logprob == pytest.approx(lp[len(prompt) - 1 + i, tok.id], abs=1e-4)
    # (the same numbers up to float32's rounding: a program that also takes the top-k may sum in another order)
    assert [t.logprob for t in alone.tokens] == pytest.approx([t.logprob for t in with_top.tokens], abs=1e-5)
    assert all(len(t.top) == MAX_TOP_LOGPROBS for t in with_top.tokens) and all(t.top == [] for t in beside.tokens)


def test_per_request_settings_share_a_step(engine, hf):
    p = PROMPTS[0]
    sampled = SlotSettings(max_tokens=10, temperature=3.0, seed=7)
    jobs = [(p, SlotSettings(max_tokens=10)),                                  # greedy
            (p, sampled),
            (p, SlotSettings(max_tokens=10, repetition_penalty=1.8)),
            (p, SlotSettings(max_tokens=10, temperature=1.0, top_k=1, seed=3)),  # top-1 sampling = greedy
            (p, SlotSettings(max_tokens=10, temperature=1.0, top_p=1e-6, seed=4)),
            (p, SlotSettings(max_tokens=10, presence_penalty=1.5, frequency_penalty=0.7))]
    cols = run_all(engine, jobs)
    greedy = hf_greedy(hf, p, 10)
    assert cols[0].ids == greedy
    rep = transformers.RepetitionPenaltyLogitsProcessor(1.8)
    assert cols[2].ids == hf_greedy(hf, p, 10, rep)
    assert cols[2].ids != greedy  # the penalty changed something, so the test means something
    assert cols[3].ids == greedy and cols[4].ids == greedy
    # OpenAI's presence/frequency penalties over the generated tokens, worked out from HF's logits
    ids, counts = list(p), np.zeros(CFG.vocab_size)
    for _ in range(10):
        x = hf_logits(hf, ids)[-1] - 1.5 * (counts > 0) - 0.7 * counts
        ids.append(int(x.argmax()))
        counts[ids[-1]] += 1
    assert cols[5].ids == ids[len(p):]
    # a seeded sample does not depend on its batchmates
    [alone] = run_all(engine, [(p, sampled)])
    assert alone.ids == cols[1].ids
    [other] = run_all(engine, [(p, SlotSettings(max_tokens=10, temperature=3.0, seed=8))])
    assert other.ids != alone.ids


def test_seeded_sampling_follows_the_softmax(engine, hf):
    # first tokens of many seeds (each sampled by prefill) against the model's softmax at temperature 2
    prompt = PROMPTS[2]
    probs = np.exp(log_softmax(hf_logits(hf, prompt)[-1] / 2.0))
    cols = [c for chunk in range(3) for c in run_all(  # in chunks: the queue holds 256
        engine, [(prompt, SlotSettings(max_tokens=1, temperature=2.0, seed=100 * chunk + s)) for s in range(100)])]
    freq = np.bincount([c.ids[0] for c in cols], minlength=CFG.vocab_size) / len(cols)
    top = np.argsort(-probs)[:3]
    # 300 draws: the standard error of a frequency is at most 0.03
    assert np.abs(freq[top] - probs[top]).max() < 0.1
    assert freq[probs < 1e-4].sum() == 0


def test_min_tokens_stop_tokens_and_bad_words(engine, hf):
    p = PROMPTS[4]
    lp = hf_logits(hf, p)[-1]
    first, second = np.argsort(-lp)[:2]
    stop = SlotSettings(max_tokens=5, stop_token_ids=(int(first),))
    held = SlotSettings(max_tokens=5, stop_token_ids=(int(first),), min_tokens=1)
    banned = SlotSettings(max_tokens=5, bad_words_ids=((int(first),),))
    c_stop, c_held, c_banned = run_all(engine, [(p, stop), (p, held), (p, banned)])
    assert (c_stop.ids, c_stop.finish) == ([first], "stop")
    assert c_held.ids[0] == second and c_banned.ids[0] == second
    assert first not in c_banned.ids
    with pytest.raises(ValueError, match="bad_words_ids"):
        engine.submit(p, SlotSettings(bad_words_ids=((5,),) * 9), lambda out: None)


def test_multi_token_bad_words_and_no_repeat_ngram_match_hf(engine, hf):
    p = PROMPTS[0]
    greedy = hf_greedy(hf, p, 12)
    word = (greedy[2], greedy[3])  # greedy says this pair: banning it must change the third token on
    bad = SlotSettings(max_tokens=12, bad_words_ids=(word,))
    ngram = SlotSettings(max_tokens=12, no_repeat_ngram_size=2)
    c_bad, c_ngram = run_all(engine, [(p, bad), (p, ngram)])
    assert c_bad.ids == hf_greedy(hf, p, 12, transformers.NoBadWordsLogitsProcessor([list(word)]))
    assert c_bad.ids != greedy
    assert c_ngram.ids == hf_greedy(hf, p, 12, transformers.NoRepeatNGramLogitsProcessor(2))


def test_cancel_frees_the_slot_at_once(engine, hf):
    # all 3 slots busy; the cancelled one leaves after exactly 2 tokens and a queued request takes its slot
    cancelled = Collect(engine, cancel_after=2)
    cancelled.req = engine.submit(PROMPTS[0], SlotSettings(max_tokens=25), cancelled)
    rest = run_all(engine, [(PROMPTS[1], SlotSettings(max_tokens=14)), (PROMPTS[2], SlotSettings(max_tokens=25)),
                            (PROMPTS[3], SlotSettings(max_tokens=6))])
    assert cancelled.done.wait(60)
    assert len(cancelled.tokens) == 2 and cancelled.finish is None
    assert rest[2].ids == hf_greedy(hf, PROMPTS[3], 6)
    assert engine.stats().running == 0


def test_the_cache_window_only_grows_where_steps_read_just_the_written_entries(model, hf):
    """With the CPU attention kernel a step reads only the entries written so far: a bigger window costs
    nothing there and a shrink would copy the whole cache, so windows start at KERNEL_MIN_WINDOW (here the
    whole context) and only grow. Otherwise the window follows the longest slot."""
    from opt_serving.model.kv_cache import cache_max_len
    from opt_serving.runner.buckets import KERNEL_MIN_WINDOW, cache_windows
    long, short = [2] + list(range(10, 30)), [2, 40]  # 21 + 4 tokens: window 32; 2 + 4: window 16
    e = Engine(model)
    try:
        (c,) = run_all(e, [(long, SlotSettings(max_tokens=4))])
        (d,) = run_all(e, [(short, SlotSettings(max_tokens=4))])
    finally:
        e.close()
    assert (c.ids, d.ids) == (hf_greedy(hf, long, 4), hf_greedy(hf, short, 4))
    stage = model.stages.stages[0]
    assert cache_max_len(stage.caches[0]) == (32 if stage.backend.attention else 16)
    assert stage.windows == ([min(KERNEL_MIN_WINDOW, MAX_SEQ)] if stage.backend.attention else [16, 32])
    assert cache_windows(2048, KERNEL_MIN_WINDOW) == [256, 512, 1024, 2048]
    assert cache_windows(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]


@pytest.fixture(scope="module")
def model8(hf):
    """Eight slots: prompts of buckets 8 and 16 are prefilled 4 and 2 at a time."""
    m = OPTSlots(CFG, weights.params_from_hf_state_dict(CFG, hf.state_dict()), num_slots=8, max_seq_len=MAX_SEQ)
    m.warmup()
    return m


@pytest.fixture(scope="module")
def xla_model8(hf):
    """model8's slots on plain XLA (as on a GPU or a mesh): no ragged steps, short prompts join whole."""
    m = xla_slots(CFG, weights.params_from_hf_state_dict(CFG, hf.state_dict()), num_slots=8, max_seq_len=MAX_SEQ)
    m.warmup()
    return m


@pytest.fixture(scope="module")
def xla_model(hf):
    m = xla_slots(CFG, weights.params_from_hf_state_dict(CFG, hf.state_dict()), num_slots=3, max_seq_len=MAX_SEQ)
    m.warmup()
    return m


class CountPasses:
    """Wraps a slot model's prefill passes, recording each pass's number of prompts."""

    def __init__(self, model, monkeypatch):
        self.sizes, real = [], model._send_prefill
        monkeypatch.setattr(model, "_send_prefill", lambda b, p, s: (self.sizes.append((b, len(p))), real(b, p, s))[1])


def jax_leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)


def test_batched_prefill_gives_exactly_the_prefixes_of_one_by_one(model8, monkeypatch):
    """A prompt's prefix is bit for bit the same whatever it is batched with (and wherever in the pass):
    a greedy request's tokens never depend on the load."""
    assert model8.batch_rows == {8: 4, 16: 2}
    rng = np.random.default_rng(1)
    lengths = [3, 8, 5, 1, 7, 6, 2, 4, 5, 9, 12, 11, 20, 25]
    prompts = [[2] + rng.integers(4, CFG.vocab_size, n - 1).tolist() for n in lengths]
    settings = [SlotSettings(max_tokens=4, top_logprobs=i % 2 == 0, temperature=0.8 if i % 3 == 0 else 0.0,
                             seed=i, min_tokens=2, stop_token_ids=(2,), repetition_penalty=1.3 if i == 4 else 1.0,
                             bad_words_ids=((7,),) if i == 5 else (), prompt_logprobs=i in (6, 10))
                for i in range(len(prompts))]
    passes = CountPasses(model8, monkeypatch)
    together = model8.prefill_batch(prompts, settings)
    # bucket 8: nine prompts in passes of 4, 4 and 1; bucket 16: 2 and 1; bucket 32: one at a time
    assert sorted(passes.sizes) == [(8, 1), (8, 4), (8, 4), (16, 1), (16, 2), (32, 1), (32, 1)]
    for p, s, a in zip(prompts, settings, together):
        b = model8.prefill(p, s)
        assert (a.length, a.first, a.prompt) == (b.length, b.first, b.prompt)  # logprobs exactly equal too
        assert len(a.first.top) == (MAX_TOP_LOGPROBS if s.top_logprobs else 0)
        assert (a.prompt is not None) == s.prompt_logprobs
        stage = model8.stages.stages[0]  # the rows each prefix holds there: cache, sampling state, settings
        rows = lambda p: jax_leaves((stage.pending[p.state], stage.sampler.pending[p.state]))  # noqa: E731
        for x, y in zip(rows(a), rows(b)):
            assert x.shape == y.shape and x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        model8.discard(a)
        model8.discard(b)
        assert a.state not in stage.pending and b.state not in stage.sampler.pending


JOIN_SETTINGS = [SlotSettings(max_tokens=8), SlotSettings(max_tokens=8, temperature=0.9, seed=5, top_k=20),
                 SlotSettings(max_tokens=8, temperature=0.7, top_p=0.8, seed=11, repetition_penalty=1.4),
                 SlotSettings(max_tokens=8, min_tokens=6, stop_token_ids=(2,), bad_words_ids=((9,), (3, 4))),
                 SlotSettings(max_tokens=8, top_logprobs=True, presence_penalty=0.5, no_repeat_ngram_size=2)]


def test_a_joining_prompt_gets_the_tokens_of_a_prefilled_one(model8):
    """A prompt whose prefill rides in a decode step (`join`) gets the tokens (sampled ones too: the same
    sampling state) and the scores that prefilling it on its own and inserting it gives, beside other rows."""
    rng = np.random.default_rng(4)
    for n, s in zip([3, 8, 1, 6, 12], JOIN_SETTINGS):
        prompt = [2] + rng.integers(4, CFG.vocab_size, n - 1).tolist()
        other = model8.prefill([2, 17, 18, 19], SlotSettings())  # a running row in every step
        model8.insert(other, 5)
        prefix = model8.prefill(prompt, s)
        model8.insert(prefix, 0)
        assert model8.join(prompt, s, 3) is not None
        inserted, joined = [prefix.first], []
        try:
            while len(joined) < s.max_tokens:
                result = model8.step()
                inserted.append(result.token(0))
                joined.append(result.token(3))
        finally:
            for slot in (0, 3, 5):
                model8.free(slot)
        inserted = inserted[:s.max_tokens]
        assert [t.id for t in joined] == [t.id for t in inserted], s
        assert [t.logprob for t in joined] == pytest.approx([t.logprob for t in inserted], abs=1e-4)
        assert [[i for i, _ in t.top] for t in joined] == [[i for i, _ in t.top] for t in inserted]
        assert len(joined[0].top) == (MAX_TOP_LOGPROBS if s.top_logprobs else 0)


def test_without_ragged_steps_short_prompts_join_whole(xla_model8):
    """Where steps are not ragged (plain XLA: a GPU, a mesh), a step takes short prompts whole, in the smallest
    block that holds them; a prompt longer than the largest block, one asking for prompt scores, or one over the
    block's room is refused (prefilled instead); a joined prompt freed before its step never runs."""
    model8 = xla_model8
    s = SlotSettings(max_tokens=4)
    assert model8.join_blocks == (8, 16) and model8.join_tokens == 16
    assert not model8.join([2] * 17, s, 0)
    assert not model8.join([2, 5], SlotSettings(prompt_logprobs=True), 0)
    assert all(model8.join([2, 5 + i, 6], s, slot) for i, slot in enumerate((0, 1, 2, 3)))  # 12 tokens
    assert not model8.join([2] * 5, s, 4)  # 17 would not fit
    model8.free(2)
    assert model8.join([2, 9, 9, 9], s, 4)  # 13 tokens...
    assert not model8.join([2, 9, 9, 9], s, 6)  # ... and 17 would not fit
    assert model8.join([2], s, 6)  # a fifth prompt: 14
    block = model8._block([Part(j, 0, len(j.tokens)) for j in model8.joins.joining(0)])  # (nothing taken)
    assert len(block.ids) == 16 and block.settings == (s,) * 5
    assert block.rows.tolist() == [0] * 3 + [1] * 3 + [3] * 3 + [4] * 4 + [6] + [8] * 2  # padding: out of range
    assert block.entries.tolist()[:6] == [0, 1, 2, 0, 1, 2] and block.seg.tolist()[-2:] == [JOIN_PROMPTS] * 2
    result = model8.step()
    stage = model8.stages.stages[0]
    assert np.asarray(stage.sampler.active[0]).tolist() == [True, True, False, True, True, False, True, False]
    assert model8.table.lengths.tolist() == [4, 4, 0, 4, 5, 0, 2, 0]  # prompt and first token
    mask = np.asarray(stage.caches[0]["mask"])
    assert mask[4, :4].all() and mask[4].sum() == 4  # its prompt (its first token goes in at the next step)
    assert mask[6, :1].all() and mask[6].sum() == 1
    assert mask[2, 1:].sum() == 0  # the freed one: nothing (a free row's decode writes its entry 0)
    one = model8.prefill([2, 9, 9, 9], s)
    assert result.token(4).id == one.first.id
    model8.discard(one)
    for slot in (0, 1, 3, 4, 6):
        model8.free(slot)
    assert model8.join([2, 3], s, 0)
    assert len(model8._block([Part(j, 0, 2) for j in model8.joins.joining(0)]).ids) == 8  # the smallest block
    model8.free(0)
    assert not model8.joins.waiting(0)


def test_on_ragged_stages_any_prompt_joins_a_budget_of_its_tokens_a_step(model8, hf):
    """With ragged steps any prompt joins (not one asking for prompt scores: prefilled); a step carries at most
    its budget of tokens (the context's 32 here), the running rows' and the prompts', prompts that finish within a
    quarter of it first, then the oldest: a 20-token prompt, one of 23 split over three steps, then one of 5 that
    cuts in. Rows get a token only from the step with their prompt's last part, each HF's; a freed prompt never
    runs."""
    s = SlotSettings(max_tokens=4)
    assert model8.ragged and model8.join_tokens == 32 and model8.join_blocks == (4, 8, 16, 32)
    assert not model8.join([2, 5], SlotSettings(prompt_logprobs=True), 0)
    rng = np.random.default_rng(7)
    a, b, c = ([2] + rng.integers(4, CFG.vocab_size, n - 1).tolist() for n in (20, 23, 5))
    for slot, prompt in ((0, a), (1, b)):
        assert model8.join(prompt, s, slot)
    assert model8.join([2, 9, 9], s, 2)
    model8.free(2)  # freed before its step
    tokens = {0: [], 1: [], 3: []}
    try:
        first = model8.step()  # a (20) whole, then 12 of b's 23
        assert first.rows.tolist() == [True] + [False] * 7
        tokens[0].append(first.token(0).id)
        assert model8.join(c, s, 3)  # 5 tokens: it finishes within a quarter of the budget, so it goes first
        # a's decode, c (5) and 10 of b's last 11: 16 tokens fill a block, where b's 11 would pad it to 32
        second = model8.step()
        assert second.rows.tolist() == [True, False, False, True] + [False] * 4
        third = model8.step()  # b's last token rides with a's and c's decodes
        assert third.rows.tolist() == [True, True, False, True] + [False] * 4
        for r in (second, third):
            for slot in tokens:
                if r.rows[slot]:
                    tokens[slot].append(r.token(slot).id)
        while len(tokens[1]) < 4:
            r = model8.step()
            for slot in tokens:
                tokens[slot].append(r.token(slot).id)
    finally:
        for slot in (0, 1, 3):
            model8.free(slot)
    assert tokens[0][:4] == hf_greedy(hf, a, 4)
    assert tokens[1][:4] == hf_greedy(hf, b, 4)
    assert tokens[3][:4] == hf_greedy(hf, c, 4)


def test_on_ragged_stages_a_step_packs_the_running_rows_and_the_prompt_tokens_into_one_list(model8, hf, monkeypatch):
    """A ragged step's tokens are one list (PackedTokens): the running rows' newest tokens, then the prompt tokens,
    padded as a whole to a block size (not every row of the group and then a block); the sampler takes each row's
    hidden state at its token, and the tokens are HF's."""
    from opt_serving.runner import slots as slots_module
    packs, real = [], slots_module.pack_step
    monkeypatch.setattr(slots_module, "pack_step", lambda *a: (packs.append(real(*a)), packs[-1])[1])
    s = SlotSettings(max_tokens=3)
    a, b = PROMPTS[2], PROMPTS[3]  # 2 and 11 tokens
    tokens = {0: [], 2: []}
    try:
        assert model8.join(a, s, 0)
        first = model8.step()
        tokens[0].append(first.token(0).id)
        assert model8.join(b, s, 2)
        second = model8.step()
        assert second.rows.tolist() == [True, False, True] + [False] * 5
        for slot in tokens:
            tokens[slot].append(second.token(slot).id)
        third = model8.step()
        for slot in tokens:
            tokens[slot].append(third.token(slot).id)
    finally:
        for slot in tokens:
            model8.free(slot)
    rows = model8.num_slots  # (one group: row = slot)
    assert len(packs[0].ids) == 4 and packs[0].src.tolist() == [-1] * 4  # a's 2 tokens alone: a block of 4
    p = packs[1]  # a's newest token (position 2), then b's 11: 12 tokens in a block of 16, not 8 rows and 16
    assert len(p.ids) == 16 and p.src.tolist() == [0] + [-1] * 15
    assert p.rows.tolist() == [0] + [2] * 11 + [rows] * 4 and p.entries.tolist()[:12] == [2] + list(range(11))
    assert p.ids.tolist()[1:12] == b and p.out.tolist() == [0, 0, 11] + [0] * 5
    assert packs[2].src.tolist() == [0, 2] + [-1] * 2 and packs[2].entries.tolist()[:2] == [3, 11]  # 2 rows: 4
    assert tokens[0] == hf_greedy(hf, a, 3) and tokens[2] == hf_greedy(hf, b, 2)


def run_queued(model, jobs, collect=Collect, chunk=256):
    """`run_all` on a new engine whose scheduler starts only once every job is queued: it admits them at once.
    `chunk`: the engine's prefill_chunk."""
    e = Engine(model, start=False, prefill_chunk=chunk)
    cols = []
    for prompt, settings in jobs:
        cols.append(collect(e))
        cols[-1].req = e.submit(prompt, settings, cols[-1])
    e.start()
    try:
        for c in cols:
            assert c.done.wait(120), "request did not finish"
    finally:
        e.close()
    return cols


LONG_CFG = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                     max_position_embeddings=160)


def join_burst(monkeypatch, seed: int, max_seq_len: int, prompt_len: int, new: int, xla: bool = False):
    """18 prompts of `prompt_len` tokens queued at once on a warmed-up slot model of 20 slots over LONG_CFG (its
    weights HF's, from `seed`; `xla`: on plain XLA, no ragged steps), `new` greedy tokens each; every one continues
    as HF's greedy -> (the slot model, (prompts, block size) of each step that prompts joined, the prefill
    passes)."""
    torch.manual_seed(seed)
    hf = transformers.OPTForCausalLM(transformers.OPTConfig(**{**LONG_CFG.to_hf_dict(), "init_std": 0.3})).eval()
    model = (xla_slots if xla else OPTSlots)(LONG_CFG, weights.params_from_hf_state_dict(LONG_CFG, hf.state_dict()),
                                             num_slots=20, max_seq_len=max_seq_len)
    model.warmup()
    passes, blocks, real_block = CountPasses(model, monkeypatch), [], model._block
    def block(joins):  # records (prompts, block size)
        b = real_block(joins)
        blocks.append((len(joins), len(b.ids)))
        return b
    monkeypatch.setattr(model, "_block", block)
    rng = np.random.default_rng(seed + 2)
    prompts = [[2] + rng.integers(4, LONG_CFG.vocab_size, prompt_len - 1).tolist() for _ in range(18)]
    cols = run_queued(model, [(p, SlotSettings(max_tokens=new)) for p in prompts])
    for p, c in zip(prompts, cols):
        assert (c.ids, c.finish) == (hf_greedy(hf, p, new), "length")
    return model, blocks, passes.sizes


@pytest.mark.parametrize("xla", [False, True])
def test_a_burst_of_short_prompts_joins_one_step_in_a_large_block_and_matches_hf(monkeypatch, xla):
    """Clients that finished together send their next requests at once: up to JOIN_PROMPTS (16) short prompts
    start in one decode step, here 96 prompt tokens (a block of 96 on ragged stages, of 128 on plain XLA), with no
    prefill pass of their own; the two past that count join the next step. Every one continues as HF's greedy."""
    model, blocks, passes = join_burst(monkeypatch, seed=1, max_seq_len=160, prompt_len=6, new=5, xla=xla)
    if xla:
        assert JOIN_PROMPTS == 16 and model.join_blocks == (8, 16, 32, 64, 128) and model.join_prompt_tokens == 32
        assert blocks == [(16, 128), (2, 16)]
    else:  # any prompt of the context joins, 160 prompt tokens a step at most (a whole context: no chunk given)
        assert model.join_blocks == (4, 8, 16, 32, 48, 64, 96, 128, 160) and model.join_prompt_tokens == 159
        assert blocks == [(16, 96), (2, 16)]
    assert passes == []


def test_on_a_gpu_sixteen_full_prompts_join_one_step_in_a_block_longer_than_the_context(monkeypatch):
    """Where the stages run on a GPU (a step there is bound by its launches, not its products), the blocks go
    on to 512 tokens: 16 prompts of the longest that joins (32) start in one step, in a block longer than the
    whole context (64), and the two past that count join the next. Every one continues as HF's greedy."""
    from opt_serving.runner.stage import StageSlots
    monkeypatch.setattr(StageSlots, "platform", lambda self: "gpu")
    model, blocks, passes = join_burst(monkeypatch, seed=2, max_seq_len=64, prompt_len=32, new=4, xla=True)
    assert model.join_blocks == (8, 16, 32, 64, 128, 256, 512) and model.join_prompt_tokens == 32
    assert blocks == [(16, 512), (2, 64)]
    assert passes == []


def test_on_a_cpu_the_blocks_stop_at_128_tokens_and_below_the_context(xla_model8, model8):
    """The same slot model on this CPU without ragged steps keeps the blocks a CPU's products want (JOIN_BLOCKS),
    each shorter than the context: a cache of 32 takes blocks of 8 and 16; with them, up to a context's worth."""
    assert xla_model8.stages.stages[0].platform() == "cpu"
    assert (MAX_SEQ, xla_model8.join_blocks) == (32, (8, 16))
    assert model8.join_blocks == (4, 8, 16, 32)  # (ragged: the smallest holds four rows' tokens)


@pytest.mark.parametrize("xla", [False, True])
def test_a_burst_of_requests_is_prefilled_together_and_matches_hf(model8, xla_model8, hf, monkeypatch, xla):
    model8 = xla_model8 if xla else model8
    passes = CountPasses(model8, monkeypatch)
    blocks, real_block = [], model8._block
    monkeypatch.setattr(model8, "_block", lambda joins: (blocks.append(len(joins)), real_block(joins))[1])
    prompts = [[2] + list(range(10 + 7 * i, 10 + 7 * i + n)) for i, n in enumerate([3, 6, 1, 7, 4, 5, 2, 6])]
    scored = (0, 3, 5)  # prompt scores come from a prefill
    cols = run_queued(model8, [(p, SlotSettings(max_tokens=6, prompt_logprobs=i in scored))
                               for i, p in enumerate(prompts)])
    # the three asking for prompt scores are prefilled together; without ragged steps the prompts of 7, 2 and 5
    # tokens join the first decode step (a block of 16 tokens: a cache of 32 takes no larger one), those of 3 and
    # 7 no longer fit and join the next; with them all five (24 tokens) join the first
    assert passes.sizes == [(8, 3)]
    if xla:
        assert (MAX_SEQ, model8.join_blocks, model8.join_tokens) == (32, (8, 16), 16) and blocks == [3, 2]
    else:
        assert blocks == [5]
    for p, c in zip(prompts, cols):
        assert (c.ids, c.finish) == (hf_greedy(hf, p, 6), "length")
    for i in scored:
        lp = log_softmax(hf_logits(hf, prompts[i]))
        assert [t.logprob for t in cols[i].prompt[1:]] == pytest.approx(
            [lp[k, prompts[i][k + 1]] for k in range(len(prompts[i]) - 1)], abs=1e-4)


def test_a_failed_batched_prefill_is_retried_one_by_one():
    """Only the request that breaks prefill fails; the others it was batched with are served."""
    from opt_serving.engine.fake import FakeSlots

    class Fussy(FakeSlots):
        batched_prefill = True
        batches = []

        def prefill_batch(self, prompts, settings):
            self.batches.append(len(prompts))
            raise RuntimeError("batched prefill broke")

        def prefill(self, tokens, settings):
            if tokens[-1] == 13:
                raise ValueError("cannot prefill a prompt ending in 13")
            return super().prefill(tokens, settings)

    cols = run_queued(Fussy(num_slots=4), [(p, SlotSettings(max_tokens=3)) for p in ([2, 5], [2, 13], [2, 40])])
    assert Fussy.batches == [3]
    assert (cols[0].ids, cols[0].finish) == ([6, 7, 8], "length")
    assert cols[1].finish == "error" and "ending in 13" in str(cols[1].error)
    assert (cols[2].ids, cols[2].finish) == ([41, 42, 43], "length")


def test_a_finished_request_has_left_its_slot_when_its_last_token_arrives():
    """A client that scrapes /metrics (or the stats) on its final token sees the slot free, not still running."""
    from opt_serving.engine.fake import FakeSlots
    seen = []

    class Watch(Collect):
        def __call__(self, out):
            if out.finish_reason is not None:
                seen.append(self.engine.stats().running)
            super().__call__(out)

    cols = run_queued(FakeSlots(num_slots=2), [([2, 5], SlotSettings(max_tokens=n)) for n in (3, 5)], Watch)
    assert [c.finish for c in cols] == ["length", "length"]
    assert seen == [1, 0]  # the first to finish leaves the other one running


def test_warmup_compiled_every_shape(engine, model):
    s = model.stages.stages[0].sampler
    jobs = [([2] + [7] * (n - 1), SlotSettings(max_tokens=MAX_SEQ - n, temperature=0.5, top_p=0.9, seed=n,
                                               prompt_logprobs=n in (17, 3)))
            for n in (1, 15, 16, 17, 31, 3, 9)]
    with xla_compiles() as asked:
        run_all(engine, jobs)
    assert asked == []
    # the sampler's side of a joining step and the prompt scores: one program whatever the block or the width
    assert len(model.join_blocks) > 1 and len(s._choose_joining.warmed) == len(s._scores_block.warmed) == 1


def test_queue_full_too_long_and_close(model):
    e = Engine(model, max_queue=1, start=False)  # never started: nothing touches the model
    waiting = Collect()
    e.submit([2, 5], SlotSettings(max_tokens=2), waiting)
    with pytest.raises(QueueFull):
        e.submit([2, 6], SlotSettings(max_tokens=2), Collect())
    with pytest.raises(ValueError, match="maximum context length is 32"):
        e.submit([2] * 30, SlotSettings(max_tokens=5), Collect())
    with pytest.raises(ValueError, match="vocabulary"):
        e.submit([2, 500], SlotSettings(), Collect())
    e.close()
    assert waiting.finish == "error" and isinstance(waiting.error, EngineClosed)
    with pytest.raises(EngineClosed):
        e.submit([2, 5], SlotSettings(max_tokens=2), Collect())


def test_load_generator_matches_hf_greedy():
    # the whole path the service and the batch tool take: folder -> tokenizer + engine -> text
    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.text.generator import SamplingParams
    from opt_serving.text.loading import load_generator
    from opt_serving.model.wrapper import get_model
    folder = ensure_embedded_model()
    gen = load_generator("jax/opt-tiny", folder, max_batch_size=2, max_seq_len=16)  # one bucket
    try:
        prompts = ["Hello world", "The quick brown fox", "a"]
        out = gen.complete_many(prompts, SamplingParams(max_tokens=8, temperature=0.0))
        hf = get_model("facebook/opt-tiny", folder)
        for prompt, [c] in zip(prompts, out):
            ids = gen.encode(prompt)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                  pad_token_id=1)[0, len(ids):].tolist()
            if 2 in ref:  # EOS ends both; the generator leaves it out of the text
                ref = ref[:ref.index(2)]
            assert c.token_ids == ref
            assert c.text == gen.decode(ref)
            assert c.finish_reason == ("length" if len(ref) == 8 else "stop")
    finally:
        gen.close()


LONG = [[2] + list(range(3 + 5 * i, 3 + 5 * i + n)) for i, n in enumerate([16, 21, 27, 19])]  # 17-28 tokens


class LogParts:
    """Records the joined prompts' parts each decode step carries: [[(slot, start, end), ...] a step]."""

    def __init__(self, model, monkeypatch):
        self.steps, real = [], model._block
        monkeypatch.setattr(model, "_block", lambda parts: (self.steps.append(
            [(p.joining.slot, p.start, p.end) for p in parts]), real(parts))[1])


@pytest.mark.parametrize("kind", ["ragged", "xla"])
def test_chunked_prefill_gives_the_whole_prefill_tokens(kind, model, xla_model, hf, monkeypatch):
    """Prompts longer than the chunk (16 tokens an iteration) get the tokens and scores of whole prefills, greedy
    and sampled, with short prompts beside them: on ragged stages joining decode steps a part at a time (each
    long prompt over two or more steps, no step carrying more than 16 prompt tokens), elsewhere prefilled in
    chunks of their own (the last chunk padded)."""
    model = model if kind == "ragged" else xla_model
    jobs = [(p, SlotSettings(max_tokens=32 - len(p), temperature=t, seed=i, top_p=0.9 if t else 1.0,
                             repetition_penalty=1.3 if i == 2 else 1.0))
            for i, p in enumerate(LONG) for t in (0.0, 1.5)] + [(PROMPTS[0], SlotSettings(max_tokens=9))]
    chunks = []
    real = model.prefill_chunk
    monkeypatch.setattr(model, "prefill_chunk", lambda job: (chunks.append(job.done), real(job))[1])
    parts = LogParts(model, monkeypatch)
    whole = run_queued(model, jobs, chunk=None)
    assert chunks == []
    whole_steps, parts.steps = parts.steps, []
    chunked = run_queued(model, jobs, chunk=16)
    if kind == "xla":
        assert chunks == [0, 16] * len(LONG) * 2
    else:
        assert chunks == [] and max(sum(e - b for _, b, e in step) for step in whole_steps) == 32
        assert max(sum(e - b for _, b, e in step) for step in parts.steps) == 16
        split = [(b, e) for step in parts.steps for _, b, e in step if b > 0]  # a prompt's later parts
        assert len(split) >= len(LONG) * 2 and all(e > b for b, e in split)
    for (p, s), a, b in zip(jobs, whole, chunked):
        assert (b.ids, b.finish) == (a.ids, a.finish)
        assert [t.logprob for t in b.tokens] == pytest.approx([t.logprob for t in a.tokens], abs=1e-4)
        if s.temperature == 0 and s.repetition_penalty == 1.0:
            assert b.ids == hf_greedy(hf, p, s.max_tokens)
    assert whole[1].ids != whole[0].ids  # sampling changed something, so the test means something


def test_on_ragged_stages_running_requests_get_a_token_in_every_step_a_long_prompt_rides(model, hf, monkeypatch):
    """A request already decoding gets a token in every step while a long prompt (22 tokens) rides them a part at
    a time (8 tokens a step, the short prompt's 2 first, then the running row's token and 7 of the prompt's: a
    block of 8, where 8 of the prompt's would pad a block to 16); the long one gets its first token with its last
    part, then both decode together, each HF's."""
    parts = LogParts(model, monkeypatch)
    e = Engine(model, start=False, prefill_chunk=8)
    short, long = Sizes(e), Sizes(e)
    short.req = e.submit(PROMPTS[2], SlotSettings(max_tokens=20), short)
    long.req = e.submit(LONG[1], SlotSettings(max_tokens=6), long)
    e.start()
    try:
        assert short.done.wait(120) and long.done.wait(120)
    finally:
        e.close()
    spans = [[(b, e) for _, b, e in step] for step in parts.steps]
    assert spans[:4] == [[(0, 2), (0, 6)], [(6, 13)], [(13, 20)], [(20, 22)]]  # the short one whole, the long in 4
    assert short.sizes[:4] == [1, 1, 1, 1]  # a token from each of those steps
    assert (short.ids, long.ids) == (hf_greedy(hf, PROMPTS[2], 20), hf_greedy(hf, LONG[1], 6))


def test_running_requests_get_tokens_between_the_chunks_of_a_long_prompt(xla_model, hf):
    """Without ragged steps: a request already decoding gets a token between every two chunks of a long prompt's
    prefill (a budget of one chunk an iteration, then a decode step); the long one then joins the running ones."""
    model = xla_model
    events = []

    class Log(Collect):
        def __call__(self, out):
            events.extend([("token", self.name)] * len(out.tokens))
            super().__call__(out)

    real = model.prefill_chunk
    model.prefill_chunk = lambda job: (events.append(("chunk", job.done)), real(job))[1]
    try:
        e = Engine(model, start=False, prefill_chunk=8, prefill_budget=8)
        short, long = Log(e), Log(e)
        short.name, long.name = "short", "long"
        short.req = e.submit(PROMPTS[2], SlotSettings(max_tokens=20), short)
        long.req = e.submit(LONG[1], SlotSettings(max_tokens=6), long)
        e.start()
        assert short.done.wait(120) and long.done.wait(120)
        e.close()
    finally:
        del model.prefill_chunk
    first_long = events.index(("token", "long"))
    # the short prompt joins the first decode step, which runs after the iteration's chunk
    assert events[:first_long] == [("chunk", 0), ("token", "short"), ("chunk", 8), ("token", "short"),
                                   ("chunk", 16)]  # 22 tokens: three chunks
    assert events[first_long + 1] == ("token", "short")  # then both decode together
    assert (short.ids, long.ids) == (hf_greedy(hf, PROMPTS[2], 20), hf_greedy(hf, LONG[1], 6))


def _logged_run(model, submit, **engine_kw):
    """Run the requests `submit(engine, Log)` queues (Log: a Collect whose tokens are logged by `name`) on a
    new engine; -> (events: ("token", name) and ("chunk", name, tokens done) in order, the collectors)."""
    events = []

    class Log(Collect):
        def __init__(self, engine, name):
            super().__init__(engine)
            self.name = name

        def __call__(self, out):
            events.extend([("token", self.name)] * len(out.tokens))
            super().__call__(out)

    real = model.prefill_chunk
    names = {}
    model.prefill_chunk = lambda job: (events.append(("chunk", names[tuple(job.tokens)], job.done)), real(job))[1]
    try:
        e = Engine(model, start=False, **engine_kw)
        logs = submit(e, Log)
        names.update({tuple(c.prompt): c.name for c in logs})
        e.start()
        assert all(c.done.wait(120) for c in logs)
        e.close()
    finally:
        del model.prefill_chunk
    return events, logs


def test_a_budget_of_two_chunks_prefills_two_between_decode_steps(xla_model, hf):
    model = xla_model  # (prompts prefilled in chunks of their own)
    """prefill_budget=16 with chunks of 8: an iteration prefills two chunks of the long prompt, then the
    running request takes a step."""
    def submit(e, Log):
        short, long = Log(e, "short"), Log(e, "long")
        short.prompt, long.prompt = PROMPTS[2], LONG[1]
        short.req = e.submit(PROMPTS[2], SlotSettings(max_tokens=20), short)
        long.req = e.submit(LONG[1], SlotSettings(max_tokens=6), long)
        return [short, long]

    events, (short, long) = _logged_run(model, submit, prefill_chunk=8, prefill_budget=16)
    first_long = events.index(("token", "long"))
    assert events[:first_long] == [("chunk", "long", 0), ("chunk", "long", 8), ("token", "short"),
                                   ("chunk", "long", 16)]  # 22 tokens: three chunks
    assert (short.ids, long.ids) == (hf_greedy(hf, PROMPTS[2], 20), hf_greedy(hf, LONG[1], 6))


def test_by_default_a_long_prompts_chunks_all_run_before_the_next_decode_step(xla_model, hf):
    model = xla_model  # (prompts prefilled in chunks of their own)
    """The default budget (2048 prompt tokens an iteration) takes every chunk of a 22-token prompt in chunks of
    8 in one iteration; the short prompt beside it joins the decode step after them."""
    def submit(e, Log):
        short, long = Log(e, "short"), Log(e, "long")
        short.prompt, long.prompt = PROMPTS[2], LONG[1]
        short.req = e.submit(PROMPTS[2], SlotSettings(max_tokens=6), short)
        long.req = e.submit(LONG[1], SlotSettings(max_tokens=6), long)
        return [short, long]

    events, (short, long) = _logged_run(model, submit, prefill_chunk=8)
    assert events[:5] == [("chunk", "long", 0), ("chunk", "long", 8), ("chunk", "long", 16), ("token", "long"),
                          ("token", "short")]
    assert (short.ids, long.ids) == (hf_greedy(hf, PROMPTS[2], 6), hf_greedy(hf, LONG[1], 6))


def test_the_budget_counts_whole_prompts_too(model):
    """With a budget of 24 prompt tokens an iteration, of three 12-token prompts prefilled whole (scored: they
    never join a step) two go in the first iteration's pass and the third after a decode step; by default
    all three in one."""
    prompts = [PROMPTS[0] + [9] * 8, PROMPTS[3] + [9], PROMPTS[1][:12]]
    assert [len(p) for p in prompts] == [12, 12, 12]
    events = []
    real = {name: getattr(model, name) for name in ("prefill_batch", "step", "step_many")}  # (prefill: a batch of 1)
    model.prefill_batch = lambda ts, ss: (events.append(("pass", len(ts))), real["prefill_batch"](ts, ss))[1]
    model.step = lambda: (events.append(("step",)), real["step"]())[1]
    model.step_many = lambda n: (events.append(("step",)), real["step_many"](n))[1]
    try:
        for budget, want in ((24, [("pass", 2), ("step",), ("pass", 1), ("step",)]), (None, [("pass", 3), ("step",)])):
            events.clear()
            e = Engine(model, start=False, prefill_chunk=8, prefill_budget=budget)
            cols = [Collect(e) for _ in prompts]
            for p, c in zip(prompts, cols):  # all queued before the engine's first iteration
                c.req = e.submit(p, SlotSettings(max_tokens=3, prompt_logprobs=True), c)
            e.start()
            assert all(c.done.wait(120) for c in cols)
            e.close()
            assert events[:len(want)] == want and all(c.finish == "length" for c in cols)
    finally:
        for name in real:
            delattr(model, name)


def test_a_short_prompt_behind_two_long_ones_starts_at_once(xla_model, hf):
    model = xla_model  # (prompts prefilled in chunks of their own)
    """Two long prompts queued before a short one: the short one is prefilled in the first iteration (it
    does not wait behind them), and the long ones get their chunks oldest first, within a budget of 8 prompt
    tokens an iteration."""
    def submit(e, Log):
        logs = [Log(e, n) for n in ("a", "b", "short")]
        for c, prompt, n in zip(logs, (LONG[0], LONG[2], PROMPTS[0]), (4, 4, 12)):
            c.prompt = prompt
            c.req = e.submit(prompt, SlotSettings(max_tokens=n), c)
        return logs

    events, (a, b, short) = _logged_run(model, submit, prefill_chunk=8, prefill_budget=8)
    assert events[:2] == [("chunk", "a", 0), ("token", "short")]  # it joins the first decode step
    chunks = [ev[1:] for ev in events if ev[0] == "chunk"]
    assert chunks == [("a", 0), ("a", 8), ("a", 16), ("b", 0), ("b", 8), ("b", 16), ("b", 24)]  # 17 and 28 tokens
    # a's last chunk (1 token) leaves most of the iteration's budget to b's first chunk; a's first token is out
    # before b's next chunk
    assert events.index(("chunk", "a", 16)) + 1 == events.index(("chunk", "b", 0))
    assert events.index(("token", "a")) < events.index(("chunk", "b", 8))
    for c, prompt, n in ((a, LONG[0], 4), (b, LONG[2], 4), (short, PROMPTS[0], 12)):
        assert c.ids == hf_greedy(hf, prompt, n)


def test_a_request_cancelled_mid_prefill_lets_its_rows_go(xla_model, hf):
    model = xla_model  # (prompts prefilled in chunks of their own)
    """Cancelled between two chunks: no output follows, the rows its chunks filled are let go (cache and
    sampling row), and the engine serves the next request."""
    stage = model.stages.stages[0]
    e = Engine(model, start=False, prefill_chunk=8)
    long, after = Collect(e), Collect(e)
    real = model.prefill_chunk

    def chunk(job):
        out = real(job)
        if job.done == 8:  # the first chunk is in the cache: cancel now
            assert job.state in stage.pending
            e.cancel(long.req)
            long.handle = job.state
        return out

    model.prefill_chunk = chunk
    try:
        long.req = e.submit(LONG[2], SlotSettings(max_tokens=4), long)
        after.req = e.submit(LONG[0], SlotSettings(max_tokens=4), after)
        e.start()
        assert after.done.wait(120)
        e.close()
    finally:
        del model.prefill_chunk
    assert long.tokens == [] and long.finish is None and long.req.done
    assert long.handle not in stage.pending and long.handle not in stage.sampler.pending
    assert not stage.pending and not stage.sampler.pending
    assert after.ids == hf_greedy(hf, LONG[0], 4)


def test_on_ragged_stages_a_short_prompt_behind_two_long_ones_finishes_first(model, hf, monkeypatch):
    """Two long prompts (17 and 28 tokens) queued before a short one (4): with 16 prompt tokens a step, the short
    one (within a quarter of that) goes in the first step and gets its first token there; the long ones follow
    oldest first; each gets HF's tokens."""
    parts = LogParts(model, monkeypatch)
    e = Engine(model, start=False, prefill_chunk=16)
    cols = [Collect(e) for _ in range(3)]
    for c, prompt in zip(cols, (LONG[0], LONG[2], PROMPTS[0])):
        c.req = e.submit(prompt, SlotSettings(max_tokens=4), c)
    e.start()
    try:
        assert all(c.done.wait(120) for c in cols)
    finally:
        e.close()
    assert parts.steps[0][0][1:] == (0, 4) and sum(e - b for _, b, e in parts.steps[0]) == 16  # short first
    assert [b for step in parts.steps for slot, b, _ in step if slot == 0][:2] == [0, 12]  # the oldest, in order
    for c, prompt in zip(cols, (LONG[0], LONG[2], PROMPTS[0])):
        assert c.ids == hf_greedy(hf, prompt, 4)


def test_on_ragged_stages_a_request_cancelled_mid_prefill_lets_its_row_go(model, hf, monkeypatch):
    """Cancelled after the first part of its prompt rode a step: no output follows, its row leaves the joining
    prompts and its sampling row is inactive, and the engine serves the next request (HF's tokens)."""
    stage = model.stages.stages[0]
    e = Engine(model, start=False, prefill_chunk=8)
    long, after = Collect(e), Collect(e)
    real = model._block

    def block(parts):
        if any(p.joining.tokens == LONG[2] and p.start == 0 for p in parts):
            e.cancel(long.req)  # (its first part is in this step)
        return real(parts)
    monkeypatch.setattr(model, "_block", block)
    long.req = e.submit(LONG[2], SlotSettings(max_tokens=4), long)
    after.req = e.submit(LONG[0], SlotSettings(max_tokens=4), after)
    e.start()
    try:
        assert after.done.wait(120)
    finally:
        e.close()
    assert long.tokens == [] and long.finish is None and long.req.done
    assert not model.joins.waiting(0) and not np.asarray(stage.sampler.active[0]).any()
    assert after.ids == hf_greedy(hf, LONG[0], 4)


def test_the_engine_counts_where_its_time_goes(model):
    """Its statistics: a joined prompt's tokens counted as computed in decode steps, a scored one's in a prefill
    pass; every decode step's KV entries (a row of n prompt tokens attends over n, n + 1, ... entries); each
    request's wait for its first computation and the gaps between steps; the model's costs a token."""
    e = Engine(model, prefill_chunk=32, decode_steps=1)
    try:
        before = e.stats()
        run_all(e, [(PROMPTS[1], SlotSettings(max_tokens=5))])
        mid = e.stats()
        run_all(e, [(PROMPTS[3], SlotSettings(max_tokens=1, prompt_logprobs=True))])
        after = e.stats()
    finally:
        e.close()
    n, m = len(PROMPTS[1]), 5
    assert (mid.joined_tokens - before.joined_tokens, mid.steps - before.steps) == (n, m)
    assert mid.decode_kv_entries - before.decode_kv_entries == m * n + m * (m - 1) // 2
    assert mid.decode_s > before.decode_s and mid.prefill_passes == before.prefill_passes
    assert mid.queue_wait.count - before.queue_wait.count == 1
    assert mid.decode_gap.count - before.decode_gap.count == m - 1
    assert after.computed_tokens - mid.computed_tokens == len(PROMPTS[3])  # scored: a pass of its own
    assert after.prefill_passes == mid.prefill_passes + 1 and after.prefill_s > mid.prefill_s
    assert after.costs["dense_flops"] == 2 * CFG.num_hidden_layers * (4 * 32 * 32 + 2 * 32 * 64)
    assert after.costs["kv_entry_bytes"] == 2 * CFG.num_hidden_layers * CFG.hidden_size * 4  # float32


def test_warmup_compiles_the_chunked_prefill(model):
    """Every shape a chunked prefill uses (its step at every cache size a longer prompt has, its first
    token, its cache into every window), beside whole prefills, is compiled by the engine's warm-up."""
    stage = model.stages.stages[0]
    s = stage.sampler
    e = Engine(model, start=False, prefill_chunk=8)
    e.warmup()
    e.start()
    try:
        with xla_compiles() as asked:
            run_all(e, [(p, SlotSettings(max_tokens=32 - len(p), temperature=0.5, seed=1))
                        for p in LONG + [[2] * 9, [2, 5, 6], [2] * 12]])
    finally:
        e.close()
    assert asked == []
    assert stage._chunk.warmed and s._chunked_first.warmed  # (the chunked prefill compiled: a prompt is longer than 8)


def test_the_prefill_chunk_option_reaches_the_engine(monkeypatch):
    """load_engine / load_generator (`opt-serving batch --prefill-chunk`, ServeArgs.prefill_chunk) set it:
    admission.PREFILL_CHUNK by default, 0 for whole prefills; a slot model without chunked prefill gets whole ones."""
    import argparse
    from opt_serving.engine.admission import PREFILL_CHUNK
    from opt_serving import batch
    from opt_serving.text import loading
    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.service import deployment
    from opt_serving.service.deployment import ServeArgs, build_generator
    from opt_serving.engine.fake import FakeSlots
    folder = ensure_embedded_model()
    for chunk, want in ((None, PREFILL_CHUNK), (0, None), (64, 64)):
        kw = {} if chunk is None else {"prefill_chunk": chunk}
        e = loading.load_engine("jax/opt-tiny", folder, num_slots=2, max_seq_len=16, warmup=False, **kw)
        e.close()
        assert e.prefill_chunk == want
    parser = argparse.ArgumentParser()
    batch.add_arguments(parser)
    files = ["--input", "in.jsonl", "--output", "out.jsonl"]
    assert parser.parse_args(files).prefill_chunk == PREFILL_CHUNK
    assert parser.parse_args(files + ["--prefill-chunk", "0"]).prefill_chunk == 0
    seen = {}
    monkeypatch.setattr(deployment, "load_generator", lambda *a, **kw: seen.update(kw))
    build_generator(ServeArgs(prefill_chunk="32"))
    assert seen["prefill_chunk"] == 32
    assert Engine(FakeSlots(), start=False, prefill_chunk=8).prefill_chunk is None


def test_the_prefix_caching_option_reaches_the_slot_model(monkeypatch):
    """Prefix caching is on by default (load_engine, `serve`, `batch`, ServeArgs) and `--no-prefix-caching`
    (prefix_caching=False) turns it off: the slot model then has no prefix cache and its stages no pool."""
    import argparse
    from opt_serving import batch
    from opt_serving.text import loading
    from opt_serving.model.embedded import ensure_embedded_model
    folder = ensure_embedded_model()
    for kw, on in (({}, True), ({"prefix_caching": False}, False)):
        e = loading.load_engine("jax/opt-tiny", folder, num_slots=2, max_seq_len=64, warmup=False, **kw)
        e.close()
        assert (e.model.prefix is not None, e.model.stages.stages[0].pool is not None) == (on, on)
    parser = argparse.ArgumentParser()
    batch.add_arguments(parser)
    files = ["--input", "in.jsonl", "--output", "out.jsonl"]
    assert parser.parse_args(files).prefix_caching is True
    assert parser.parse_args(files + ["--no-prefix-caching"]).prefix_caching is False
    assert_serve_switch_reaches_the_generator(monkeypatch, "prefix_caching", "--no-prefix-caching")


def test_calls_sent_ahead_are_off_by_default_and_the_serve_switch_reaches_the_engine(monkeypatch):
    """`serve --engine-ahead` (ServeArgs engine_ahead) reaches load_generator's `ahead`, off by default; load_engine
    hands it to the Engine."""
    from opt_serving.text import loading
    from opt_serving.model.embedded import ensure_embedded_model
    folder = ensure_embedded_model()
    for kw, on in (({}, False), ({"ahead": True}, True)):
        e = loading.load_engine("jax/opt-tiny", folder, num_slots=2, max_seq_len=64, warmup=False, **kw)
        e.close()
        assert e.ahead is on
    assert_serve_switch_reaches_the_generator(monkeypatch, "engine_ahead", "--engine-ahead", default=False,
                                              arg="ahead")


def test_the_warmup_option_reaches_the_generator(monkeypatch):
    """Warm-up is on by default (`serve`, ServeArgs); `--no-warmup` (warmup=False) reaches load_generator."""
    assert_serve_switch_reaches_the_generator(monkeypatch, "warmup", "--no-warmup")


def assert_serve_switch_reaches_the_generator(monkeypatch, field: str, flag: str, default: bool = True,
                                              arg: Optional[str] = None):
    """ServeArgs' `field` (load_generator's `arg`, by default the same name), `default` unless `flag` is given:
    `serve`'s command line without and with `flag`, and the builder's argument left out and given as the other
    value in words (`serve run ... field=false`, serve_config.yaml), each reach load_generator."""
    from opt_serving.cli import build_parser
    from opt_serving.service import deployment
    from opt_serving.service.cli_args import serve_args_from
    from opt_serving.service.deployment import ServeArgs, build_generator
    serve, _ = build_parser("serve")
    assert getattr(serve_args_from(serve.parse_args(["serve"])), field) is default
    assert getattr(serve_args_from(serve.parse_args(["serve", flag])), field) is (not default)
    seen = {}
    monkeypatch.setattr(deployment, "load_generator", lambda *a, **kw: seen.update(kw))
    build_generator(ServeArgs())
    assert seen[arg or field] is default
    build_generator(ServeArgs(**{field: str(not default).lower()}))
    assert seen[arg or field] is (not default)


def test_prefill_widths_pad_long_prompts_by_at_most_a_quarter():
    from opt_serving.runner.buckets import cache_bucket, cache_buckets, prefill_bucket, prefill_buckets
    assert prefill_buckets(1024) == [8, 16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                                     640, 768, 896, 1024]
    assert prefill_buckets(MAX_SEQ) == [8, 16, 32] and prefill_buckets(100) == [8, 16, 32, 64, 80, 96, 100]
    assert [prefill_bucket(n, 1024) for n in (1, 9, 65, 97, 300, 513, 1024)] == [8, 16, 80, 112, 320, 640, 1024]
    # a prompt's cache is cut more coarsely: every size compiles an insert into every window
    assert cache_buckets(1024) == [8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert [cache_bucket(b, 1024) for b in (80, 112, 320, 448, 640, 896)] == [96, 128, 384, 512, 768, 1024]
    with pytest.raises(ValueError, match="does not fit"):
        prefill_bucket(1025, 1024)


def test_prompts_at_the_finer_widths_give_hf_tokens_with_no_new_insert_compiled():
    """Prompts of 70 and 100 tokens are computed at widths 80 and 112 and kept in caches of 96 and 128
    entries: after warm-up neither compiles anything (no insert per width), and both get HF's tokens."""
    cfg = CFG.replace(max_position_embeddings=160)
    torch.manual_seed(1)
    ref = transformers.OPTForCausalLM(transformers.OPTConfig(**{**cfg.to_hf_dict(), "init_std": 0.3})).eval()
    slots = OPTSlots(cfg, weights.params_from_hf_state_dict(cfg, ref.state_dict()), num_slots=2, max_seq_len=160)
    slots.warmup()
    stage = slots.stages.stages[0]
    prompts = [[2] + [(7 * i) % 120 + 4 for i in range(69)], [2] + [(11 * i) % 120 + 4 for i in range(99)]]
    sizes = []
    for prompt in prompts:
        prefix = slots.prefill(prompt, SlotSettings())
        sizes.append(stage.pending[prefix.state]["mask"].shape[1])
        slots.discard(prefix)
    assert sizes == [96, 128]
    e = Engine(slots)
    try:
        with xla_compiles() as asked:
            got = [Collect() for _ in prompts]
            for c, prompt in zip(got, prompts):
                e.submit(prompt, SlotSettings(max_tokens=5), c)
            for c in got:
                assert c.done.wait(60)
    finally:
        e.close()
    assert [c.ids for c in got] == [hf_greedy(ref, p, 5) for p in prompts]
    assert asked == []

class Sizes(Collect):
    """Collect, also keeping how many tokens each output carried."""

    def __init__(self, engine=None):
        super().__init__(engine)
        self.sizes = []

    def __call__(self, out):
        if not out.is_prompt:
            self.sizes.append(len(out.tokens))
        super().__call__(out)


@pytest.mark.parametrize("slots", ["model", "model8", "xla_model8"])
def test_decode_steps_in_one_call_give_the_single_steps_tokens(slots, hf, monkeypatch, request):
    """Four decode steps a call: greedy gives HF's tokens; seeded sampling, a penalty, a stop token and the
    scores are the single-step engine's; a request whose max_tokens or stop token comes in the middle of a
    call ends there; each output carries a call's tokens (at most four); a request near the context's end
    (26 + 6 tokens of 32) takes single steps there. On eight slots, calls with at most four rows running
    compute only those (DecodeStep.rows), the sampled rows' state taken out and put back: on the CPU's ragged
    steps and on plain XLA's (a GPU's), whose steps read only those rows of the cache."""
    model = request.getfixturevalue(slots)
    stage = model.stages.stages[0]
    computed = []
    real_steps = stage.send_steps
    monkeypatch.setattr(stage, "send_steps", lambda x, step: (computed.append(step.rows), real_steps(x, step))[1])
    stop_at = hf_greedy(hf, PROMPTS[2], 14)
    stop = next(t for i, t in enumerate(stop_at) if i >= 4 and t not in stop_at[:i])
    jobs = [(PROMPTS[0], SlotSettings(max_tokens=10)),
            (PROMPTS[1], SlotSettings(max_tokens=9, temperature=0.8, seed=3, top_p=0.9, logprob=True,
                                      top_logprobs=True)),
            (PROMPTS[3], SlotSettings(max_tokens=20, repetition_penalty=1.4, logprob=True)),
            (PROMPTS[2], SlotSettings(max_tokens=14, stop_token_ids=(stop,))),
            ([2] + [7] * 25, SlotSettings(max_tokens=6)),
            (PROMPTS[4], SlotSettings(max_tokens=19, temperature=1.2, seed=9))]  # (these two: several calls of 4)
    calls = []
    real = model.step_many
    monkeypatch.setattr(model, "step_many", lambda n: (calls.append(n), real(n))[1])

    stats = {}

    def run(steps):
        e = Engine(model, decode_steps=steps, decode_call_s=3600)  # (whatever the load)
        try:
            return run_all(e, jobs, Sizes)
        finally:
            stats[steps] = e.stats()
            e.close()

    one, four = run(1), run(4)
    assert calls and set(calls) == {4}
    # the calls are counted apart from the steps: one a step alone, one per four steps together (a step_many
    # that could not take four took one)
    assert stats[1].step_calls == stats[1].steps
    extra = stats[4].steps - stats[4].step_calls
    assert 0 < extra <= 3 * len(calls) and extra % 3 == 0
    calls.clear()
    e = Engine(model, decode_steps=4, decode_call_s=0.0)  # four steps would take longer than that: one a call
    try:
        assert [c.ids for c in run_all(e, jobs)] == [c.ids for c in one] and not calls
    finally:
        e.close()
    for a, b in zip(one, four):
        assert (b.ids, b.finish) == (a.ids, a.finish)
        np.testing.assert_allclose([t.logprob or 0.0 for t in b.tokens], [t.logprob or 0.0 for t in a.tokens],
                                   rtol=1e-5, atol=1e-5)
        assert [[i for i, _ in t.top] for t in b.tokens] == [[i for i, _ in t.top] for t in a.tokens]
        assert max(b.sizes) <= 4 and max(a.sizes) == 1 and sum(b.sizes) == len(b.ids)
    assert any(size > 1 for c in four for size in c.sizes)
    assert four[0].ids == hf_greedy(hf, PROMPTS[0], 10) and four[4].ids == hf_greedy(hf, jobs[4][0], 6)
    compact = [len(r) for r in computed if r is not None]
    assert compact == [] if slots == "model" else (compact and set(compact) == {4} and len(compact) < len(computed))
    assert (four[3].finish, four[3].ids[-1]) == ("stop", stop) and len(four[3].ids) == stop_at.index(stop) + 1
    assert four[4].finish == "length" and len(four[4].ids) == 6


@pytest.mark.parametrize("slots", ["model8", "xla_model8"])
def test_calls_sent_ahead_give_the_single_steps_tokens_with_requests_leaving_and_waiting(slots, monkeypatch, request):
    """Engine(ahead=True): each call of four steps is sent before the one in flight is read. Twelve requests on
    eight slots (four wait for slots freed while calls are in flight; one is cancelled by its callback mid-run;
    sampled, penalised, scored and stop-token rows among them) get the single-step engine's tokens and scores, and
    calls were sent with another in flight."""
    model = request.getfixturevalue(slots)
    sends = []
    real = model.send_many
    monkeypatch.setattr(model, "send_many", lambda n: (sends.append(model.calls_in_flight), real(n))[1])
    lengths = [6, 12, 18, 15, 18, 21, 10, 27]  # (each within the context of 32 with its prompt)
    jobs = [(PROMPTS[i % 5] + [30 + i], SlotSettings(max_tokens=m)) for i, m in enumerate(lengths)]
    jobs[1] = (jobs[1][0], SlotSettings(max_tokens=12, temperature=0.8, seed=3, top_p=0.9, logprob=True,
                                        top_logprobs=True))
    jobs[2] = (jobs[2][0], SlotSettings(max_tokens=18, repetition_penalty=1.4, logprob=True))
    jobs += [([2, 7 + i, 8, 9], SlotSettings(max_tokens=10 + i)) for i in range(4)]  # (these wait for slots)

    class StopsAt(Collect):  # a callback that stops its request after 5 tokens (a client gone mid-stream)
        def __call__(self, out):
            super().__call__(out)
            if len(self.tokens) >= 5:
                self.done.set()
                return True

    def run(ahead, steps):
        e = Engine(model, decode_steps=steps, decode_call_s=3600, ahead=ahead)
        try:
            cols = []
            for i, (prompt, settings) in enumerate(jobs):  # all at once: four wait in the queue
                c = (StopsAt if i == 3 else Collect)(e)
                c.req = e.submit(prompt, settings, c)
                cols.append(c)
            for c in cols:
                assert c.done.wait(120), "request did not finish"
            return cols
        finally:
            e.close()

    one, ahead = run(False, 1), run(True, 4)
    ids = lambda cols: [c.ids[:5] if i == 3 else c.ids for i, c in enumerate(cols)]  # noqa: E731
    assert ids(ahead) == ids(one) and [c.finish for c in ahead] == [c.finish for c in one]
    for a, b in zip(one[:3] + one[4:], ahead[:3] + ahead[4:]):
        np.testing.assert_allclose([t.logprob or 0.0 for t in b.tokens], [t.logprob or 0.0 for t in a.tokens],
                                   rtol=1e-5, atol=1e-5)
        assert [[i for i, _ in t.top] for t in b.tokens] == [[i for i, _ in t.top] for t in a.tokens]
    assert any(n > 0 for n in sends)  # calls went with one in flight
    assert model.calls_in_flight == 0


def test_while_calls_are_in_flight_only_frees_change_the_slots(model8):
    """Slots.send_many / take_many: two calls sent before either is read give the tokens two step_many calls
    give; a slot freed while they are in flight takes none of theirs; an insert or a single step meanwhile is
    refused, saying the calls must be taken first; abandoned calls leave nothing behind."""
    greedy = SlotSettings(max_tokens=20)

    def fill():
        for slot in range(8):
            if model8.table.lengths[slot]:
                model8.free(slot)
        for slot, prompt in enumerate(PROMPTS[:3]):
            model8.insert(model8.prefill(prompt, greedy), slot)

    fill()
    want = [r.tokens[:3].tolist() for r in model8.step_many(4) + model8.step_many(4)]
    fill()
    assert model8.send_many(4) is not None and model8.send_many(4) is not None and model8.calls_in_flight == 2
    model8.free(1)
    with pytest.raises(RuntimeError, match="take them first"):
        model8.insert(model8.prefill(PROMPTS[4], greedy), 1)
    with pytest.raises(RuntimeError, match="take them first"):
        model8.step()
    got = model8.take_many() + model8.take_many()
    assert [r.tokens[[0, 2]].tolist() for r in got] == [[t[0], t[2]] for t in want]
    assert all(r.rows[[0, 2]].all() and not r.rows[1] for r in got)  # the freed slot took none
    assert model8.calls_in_flight == 0 and model8.table.lengths[1] == 0
    model8.insert(model8.prefill(PROMPTS[4], greedy), 1)  # (taken: inserts go again)
    assert model8.send_many(4) is not None
    model8.abandon_many()  # (a failed step's calls: forgotten, and the stage keeps none of their outputs)
    assert model8.calls_in_flight == 0 and not model8.stages.stages[0]._sent
    for slot in range(3):
        model8.free(slot)


def test_a_slot_model_with_only_the_required_methods_is_served_and_never_asked_for_an_ability_it_lacks():
    """runner.types.SlotModel: the five abstract methods are all a slot model needs; with chunked prefill, several
    decode steps a call and a batch of prompts asked of the engine, one that declares no ability is served
    through prefill / insert / step / free alone (its undeclared methods raise NotImplementedError if called),
    and one missing a required method cannot be made."""
    from opt_serving.engine.scheduler import Prefix, SlotModel, StepResult, TokenInfo

    class Plain(SlotModel):
        """Each token is the last one + 1."""
        def __init__(self):
            self.num_slots, self.max_seq_len, self.vocab_size = 2, 64, 100
            self.last, self.calls = [None] * 2, []

        def warmup(self, prefill_chunk=None, decode_steps=1, every_shape=True):
            self.calls.append(("warmup", prefill_chunk, decode_steps, every_shape))

        def prefill(self, tokens, settings):
            self.calls.append("prefill")
            return Prefix(length=len(tokens), first=TokenInfo(tokens[-1] + 1, 0.0), prompt=None, state=None,
                          settings=settings)

        def insert(self, prefix, slot):
            self.last[slot] = prefix.first.id

        def step(self):
            self.calls.append("step")
            toks = np.array([0 if t is None else t + 1 for t in self.last], np.int32)
            self.last = [None if t is None else int(x) for t, x in zip(self.last, toks)]
            return StepResult(toks, np.zeros(2, np.float32), np.full((2, MAX_TOP_LOGPROBS), -1, np.int32),
                              np.zeros((2, MAX_TOP_LOGPROBS), np.float32))

        def free(self, slot):
            self.last[slot] = None

    model = Plain()
    e = Engine(model, start=False, prefill_chunk=4, decode_steps=4)
    e.warmup()
    assert model.calls == [("warmup", None, 1, True)]  # no chunked prefill, no step_many: nothing of theirs compiled
    e.start()
    try:
        outs = [[], [], []]
        done = [threading.Event() for _ in outs]

        def on(i):
            def cb(out):
                outs[i].extend(t.id for t in out.tokens)
                if out.finish_reason:
                    done[i].set()
            return cb
        for i, prompt in enumerate([[5, 6, 7, 8, 9, 10, 11], [20], [40, 41]]):  # the first is longer than a chunk
            e.submit(prompt, SlotSettings(max_tokens=5), on(i))
        assert all(d.wait(60) for d in done)
    finally:
        e.close()
    assert outs == [[12, 13, 14, 15, 16], [21, 22, 23, 24, 25], [42, 43, 44, 45, 46]]
    with pytest.raises(NotImplementedError, match="Plain has no chunked_prefill"):
        model.prefill_chunk(None)

    class Incomplete(SlotModel):
        def warmup(self, prefill_chunk=None, decode_steps=1): ...

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()

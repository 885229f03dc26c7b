"""Served speculative decoding with a draft model (runner/draft.py): the engine's tokens with a draft model
against the same engine without one, on random tiny OPTs: a draft that is the target itself (every draft lands),
one with other weights (most miss: the draft's cache is cut back after each), and the rule pricing the draft's
calls."""
import dataclasses

import numpy as np
import pytest
import torch
import transformers

from opt_serving.config import OPTConfig, SpeculativeConfig
from opt_serving.engine.scheduler import Engine, OPTSlots, SlotSettings
from opt_serving.model import weights
from opt_serving.model.wrapper import OPTModel
from opt_serving.runner.draft import WIDTHS, ModelSpeculation
from opt_serving.runner.generate import Generation
from conftest import run_jobs, xla_compiles

CFG = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                max_position_embeddings=128)
MAX_SEQ = 112
DRAFT = SpeculativeConfig.parse({"model": "opt-tiny", "num_speculative_tokens": 4})
GREEDY = SlotSettings(max_tokens=30, logprob=False, top_logprobs=False)
PROMPTS = [[2, 54, 17, 99], [2, 26, 62, 29, 93, 62], [2, 73, 5], [2, 12, 120, 12, 115, 49, 122]]


def params_of(seed: int, cfg=CFG):
    torch.manual_seed(seed)
    hf = transformers.OPTForCausalLM(transformers.OPTConfig(**{**cfg.to_hf_dict(), "init_std": 0.3})).eval()
    return weights.params_from_hf_state_dict(cfg, hf.state_dict())


@pytest.fixture(scope="module")
def target():
    return params_of(0)


def engine_of(params, draft_params=None, decode_steps: int = 1) -> Engine:
    m = OPTSlots(CFG, params, num_slots=4, max_seq_len=MAX_SEQ)
    if draft_params is not None:
        m.use_speculation(DRAFT, Generation.of(OPTModel(CFG, draft_params)))
        m.spec.adaptive = False  # (a tiny model's steps cost the host's time: drafts ride whatever they cost)
    e = Engine(m, start=False, decode_steps=decode_steps)
    e.warmup()
    e.start()
    return e


@pytest.fixture(scope="module")
def plain(target):
    e = engine_of(target)
    yield e
    e.close()


@pytest.fixture(scope="module")
def agreeing(target):
    e = engine_of(target, target)  # the target as its own draft: every draft is the target's token
    yield e
    e.close()


@pytest.fixture(scope="module")
def other(target):
    e = engine_of(target, params_of(1))  # another model's drafts: most are refused
    yield e
    e.close()


def delta(engine, before):
    after = engine.stats()
    return (after.steps - before.steps, after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens)


def test_a_draft_that_is_the_target_has_every_draft_kept(plain, agreeing):
    jobs = [(p, GREEDY) for p in PROMPTS]
    before = agreeing.stats()
    got = run_jobs(agreeing, jobs)
    steps, drafted, accepted = delta(agreeing, before)
    assert got == run_jobs(plain, jobs)
    assert drafted > 40 and accepted == drafted
    generated = sum(len(t) for t, _ in got)
    assert steps < generated / len(jobs) / 2  # (up to 5 tokens a step for each row)
    assert agreeing.model.spec.keys == {}  # each request's draft cache closed with it


def test_a_draft_that_disagrees_is_cut_back_and_the_tokens_stay_the_target_s(plain, other):
    jobs = [(p, GREEDY) for p in PROMPTS]
    before = other.stats()
    got = run_jobs(other, jobs)
    steps, drafted, accepted = delta(other, before)
    assert got == run_jobs(plain, jobs)
    assert drafted > 0 and accepted < drafted  # drafts were refused, and the draft's cache went on from there


def test_sampled_and_scored_rows_beside_drafting_ones_get_plain_decoding_s_tokens(plain, agreeing, other):
    def sampled(seed, **more):
        return SlotSettings(**{**GREEDY.__dict__, "temperature": 0.7, "top_p": 0.95, "seed": seed, **more})
    scored = SlotSettings(max_tokens=20, logprob=True, top_logprobs=False)
    jobs = [(PROMPTS[0], sampled(1)), (PROMPTS[1], sampled(2, top_k=8)), (PROMPTS[2], scored),
            (PROMPTS[3], GREEDY), (PROMPTS[0], sampled(4, min_tokens=25))]
    want = run_jobs(plain, jobs)
    for engine in (agreeing, other):
        before = engine.stats()
        assert run_jobs(engine, jobs) == want
        assert delta(engine, before)[2] > 0


def test_long_prompts_reach_the_draft_a_chunk_at_a_time(plain, agreeing):
    long = [2] + [int(t) for t in np.random.default_rng(0).integers(4, 128, WIDTHS[-1] + 10)]
    jobs = [(long, GREEDY), (PROMPTS[0], GREEDY)]
    before = agreeing.stats()
    assert run_jobs(agreeing, jobs) == run_jobs(plain, jobs)
    _, drafted, accepted = delta(agreeing, before)
    assert accepted == drafted > 0


def test_several_steps_a_call_and_drafts(target, plain):
    e = engine_of(target, target, decode_steps=4)
    try:
        jobs = [(p, GREEDY) for p in PROMPTS[:2]]
        assert run_jobs(e, jobs) == run_jobs(plain, jobs)
        assert e.stats().spec_accepted_tokens > 0
    finally:
        e.close()


def test_warmup_compiled_the_draft_model_s_calls(agreeing):
    with xla_compiles() as asked:
        run_jobs(agreeing, [(p, GREEDY) for p in PROMPTS])
    assert asked == []


def test_the_rule_prices_the_draft_s_calls():
    """Drafts that would all land pay while a draft call is cheap; priced at a step's time each, they do not, and
    the draft model is not called."""
    class Draft:
        config = CFG
        calls = 0

        def _open(self, *a):
            Draft.calls += 1
            raise AssertionError("the draft model was called")
    s = ModelSpeculation(DRAFT, 2, MAX_SEQ, (8, 16, 32), Draft())
    s.start(0, [5, 6, 7], GREEDY)
    s.observe_step(8, False, 0.030)
    s.observe_step(8, True, 0.031)
    s.t_call = 0.030
    assert s.plan([(0, 0, 3)], tokens=1, room=100, max_seq_len=MAX_SEQ) == [] and Draft.calls == 0
    s.t_call = 0.001
    with pytest.raises(AssertionError, match="draft model was called"):
        s.plan([(0, 0, 3)], tokens=1, room=100, max_seq_len=MAX_SEQ)


def test_a_draft_with_another_vocabulary_is_refused(target):
    small = dataclasses.replace(CFG, vocab_size=64)
    m = OPTSlots(CFG, target, num_slots=2, max_seq_len=MAX_SEQ)
    try:
        with pytest.raises(ValueError, match=r"draft model's vocabulary \(64 tokens\) is not the target's \(128\)"):
            m.use_speculation(DRAFT, Generation.of(OPTModel(small, params_of(2, small))))
    finally:
        m.close()


def test_after_a_refused_draft_the_draft_model_drafts_as_if_fed_afresh(target):
    """The row's history parts from what its draft cache was fed (the target refused the second draft, then made
    a token more): the drafts that follow are a fresh cache's over the same history, the refused entries written
    over."""
    draft = Generation.of(OPTModel(CFG, target))
    fresh = lambda: ModelSpeculation(DRAFT, 1, MAX_SEQ, (8, 16, 32), draft)  # noqa: E731
    s = fresh()
    s.start(0, PROMPTS[3], GREEDY)
    first = s._draft(0, 4)
    refused = (first[1] + 1) % CFG.vocab_size  # the target's token in place of the second draft
    s.extend(0, [first[0], refused, 7])
    history = PROMPTS[3] + [first[0], refused, 7]
    again = fresh()
    again.start(0, history, GREEDY)
    assert s._draft(0, 4) == again._draft(0, 4)
    assert s.done[0] == len(history) + 3 and s.fed[0, len(PROMPTS[3]) + 1] == refused


def test_pipeline_stages_check_a_draft_model_s_drafts_as_one_device_does(target, plain):
    """The target as two stages in this process, its slots in two micro-batch groups; the draft model on one
    device beside them: drafts ride through both stages and the last one checks them."""
    from opt_serving.model import param_tree
    from opt_serving.parallel.stage_weights import stage_specs
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.stage import LocalStages, StageSlots
    stages = [StageSlots(CFG, param_tree.stage_params(target, s), s, 2, 2, MAX_SEQ) for s in stage_specs(CFG, 2)]
    piped = Slots(CFG, LocalStages(stages), 4, 2, MAX_SEQ)
    piped.use_speculation(DRAFT, Generation.of(OPTModel(CFG, target)))
    piped.spec.adaptive = False
    e = Engine(piped)
    try:
        jobs = [(p, GREEDY) for p in PROMPTS]
        assert run_jobs(e, jobs) == run_jobs(plain, jobs)
        stats = e.stats()
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 10
    finally:
        e.close()

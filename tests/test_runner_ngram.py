"""Served speculative decoding by prompt lookup (runner/ngram.py): the lookup, the rule that decides what drafts a
step takes, and the engine's tokens with it on, against the same engine without it, on a random tiny OPT."""

import numpy as np
import pytest
import torch
import transformers

from opt_serving.config import OPTConfig, SpeculativeConfig
from opt_serving.engine.scheduler import Engine, OPTSlots, SlotSettings
from opt_serving.model import weights
from opt_serving.runner import ngram
from opt_serving.runner.ngram import MIN_RATE, PROBE_EVERY, NgramSpeculation, lookup
from conftest import run_jobs, xla_compiles, xla_slots

CFG = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                max_position_embeddings=64)
MAX_SEQ = 48
NGRAM = SpeculativeConfig.parse({"num_speculative_tokens": 4})
GREEDY = SlotSettings(max_tokens=30, logprob=False, top_logprobs=False)  # (no scores asked: rows that draft)


def test_lookup_takes_what_followed_the_longest_suffix_seen_before():
    h = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert lookup(h, 4, 3, 1) == [4, 5, 9, 1]
    # "2 3" was seen, "4 2 3" was not: the 2-gram's continuation, cut where the text ends
    assert lookup(np.array([1, 2, 3, 4, 2, 3]), 4, 3, 1) == [4, 2, 3]
    assert lookup(np.array([5, 6, 7]), 3, 3, 1) == []
    # prompt_lookup_min: a 1-gram match is not taken when at least 2 tokens must match
    assert lookup(np.array([8, 1, 2, 9, 2]), 2, 3, 1) == [9, 2] and lookup(np.array([8, 1, 2, 9, 2]), 2, 3, 2) == []
    # of several matches, the latest with k tokens after it (not one whose continuation runs into the end)
    assert lookup(np.array([7, 1, 2, 7, 3, 4, 5, 7]), 3, 1, 1) == [3, 4, 5]
    assert lookup(np.array([7, 7, 7, 7, 7]), 2, 3, 1) == [7, 7]


def spec_rows(slots=4, sizes=(8, 16, 32)) -> NgramSpeculation:
    s = NgramSpeculation(NGRAM, slots, MAX_SEQ, sizes)
    for slot in range(slots):
        s.start(slot, [5, 6, 7, 8, 5, 6], GREEDY)  # "5 6" seen before: drafts 7 8 5 6
    return s


def test_drafts_ride_where_the_step_costs_what_it_would_anyway():
    s = spec_rows()
    s.observe_step(8, False, 0.030)
    s.observe_step(8, True, 0.031)
    s.observe_step(16, False, 0.060)
    drafts = s.plan([(0, 0, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ)
    assert [(d.slot, d.tokens) for d in drafts] == [(0, (7, 8, 5, 6))]
    # two rows: 1 + 1 + 8 drafts would need a block of 16, twice the time, for ~2 expected tokens more
    drafts = s.plan([(0, 0, 6), (1, 1, 6)], tokens=2, room=100, max_seq_len=MAX_SEQ)
    assert sum(len(d.tokens) for d in drafts) == 6  # the block of 8 holds 6 drafts beside the rows' tokens


def test_no_drafts_where_they_cannot_pay(monkeypatch):
    s = spec_rows()
    s.observe_step(8, False, 0.010)
    s.observe_step(8, True, 0.060)  # a check costing 6 steps: even 4 drafts that all land lose
    looked = []
    monkeypatch.setattr(ngram, "lookup", lambda *a: looked.append(a) or [7, 8, 5, 6])
    assert s.plan([(0, 0, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ) == []
    assert looked == []  # decided before any lookup
    s.adaptive = False
    assert len(s.plan([(0, 0, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ)[0].tokens) == 4
    s.adaptive = True
    # a step past SPEC_MAX_BLOCK never carries drafts; nor one without room
    assert s.plan([(0, 0, 6)], tokens=ngram.SPEC_MAX_BLOCK + 1, room=100, max_seq_len=MAX_SEQ) == []
    assert s.plan([(0, 0, 6)], tokens=1, room=0, max_seq_len=MAX_SEQ) == []


def test_drafts_stay_in_the_context_and_in_the_check():
    s = spec_rows()
    s.observe_step(8, False, 0.030)
    s.observe_step(8, True, 0.030)
    s.observe_step(16, False, 0.030)
    s.observe_step(16, True, 0.030)
    (d,) = s.plan([(0, 0, MAX_SEQ - 2)], tokens=1, room=100, max_seq_len=MAX_SEQ)
    assert len(d.tokens) == 2  # entries MAX_SEQ - 2 and MAX_SEQ - 1: the last the context has
    drafts = s.plan([(i, i, 6) for i in range(4)], tokens=4, room=100, max_seq_len=MAX_SEQ)
    assert sum(len(d.tokens) for d in drafts) == s.verify_rows < 4 * 4


def test_a_rows_rate_is_its_drafts_kept_over_those_tested():
    """Drafts each kept with probability 0.85 until the first miss: the row's rate reads 0.85, where a mean of
    each step's kept / tested read about 0.73."""
    s, rng, rates = spec_rows(), np.random.default_rng(1), []
    for _ in range(4000):
        s.observe_row(0, 4, next((i for i in range(4) if rng.random() >= 0.85), 4))
        rates.append(s.rate[0])
    assert abs(np.mean(rates[100:]) - 0.85) < 0.02, np.mean(rates[100:])


def test_a_row_whose_drafts_miss_only_probes():
    s = spec_rows()
    s.observe_step(8, False, 0.030)
    s.observe_step(8, True, 0.030)
    for _ in range(6):
        s.observe_row(0, 4, 0)
    assert s.rate[0] < MIN_RATE
    taken = [len(s.plan([(0, 0, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ)) for _ in range(2 * PROBE_EVERY)]
    assert taken == ([0] * (PROBE_EVERY - 1) + [1]) * 2
    probe = s.plan([(0, 0, 6)] * 0 + [(1, 1, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ)
    assert len(probe[0].tokens) == 4  # (another row, still trusted, drafts in full)


def test_greedy_and_sampled_rows_draft_scored_penalised_or_constrained_ones_do_not():
    for drafting in (dict(), dict(min_tokens=5), dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=4)):
        assert ngram.may_draft(SlotSettings(**{**GREEDY.__dict__, **drafting})), drafting
    for other in (dict(logprob=True), dict(top_logprobs=True),
                  dict(repetition_penalty=1.2), dict(grammar='{"x": 1}'), dict(logit_bias=((3, 1.0),)),
                  dict(bad_words_ids=((3,),)), dict(no_repeat_ngram_size=2), dict(presence_penalty=0.5),
                  dict(temperature=0.7, frequency_penalty=0.5)):
        assert not ngram.may_draft(SlotSettings(**{**GREEDY.__dict__, **other})), other


# ---- the engine with speculation, against the same engine without ----

@pytest.fixture(scope="module")
def params():
    torch.manual_seed(0)
    # a wide init: decisive argmaxes, and greedy text that soon repeats itself (what prompt lookup drafts from)
    hf = transformers.OPTForCausalLM(transformers.OPTConfig(**{**CFG.to_hf_dict(), "init_std": 0.3})).eval()
    return weights.params_from_hf_state_dict(CFG, hf.state_dict())


def engine_of(params, speculative: bool, decode_steps: int = 1) -> Engine:
    m = OPTSlots(CFG, params, num_slots=4, max_seq_len=MAX_SEQ)
    if speculative:
        m.use_speculation(NGRAM)
        m.spec.adaptive = False  # (a tiny model's steps cost the host's time: drafts ride whatever they cost)
    e = Engine(m, start=False, decode_steps=decode_steps)
    e.warmup()
    e.start()
    return e


@pytest.fixture(scope="module")
def plain(params):
    e = engine_of(params, False)
    yield e
    e.close()


@pytest.fixture(scope="module")
def drafting(params):
    e = engine_of(params, True)
    yield e
    e.close()


PROMPTS = [[2, 54, 17, 99], [2, 26, 62, 29, 93, 62], [2, 73, 5], [2, 12, 120, 12, 115, 49, 122]]


def test_greedy_tokens_are_plain_decoding_s_in_fewer_steps(plain, drafting):
    jobs = [(p, GREEDY) for p in PROMPTS]
    before = drafting.stats()
    got = run_jobs(drafting, jobs)
    after = drafting.stats()
    assert got == run_jobs(plain, jobs)
    assert after.spec_accepted_tokens - before.spec_accepted_tokens > 10
    assert after.spec_drafts > before.spec_drafts and after.mean_acceptance_length > 1
    generated = sum(len(t) for t, _ in got)
    assert after.steps - before.steps < generated / len(jobs) * 0.9  # (every row ran in every step it was busy)


def test_other_rows_decode_as_without_speculation_beside_drafting_ones(plain, drafting):
    penalised = SlotSettings(max_tokens=20, temperature=0.8, seed=3, presence_penalty=0.5, logprob=False,
                             top_logprobs=False)
    scored = SlotSettings(max_tokens=20, logprob=True, top_logprobs=False)
    jobs = [(PROMPTS[0], GREEDY), (PROMPTS[1], penalised), (PROMPTS[2], scored), (PROMPTS[3], GREEDY)]
    before = drafting.stats()
    assert run_jobs(drafting, jobs) == run_jobs(plain, jobs)
    assert drafting.stats().spec_drafts > before.spec_drafts


def test_sampled_rows_draft_and_get_the_tokens_plain_decoding_draws(plain, drafting):
    """Seeded sampled rows (temperature, top-p, top-k) drafting beside a greedy one: each gets plain decoding's
    tokens (its successors drawn with plain decoding's keys), so their distribution is the model's; drafts of
    sampled rows are kept (with the probability the model gives them) and their text is not the greedy text."""
    def sampled(seed, **more):
        return SlotSettings(**{**GREEDY.__dict__, "temperature": 0.6, "top_p": 0.95, "seed": seed, **more})
    jobs = [(PROMPTS[0], sampled(1)), (PROMPTS[1], sampled(2, top_k=8)), (PROMPTS[2], GREEDY),
            (PROMPTS[3], sampled(3)), (PROMPTS[0], sampled(4)), (PROMPTS[1], sampled(5, temperature=1.0))]
    before = drafting.stats()
    got = run_jobs(drafting, jobs)
    after = drafting.stats()
    assert got == run_jobs(plain, jobs)
    greedy = run_jobs(plain, [(p, GREEDY) for p, _ in jobs])
    assert sum(g != s for g, s in zip(greedy, got)) >= 3
    # the greedy row alone cannot account for these: sampled rows' drafts were kept too
    (alone, _), = run_jobs(drafting, [(PROMPTS[2], GREEDY)])
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted > len(alone)


def test_stop_tokens_and_the_context_end_cut_accepted_drafts(plain, drafting):
    (first, _), = run_jobs(plain, [(PROMPTS[1], GREEDY)])
    stop = first[12]  # a token the greedy text reaches after drafts have begun to land
    stopping = SlotSettings(**{**GREEDY.__dict__, "stop_token_ids": (stop,)})
    to_the_end = SlotSettings(**{**GREEDY.__dict__, "max_tokens": MAX_SEQ - len(PROMPTS[1])})
    jobs = [(PROMPTS[1], stopping), (PROMPTS[1], to_the_end)]
    got = run_jobs(drafting, jobs)
    assert got == run_jobs(plain, jobs)
    assert got[0][1] == "stop" and got[0][0][-1] == stop and got[1][1] == "length"
    # min_tokens holds the stop token back in the drafts' checks as in plain steps
    held = SlotSettings(**{**stopping.__dict__, "min_tokens": 20})
    got = run_jobs(drafting, [(PROMPTS[1], held)])
    assert got == run_jobs(plain, [(PROMPTS[1], held)]) and len(got[0][0]) >= 20


def test_a_model_that_steps_several_times_a_call_still_drafts(params, plain):
    e = engine_of(params, True, decode_steps=4)
    try:
        jobs = [(p, GREEDY) for p in PROMPTS[:2]]
        assert run_jobs(e, jobs) == run_jobs(plain, jobs)
        assert e.stats().spec_accepted_tokens > 0
    finally:
        e.close()


def test_warmup_compiled_the_drafting_steps(drafting):
    with xla_compiles() as asked:
        run_jobs(drafting, [(p, GREEDY) for p in PROMPTS] + [([2] + [9] * 14, GREEDY)])
    assert asked == []


def test_refused_where_steps_are_not_ragged(params):
    m = xla_slots(CFG, params, num_slots=2, max_seq_len=MAX_SEQ)
    try:
        with pytest.raises(ValueError, match="ragged steps"):
            m.use_speculation(NGRAM)
    finally:
        m.close()


def test_pipeline_stages_check_drafts_as_one_device_does(params, plain):
    """Two stages in this process, their slots in two micro-batch groups: drafts ride through both stages and the
    last one checks them."""
    from opt_serving.model import param_tree
    from opt_serving.parallel.stage_weights import stage_specs
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.stage import LocalStages, StageSlots
    stages = [StageSlots(CFG, param_tree.stage_params(params, s), s, 2, 2, MAX_SEQ) for s in stage_specs(CFG, 2)]
    piped = Slots(CFG, LocalStages(stages), 4, 2, MAX_SEQ)
    piped.use_speculation(NGRAM)
    piped.spec.adaptive = False
    e = Engine(piped)
    try:
        jobs = [(p, GREEDY) for p in PROMPTS]
        assert run_jobs(e, jobs) == run_jobs(plain, jobs)
        assert e.stats().spec_accepted_tokens > 10
    finally:
        e.close()


def test_a_block_s_plain_step_is_measured_before_drafts_ride_in_it_and_again_now_and_then():
    s = spec_rows()
    plan = lambda: s.plan([(0, 0, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ)  # noqa: E731
    assert plan() == []  # nothing measured at the block of 8: a plain step first
    s.observe_step(8, False, 0.030)
    taken = [len(plan()) for _ in range(2 * ngram.REMEASURE)]
    assert taken.count(0) == 2 and taken[ngram.REMEASURE - 2] == 0  # (the first plan was the 1st at this block)


def test_a_drafted_step_once_measured_slow_is_measured_again():
    """A drafted step measured during a compile looks too dear for drafts to ride: one draft rides anyway every
    REMEASURE declined steps, and a time under half the estimate replaces it, so drafts come back."""
    s = spec_rows()
    s.observe_step(8, False, 0.030)
    s.observe_step(8, True, 0.300)
    plans = [s.plan([(0, 0, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ) for _ in range(2 * ngram.REMEASURE)]
    assert [[len(d.tokens) for d in p] for p in plans if p] == [[1]]
    s.observe_step(8, True, 0.031)
    assert s.step_s[8, True] == 0.031
    assert len(s.plan([(0, 0, 6)], tokens=1, room=100, max_seq_len=MAX_SEQ)[0].tokens) == 4

"""runner/speculative.py: generate() with a draft model or prompt lookup. Greedy tokens equal the plain generate()'s
on one stage and on two stages in this process (drafts all accepted, some rejected and the caches cut back, none
accepted); the rejection rule leaves each token distributed as the target's; the draft length rule; refusals."""
import jax
import numpy as np
import pytest

from conftest import SMALL

CFG = SMALL
PROMPT = np.array([[3, 7, 11, 2, 8, 40, 9, 77, 5]], np.int32)


@pytest.fixture(scope="module")
def models():
    """(target on one stage, the same on two local stages, drafts: itself, a noisy copy, another model)."""
    from opt_serving.model import param_tree, wrapper
    from opt_serving.parallel.pipeline import stage_specs
    from opt_serving.runner.generate import Generation
    from opt_serving.runner.stage import LocalStages, StageSlots
    params = param_tree.init_params(CFG, seed=3, std=0.3)
    one = Generation.of(wrapper.OPTModel(CFG, params))
    staged = Generation(CFG, LocalStages([StageSlots(CFG, param_tree.stage_params(params, s), s, 1, 1, 64)
                                          for s in stage_specs(CFG, 2)]))
    noise = jax.tree_util.tree_map(
        lambda x: x + 0.08 * np.random.default_rng(x.size).standard_normal(x.shape).astype(x.dtype), params)
    drafts = {"itself": one, "noisy copy": Generation.of(wrapper.OPTModel(CFG, noise)),
              "another model": Generation.of(wrapper.OPTModel(CFG, param_tree.init_params(CFG, seed=9, std=0.3)))}
    return one, staged, drafts


@pytest.mark.parametrize("target,draft", [("one stage", "itself"), ("one stage", "another model"),
                                          ("one stage", "prompt lookup"), ("two stages", "noisy copy")])
def test_greedy_speculation_gives_the_plain_tokens(models, target, draft):
    one, staged, drafts = models
    model = one if target == "one stage" else staged
    want = one.generate(PROMPT, max_new_tokens=20)
    spec = dict(prompt_lookup_num_tokens=3) if draft == "prompt lookup" else dict(assistant_model=drafts[draft])
    got = model.generate(PROMPT, max_new_tokens=20, num_assistant_tokens_schedule="constant", **spec)
    np.testing.assert_array_equal(got, want)
    st = model.last_speculation
    assert st.drafted > 0 and st.rounds >= 1
    if draft == "itself":
        assert st.accepted == st.drafted  # every draft lands: rounds of k + 1 tokens
        assert st.rounds <= -(-20 // 5) + 1
    if draft == "noisy copy":
        assert 0 < st.accepted < st.drafted  # both paths, and the caches cut back after each rejection
    if target == "two stages":
        assert all(not s.seqs for s in staged.stages.stages)  # every whole-sequence cache closed


def test_eos_and_min_new_tokens_end_where_plain_generate_ends(models):
    one, _, drafts = models
    plain = one.generate(PROMPT, max_new_tokens=20)
    eos = int(plain[0, PROMPT.shape[1] + 5])  # a token the output reaches at its 6th step
    for kw in (dict(eos_token_id=eos), dict(eos_token_id=eos, min_new_tokens=9)):
        want = one.generate(PROMPT, max_new_tokens=20, **kw)
        for spec in (dict(assistant_model=drafts["noisy copy"]), dict(prompt_lookup_num_tokens=2)):
            got = one.generate(PROMPT, max_new_tokens=20, num_assistant_tokens_schedule="constant", **kw, **spec)
            np.testing.assert_array_equal(got, want)


def test_adaptive_schedule_keeps_the_tokens(models):
    one, _, drafts = models
    want = one.generate(PROMPT, max_new_tokens=30)
    for draft in (drafts["itself"], drafts["noisy copy"]):
        np.testing.assert_array_equal(one.generate(PROMPT, max_new_tokens=30, assistant_model=draft), want)


def test_rounds_that_draft_nothing_run_in_one_loop_and_keep_the_tokens(models, monkeypatch):
    """Drafts that miss turn drafting off; the greedy rounds until the next probe run as one compiled loop
    (StageSlots.seq_continue), ending at EOS (held back by min_new_tokens) where plain generate() ends."""
    one, _, drafts = models
    stage = one.stages.stages[0]
    calls = []
    real = stage.seq_continue
    monkeypatch.setattr(stage, "seq_continue", lambda *a: calls.append(a[3]) or real(*a))
    plain = one.generate(PROMPT, max_new_tokens=40)
    eos = int(plain[0, PROMPT.shape[1] + 30])  # reached in the 31st step, long after drafting stopped
    early = [i for i in range(30) if plain[0, PROMPT.shape[1] + i] == eos]  # an earlier EOS min_new_tokens holds back
    assert early
    for kw in (dict(), dict(eos_token_id=eos), dict(eos_token_id=eos, min_new_tokens=early[-1] + 2)):
        calls.clear()
        want = one.generate(PROMPT, max_new_tokens=40, **kw)
        got = one.generate(PROMPT, max_new_tokens=40, assistant_model=drafts["another model"], **kw)
        np.testing.assert_array_equal(got, want)
        st = one.last_speculation
        assert st.drafted > 0 and st.plain_rounds > len(calls) > 0  # drafting, then several plain rounds a call


def test_a_stretch_of_plain_rounds_keeps_the_probe_schedule():
    """Rounds run together (plain_stretch, skip) probe where rounds run one by one probe."""
    from opt_serving.runner.speculative import KChooser
    one_by_one, together = KChooser(4), KChooser(4)
    ks = []
    for _ in range(200):
        k = one_by_one.next_k()
        ks.append(k)
        one_by_one.observe(k, 0, t_draft=k * 0.02, t_check=0.2)
    got = []
    while len(got) < 200:
        k = together.next_k()
        if k:
            got.append(k)
            together.observe(k, 0, t_draft=k * 0.02, t_check=0.2)
            continue
        n = together.plain_stretch()
        got += [0] * n
        together.skip(n - 1)
        together.observe(0, 0, t_draft=0.0, t_check=0.2)
    assert got[:200] == ks and max(len(r) for r in "".join(map(str, ks)).split("1") if r) > 8


@pytest.mark.parametrize("lookup", [False, True])
def test_rejection_rule_draws_from_the_targets_distribution(lookup):
    """Over a vocabulary of 6, drafts drawn from q (or a fixed token: a lookup's point mass): the first token
    emitted is distributed as p after top-k, whatever q is."""
    from opt_serving.runner.speculative import Acceptance
    p_logits = np.log(np.array([0.05, 0.3, 0.1, 0.4, 0.1, 0.05]))
    q = np.array([0.4, 0.1, 0.2, 0.1, 0.1, 0.1])
    acc = Acceptance(dict(temperature=1.0, top_k=4, top_p=1.0), eos=-1, prompt_len=1, seed=0)
    logits = np.stack([p_logits, p_logits]).astype(np.float32)  # [k + 1 = 2, V]
    rng, n = np.random.default_rng(1), 4000
    counts = np.zeros(6)
    for _ in range(n):
        d = 0 if lookup else int(rng.choice(6, p=q))
        counts[acc.decide(logits, 1, [d], None if lookup else q[None])[0]] += 1
    kept = np.exp(p_logits) * (np.arange(6) != 0) * (np.arange(6) != 5)  # top-4 drops the two of 0.05
    np.testing.assert_allclose(counts / n, kept / kept.sum(), atol=0.03)


def test_draft_length_rule():
    from opt_serving.runner.speculative import PROBE_EVERY, KChooser
    landing = KChooser(4)
    for _ in range(10):
        landing.observe(4, 4, t_draft=4 * 0.01, t_check=0.2)
    assert landing.next_k() == 4  # cheap drafts that land: draft the most
    failing = KChooser(4)
    for _ in range(10):
        failing.observe(2, 0, t_draft=2 * 0.02, t_check=0.2)
    ks = [failing.next_k() for _ in range(2 * PROBE_EVERY)]
    assert ks.count(0) == 2 * PROBE_EVERY - 2 and ks.count(1) == 2  # off, one probing draft every PROBE_EVERY
    costly = KChooser(4)  # drafts as costly as the check: never pays even when they land
    for _ in range(10):
        costly.observe(4, 4, t_draft=4 * 0.2, t_check=0.2)
    assert costly.expected_rate(0) > costly.expected_rate(1)
    assert KChooser(4, adaptive=False).next_k() == 4


def test_the_acceptance_rate_is_the_drafts_accepted_over_those_tested():
    """Drafts each accepted with probability 0.85 until the first rejection: the rate read from the rounds is
    0.85 (a mean of each round's accepted / tested read about 0.73), so the rule keeps drafting 4."""
    from opt_serving.runner.speculative import KChooser
    rng = np.random.default_rng(0)
    chooser, rates = KChooser(4), []
    for _ in range(4000):
        k = 4
        accepted = next((i for i in range(k) if rng.random() >= 0.85), k)
        chooser.observe(k, accepted, t_draft=k * 0.009, t_check=0.06)
        rates.append(chooser.rate)
    assert abs(np.mean(rates[100:]) - 0.85) < 0.02, np.mean(rates[100:])
    assert chooser.expected_rate(4) > chooser.expected_rate(3)  # at 0.85, with these costs, 4 drafts pay most


def test_failed_probes_wait_longer_and_a_landing_one_turns_drafting_back_on():
    from opt_serving.runner.speculative import PROBE_EVERY, PROBE_MAX, KChooser
    chooser, ks = KChooser(4), []
    for _ in range(300):  # drafts that never land
        k = chooser.next_k()
        ks.append(k)
        chooser.observe(k, 0, t_draft=k * 0.02, t_check=0.2)
    drafting = [i for i, k in enumerate(ks) if k]
    assert drafting[:2] == [0, 1] and len([i for i in drafting if i < 10]) <= 4  # a few rejections turn it off
    probes = [i for i in drafting if i >= 10]
    gaps = np.diff(probes).tolist()
    assert gaps[:3] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]  # doubled each time
    assert max(gaps) == PROBE_MAX and set(gaps[-2:]) == {PROBE_MAX}  # ... up to PROBE_MAX rounds
    for _ in range(PROBE_MAX):  # the drafts start landing: the next probe lands, drafting resumes
        k = chooser.next_k()
        if k:
            chooser.observe(k, k, t_draft=k * 0.02, t_check=0.2)
            break
        chooser.observe(0, 0, t_draft=0.0, t_check=0.2)
    else:
        raise AssertionError("no probe within PROBE_MAX rounds")
    ks = []
    for _ in range(6):
        ks.append(chooser.next_k())
        chooser.observe(ks[-1], ks[-1], t_draft=ks[-1] * 0.02, t_check=0.2)
    assert ks[-1] == 4 and ks.count(0) == 0


def test_refusals_name_the_problem(models):
    from opt_serving.model import param_tree, wrapper
    from opt_serving.runner.generate import Generation
    one, _, drafts = models
    two = np.concatenate([PROMPT, PROMPT])
    with pytest.raises(ValueError, match="one unpadded sequence"):
        one.generate(two, max_new_tokens=4, assistant_model=drafts["itself"])
    with pytest.raises(NotImplementedError, match="num_beams"):
        one.generate(PROMPT, max_new_tokens=4, num_beams=2, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="not both"):
        one.generate(PROMPT, max_new_tokens=4, prompt_lookup_num_tokens=2, assistant_model=drafts["itself"])
    other = CFG.replace(vocab_size=96)
    small_vocab = Generation.of(wrapper.OPTModel(other, param_tree.init_params(other, seed=1)))
    with pytest.raises(ValueError, match="vocabulary"):
        one.generate(PROMPT, max_new_tokens=4, assistant_model=small_vocab)
    with pytest.raises(TypeError, match="assistant_model"):
        one.generate(PROMPT, max_new_tokens=4, assistant_model="opt-125m")

"""Profiled stage times: derived right from interleaved samples, and they decide the plan."""
import dataclasses

import pytest

from opt_serving.config import OPT_CONFIGS, OPTConfig
from opt_serving.parallel import cost
from opt_serving.parallel.cluster import parse_cluster
from opt_serving.parallel.planner import search
from opt_serving.parallel.profile import profile_decode, variants
from opt_serving.testing.multidevice import rerun_with_8_devices

CFG = OPT_CONFIGS["125m"]           # 12 layers
DEPTHS = (1, 4, 12)
MS = 1e-3


class FakeClock:
    """Time moves only when a fake step runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def middle(t, n):
    """A middle stage's true time: layers past the fourth cost `deep` each (not linear)."""
    return t["dispatch"] + min(n, 4) * t["layer"] + max(n - 4, 0) * t["deep"]


def fake_steps(truth, clock, outlier_every=4):
    """make_steps for profile_decode: each step advances the clock by what `truth` says a
    stage of that shape takes, and every `outlier_every`-th call 10x that (a load spike)."""
    def make(cfg, tp, depths, batch, context, dtype):
        t = truth[tp]
        steps = {}
        for n, first, last in variants(depths):
            secs = middle(t, n) + first * t["embed"] + last * t["head"]
            calls = [0]

            def step(secs=secs, calls=calls):
                calls[0] += 1
                clock.now += secs * (10 if calls[0] % outlier_every == 0 else 1)
            steps[n, first, last] = step
        return steps
    return make


def truth_favouring(fast_tp):
    """Stage times where `fast_tp` is quickest; dispatch and embeddings alike."""
    deep = {1: 6.0, 2: 2.0, 4: 1.6}
    head = {1: 10.0, 2: 6.0, 4: 5.0}
    deep[fast_tp], head[fast_tp] = 0.9, 3.0
    return {tp: dict(layer=1.5 * MS, deep=deep[tp] * MS, head=head[tp] * MS, dispatch=0.3 * MS,
                     embed=0.1 * MS) for tp in (1, 2, 4)}


def _profile(truth, **kw):
    clock = FakeClock()
    return profile_decode(CFG, sorted(truth), batch=1, context=256, dtype="float32", depths=DEPTHS,
                          rounds=5, repeats=3, make_steps=fake_steps(truth, clock), clock=clock, **kw)


def test_derived_times_match_the_stages_and_ignore_spikes():
    truth = truth_favouring(2)
    prof = _profile(truth)
    assert prof.tps == [1, 2, 4]
    for tp, t in prof.by_tp:
        # one call in four is a 10x spike; medians do not see it
        assert t.embed_s == pytest.approx(truth[tp]["embed"])
        assert t.head_s == pytest.approx(truth[tp]["head"])
        assert t.dispatch_s == pytest.approx(truth[tp]["dispatch"])
        # the measured depths are interpolated piecewise, so the bend at 4 layers is kept
        for n in range(1, 13):
            assert t.middle(n) == pytest.approx(middle(truth[tp], n)), (tp, n)
        assert t.stage_s(12, True, True) == pytest.approx(
            middle(truth[tp], 12) + truth[tp]["embed"] + truth[tp]["head"])


@pytest.mark.parametrize("fast_tp", [1, 2, 4])
def test_planner_picks_what_the_profile_favours(fast_tp):
    truth = truth_favouring(fast_tp)
    cluster = parse_cluster("1x8x16GB:cpu")
    spec = dataclasses.replace(cluster.spec, profile=_profile(truth), remote_call_s=2 * MS,
                               handoff_latency_s=2 * MS)
    result = search(CFG, dataclasses.replace(cluster, spec=spec), batch_size=1, max_seq_len=256,
                    dtype="float32")
    best = result.best
    assert (best.pp, best.tp) == (1, fast_tp)
    t = truth[fast_tp]
    # one stage of all 12 layers with the embeddings and the head, as measured
    assert best.step_s == pytest.approx(middle(t, 12) + t["embed"] + t["head"])
    assert best.stages[0].time.measured
    # a pipeline pays each of its stages as measured, and the Ray hops on top
    # (a hand-off also moves 3 KB of hidden state: a fraction of a microsecond)
    pp2 = next(p for p in result.plans if (p.pp, p.tp) == (2, fast_tp))
    a, b = pp2.layer_split
    assert pp2.step_s == pytest.approx(middle(t, a) + middle(t, b) + t["embed"] + t["head"]
                                       + 2 * MS + 2 * MS, rel=1e-3)


def test_roofline_alone_disagrees_so_the_profile_is_what_decides():
    # without a profile this CPU spec (pool 1) never prefers splitting a layer 4 ways
    plain = search(CFG, parse_cluster("1x8x16GB:cpu"), batch_size=1, max_seq_len=256,
                   dtype="float32").best
    assert plain.tp != 4 and not plain.stages[0].time.measured


def test_profile_applies_only_to_the_shape_it_measured():
    prof = _profile(truth_favouring(2))
    spec = dataclasses.replace(parse_cluster("1x8x16GB:cpu").spec, profile=prof)
    assert cost.stage_time(CFG, spec, 3, False, False, 2, 1, 1, 256, "float32").measured
    for args in [(2, 1, 1, 128, "float32"),   # another KV cache length
                 (2, 2, 1, 256, "float32"),   # another batch
                 (2, 1, 8, 256, "float32"),   # a prefill
                 (2, 1, 1, 256, "float16"),   # another dtype
                 (3, 1, 1, 256, "float32")]:  # a tp degree not profiled
        assert not cost.stage_time(CFG, spec, 3, False, False, *args).measured, args
    other = OPT_CONFIGS["350m"]
    assert not cost.stage_time(other, spec, 3, False, False, 2, 1, 1, 256, "float32").measured


def test_bad_depths_are_refused():
    with pytest.raises(ValueError, match=r"stage depths \(1, 13\) must lie in 1..12"):
        profile_decode(CFG, [1], depths=(1, 13))


def test_real_stages_measure_on_this_device():
    # the real path: jitted pipeline stages of a narrow model on the one local device
    cfg = OPTConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32)
    prof = profile_decode(cfg, [1], context=32, rounds=2, repeats=2)
    (tp, t), = prof.by_tp
    assert tp == 1
    assert t.stage_s(2, True, True) > 0 and t.dispatch_s + t.layer_s > 0
    spec = dataclasses.replace(parse_cluster("1x1x1GB:cpu").spec, profile=prof)
    st = cost.stage_time(cfg, spec, 2, True, True, 1, 1, 1, 32, "float32")
    assert st.measured and st.total_s == pytest.approx(t.stage_s(2, True, True))


def test_in_8_device_subprocess():
    out = rerun_with_8_devices(__file__)
    assert "1 passed" in out, out[-2000:]


@pytest.mark.multidevice
def test_real_tensor_parallel_stages_measure_on_the_local_devices():
    """tp 2 in this process: the stages' params cut from the whole model's Megatron shardings, each on 2 devices."""
    cfg = OPTConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32)
    prof = profile_decode(cfg, [1, 2], context=32, rounds=2, repeats=2)
    assert [tp for tp, _ in prof.by_tp] == [1, 2]
    assert all(t.stage_s(2, True, True) > 0 for _, t in prof.by_tp)


def test_pipeline_stages_use_the_times_measured_in_stage_actors():
    # stage actors that measured slower than this process: pp > 1 plans pay it, pp = 1 not
    here = _profile(truth_favouring(2))
    slow = {tp: dict(t, deep=t["deep"] * 3) for tp, t in truth_favouring(2).items()}
    staged = _profile(slow).by_tp
    prof = dataclasses.replace(here, stage_by_tp=staged)
    spec = dataclasses.replace(parse_cluster("1x8x16GB:cpu").spec, profile=prof)
    one = cost.stage_time(CFG, spec, 7, True, False, 2, 1, 1, 256, "float32")
    piped = cost.stage_time(CFG, spec, 7, True, False, 2, 1, 1, 256, "float32", pipelined=True)
    assert one.total_s == pytest.approx(dict(here.by_tp)[2].stage_s(7, True, False))
    assert piped.total_s == pytest.approx(dict(staged)[2].stage_s(7, True, False))
    assert piped.total_s > one.total_s
    result = search(CFG, dataclasses.replace(parse_cluster("1x8x16GB:cpu"), spec=spec),
                    batch_size=1, max_seq_len=256, dtype="float32")
    pp2 = next(p for p in result.plans if (p.pp, p.tp) == (2, 2))
    assert sum(s.time.total_s for s in pp2.stages) == pytest.approx(
        sum(dict(staged)[2].stage_s(s.num_layers, s.has_embed, s.has_head) for s in pp2.stages))

"""Pipeline stages' calls through a Ray Compiled Graph (parallel/handoff.py) against object refs: the engine's
greedy and sampled tokens through pp 2 and pp 3 stages with two micro-batch groups in flight (requests
refilling slots while the other group is in the stages) equal the one-device engine's on either hand-off; a
compiled graph that fails to start falls back to refs; a stage killed under a compiled graph is StageDied
naming it, not a hang; `auto` picks the compiled graph on one GPU node only, refs across two (simulated) nodes
and on CPU stages.
Ray starts are slow on 2 cores: one Ray for the one-node tests."""
import concurrent.futures
import logging
import threading
import types

import numpy as np
import pytest

from opt_serving.engine.scheduler import Engine, SlotSettings

from conftest import SMALL

CFG = SMALL
JOBS = [([2, 5, 9, 17], SlotSettings(max_tokens=6)), ([2, 40, 41], SlotSettings(max_tokens=3)),
        ([2] + list(range(10, 30)), SlotSettings(max_tokens=9)),
        ([2, 7], SlotSettings(max_tokens=5, temperature=0.9, top_p=0.8, seed=4)),
        ([2, 8, 8, 8], SlotSettings(max_tokens=7, repetition_penalty=1.4)),
        ([2, 99], SlotSettings(max_tokens=4, temperature=1.2, top_k=20, seed=9))]


@pytest.fixture(scope="module")
def params():
    from opt_serving.model import param_tree
    return param_tree.init_params(CFG, seed=3, std=0.3)  # large weights: clear argmaxes


@pytest.fixture(scope="module")
def folder(params, tmp_path_factory):
    from opt_serving.model.weights import params_to_arrays, save_numpy_folder
    path = tmp_path_factory.mktemp("small")
    save_numpy_folder(path, CFG, params_to_arrays(CFG, params))
    return path


def run(slots, jobs=JOBS):
    """Every job's tokens through an engine over `slots`, which it closes (six jobs, four slots in two groups: later jobs take
    slots freed while the other group is in the stages)."""
    e = Engine(slots, start=False)
    done, ids = [threading.Event() for _ in jobs], [[] for _ in jobs]

    def collect(i):
        def cb(out):
            if not out.is_prompt:
                ids[i] += [t.id for t in out.tokens]
            if out.finish_reason is not None:
                done[i].set()
        return cb
    for i, (prompt, settings) in enumerate(jobs):
        e.submit(prompt, settings, collect(i))
    e.start()
    try:
        for d in done:
            assert d.wait(300)  # (compiles included, on a shared machine)
    finally:
        e.close()
    return ids


def ray_slots(folder, pp, handoff, num_slots=4, groups=2):
    from opt_serving.parallel.pipeline import RayStages
    from opt_serving.runner.slots import Slots
    plan = types.SimpleNamespace(pp=pp, tp=1, layer_split=None)
    stages = RayStages(CFG, plan, folder, rows=num_slots // groups, groups=groups, max_seq_len=64, handoff=handoff)
    return Slots(CFG, stages, num_slots, groups, 64)


@pytest.fixture(scope="module")
def one_device(params):
    from opt_serving.engine.scheduler import OPTSlots
    want = run(OPTSlots(CFG, params, num_slots=4, max_seq_len=64))
    assert [len(t) for t in want] == [s.max_tokens for _, s in JOBS]
    return want


def test_pp2_compiled_graph_and_refs_give_the_one_device_tokens(ray_local, folder, one_device, caplog):
    caplog.set_level(logging.INFO, logger="opt_serving.parallel.pipeline")
    got = {}
    for handoff in ("cgraph", "auto"):
        slots = ray_slots(folder, 2, handoff)
        try:
            got[slots.stages.handoff] = run(slots)
        finally:
            slots.close()
    assert set(got) == {"cgraph", "refs"}  # auto on one CPU node: refs
    assert got["cgraph"] == got["refs"] == one_device
    said = [r.getMessage() for r in caplog.records if "hand-off" in r.getMessage()]
    assert "Compiled Graph, asked for" in said[0] and "object refs" in said[1] and "CPUs" in said[1]


def test_a_failed_compile_falls_back_to_refs_with_a_warning(ray_local, folder, one_device, monkeypatch, caplog):
    from opt_serving.parallel import handoff

    def fail(self, actors, max_inflight=16):
        raise RuntimeError("no channels today")
    monkeypatch.setattr(handoff.CompiledChain, "__init__", fail)
    slots = ray_slots(folder, 2, "cgraph")
    try:
        assert slots.stages.handoff == "refs"
        assert "no channels today" in slots.stages.handoff_reason
        assert any(r.levelno == logging.WARNING and "no channels today" in r.getMessage() for r in caplog.records)
        first = slots.prefill(JOBS[0][0], JOBS[0][1])  # it serves, through refs (whose tokens the pp=2 test checks)
        assert first.first.id == one_device[0][0]
    finally:
        slots.close()


def test_a_stage_killed_under_a_compiled_graph_is_stage_died_naming_it(ray_local, folder):
    from opt_serving.parallel.pipeline import StageDied
    slots = ray_slots(folder, 3, "cgraph")
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        assert slots.stages.handoff == "cgraph"
        for slot, (prompt, settings) in enumerate(JOBS[:2]):  # both groups busy
            slots.insert(slots.prefill(prompt, settings), slot)
        slots.step()
        ray_local.kill(slots.stages.actors[1])
        # a decode in flight when the stage died, then the next: StageDied, not a hang (a guard, not a timing)
        with pytest.raises(StageDied, match=r"stage 1 \(layers 2-2\) died.*loaded again"):
            for _ in range(3):
                pool.submit(slots.step).result(timeout=120)
        with pytest.raises(StageDied, match="stage 1"):
            pool.submit(slots.check_health).result(timeout=120)
        with pytest.raises(StageDied, match="stage 1"):
            pool.submit(slots.prefill, [2, 5], SlotSettings()).result(timeout=120)
    finally:
        pool.shutdown()
        slots.close()


def test_a_stage_error_under_a_compiled_graph_raises_as_its_type_and_the_stages_serve_on(ray_local, folder):
    """A call that raises in a stage fails that call alone (as with object refs): the chained call after it is
    skipped, and the next calls run."""
    slots = ray_slots(folder, 2, "cgraph", num_slots=2, groups=1)
    try:
        stages = slots.stages
        ids, mask = np.array([[2, 5]], np.int32), np.ones((1, 2), np.int32)
        x = stages.call(0, "seq_prefill", 999, ids, mask)  # no whole-sequence cache 999 was opened
        with pytest.raises(KeyError, match="999"):
            stages.get(stages.call(1, "seq_prefill", 999, x, mask))
        first = slots.prefill([2, 5, 9], SlotSettings())
        assert 0 <= first.first.id < CFG.vocab_size
        assert stages.get([stages.call(i, "ready") for i in range(2)]) == [True, True]
    finally:
        slots.close()


def test_auto_uses_refs_when_the_stages_span_two_nodes(folder):
    """(Last of the Ray tests: the one-node Ray of those above is stopped first.)"""
    ray = pytest.importorskip("ray")
    from opt_serving.testing.ray_cluster import simulated_cluster
    if ray.is_initialized():
        ray.shutdown()
    with simulated_cluster(nodes=2, cpus_per_node=2):
        slots = ray_slots(folder, 2, "auto", num_slots=2, groups=1)
        try:
            assert len({w["node"] for w in slots.stages.where()}) == 2
            assert slots.stages.handoff == "refs"
            assert "span 2 nodes" in slots.stages.handoff_reason
            first = slots.prefill([2, 5, 9], SlotSettings(max_tokens=2))
            assert 0 <= first.first.id < CFG.vocab_size
        finally:
            slots.close()


@pytest.mark.parametrize("handoff, nodes, gpus, want, why", [
    ("auto", 1, True, "refs", "not measured"), ("auto", 2, True, "refs", "span 2 nodes"),
    ("auto", 1, False, "refs", "CPUs"), ("cgraph", 2, False, "cgraph", "asked for"),
    ("refs", 1, True, "refs", "asked for")])
def test_auto_chooses_refs_the_measured_faster_and_a_compiled_graph_when_asked(handoff, nodes, gpus, want, why):
    from opt_serving.parallel.handoff_choice import choose_handoff
    got, reason = choose_handoff(handoff, nodes, gpus)
    assert got == want and why in reason


def test_an_unknown_handoff_is_an_error_naming_the_choices():
    from opt_serving.parallel.pipeline import RayStages
    with pytest.raises(ValueError, match="auto, cgraph, refs.*'shm'"):
        RayStages(CFG, types.SimpleNamespace(pp=2, tp=1, layer_split=None), handoff="shm")


def test_owned_copies_what_a_channel_read_lends():
    from opt_serving.parallel.handoff import owned
    from opt_serving.runner.types import JoinBlock
    lent = np.arange(6, dtype=np.int32)
    lent.flags.writeable = False
    block = JoinBlock(*[lent] * 9, settings=(SlotSettings(),))
    out = owned(([lent, {"a": lent}], block, 3))
    arrays = [out[0][0], out[0][1]["a"], out[1].ids, out[1].lengths]
    assert all(a.flags.writeable and a.flags.owndata and not np.shares_memory(a, lent) for a in arrays)
    assert out[1].settings is block.settings and out[2] == 3
    mine = np.zeros(3)
    assert owned(mine) is mine  # a writable array of its own is not copied again

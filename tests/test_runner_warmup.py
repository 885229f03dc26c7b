"""Warm-up (runner/warmup.py): its one list of shapes is the bucket helpers' and the stages' own, and compiling
it leaves nothing for serving to compile."""
import pytest

from opt_serving.runner.types import SlotSettings

from conftest import SMALL, xla_compiles

CFG = SMALL
pytestmark = pytest.mark.cpu_kernels  # ragged steps: the CPU kernels (conftest.py)


def _small_slots():
    """One stage on the CPU kernels (ragged steps), a prefix cache, eight slots of 64 positions, not warmed."""
    from opt_serving.model import param_tree
    from opt_serving.parallel.pipeline import stage_specs
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.stage import LocalStages, StageSlots
    params = param_tree.init_params(CFG, seed=3, std=0.3)
    stages = [StageSlots(CFG, params, s, 8, 1, 64, prefix_blocks=16) for s in stage_specs(CFG, 1)]
    return Slots(CFG, LocalStages(stages), 8, 1, 64, prefix_blocks=16)


@pytest.fixture(scope="module")
def slots():
    """_small_slots, warmed for a prefill chunk of 16 and four steps a call."""
    model = _small_slots()
    model.warmup(16, decode_steps=4)
    return model


def programs(slots) -> dict:
    """Each program's shapes warm-up compiled."""
    stage = slots.stages.stages[0]
    sampler = stage.sampler
    jitted = {name: getattr(stage, name) for name in ("_prefill", "_chunk", "_step", "_step_joining", "_step_packed",
                                                      "_steps", "_insert_cache", "_free", "_resize", "_gather", "_store",
                                                      "_store_row")}
    jitted.update({"sampler" + name: getattr(sampler, name) for name in ("_first", "_choose", "_choose_joining",
                                                                         "_insert", "_free", "_chunked_first")})
    return {name: len(f.warmed) for name, f in jitted.items()}


def test_the_shapes_are_the_bucket_helpers_and_the_stages_own(slots):
    from opt_serving.runner.buckets import cache_buckets, job_sizes, prefill_bucket, prefill_buckets
    from opt_serving.runner.warmup import compiled_shapes
    shapes = compiled_shapes(slots, 16, 4)
    of = lambda kind: [s for s in shapes if s.kind == kind]  # noqa: E731
    assert {prefill_bucket(s.tokens, 64) for s in of("prefill")} == set(prefill_buckets(64))
    windows = slots.stages.stages[0].cache_windows()
    for kind in ("decode", "free", "store_row"):
        assert [s.window for s in of(kind)] == windows
    # the steps taken in one call at the rows they compute: four of the eight (at most four running), or eight
    assert [(s.window, s.rows) for s in of("decode_steps")] == [(w, r) for w in windows for r in (4, 8)]
    for w in windows:  # every cache size a prefill makes goes into every window holding it, the largest first
        inserts = [s.size for s in of("insert") if s.window == w]
        assert sorted(inserts) == [c for c in cache_buckets(64) if c <= w] and inserts[0] == max(inserts)
        assert [s.block for s in of("join") if s.window == w] == list(slots.join_blocks)
    assert {s.size for s in of("job")} == set(job_sizes(64))


def test_the_list_compiles_exactly_its_shapes(slots):
    """One prefill program a prefill width and one joining step a (window, block) in the list (on ragged stages a
    step of one list of tokens, the running rows' among them): none missing, none compiled for a shape the list
    does not name."""
    from opt_serving.runner.buckets import prefill_bucket
    from opt_serving.runner.warmup import compiled_shapes
    shapes = compiled_shapes(slots, 16, 4)
    count = programs(slots)
    assert count["_prefill"] == len({prefill_bucket(s.tokens, 64) for s in shapes if s.kind == "prefill"})
    assert slots.packed and count["_step_joining"] == 0
    assert count["_step_packed"] == len([s for s in shapes if s.kind == "join"])
    assert count["_steps"] == len([s for s in shapes if s.kind == "decode_steps"])


def test_after_warm_up_a_mixed_workload_compiles_nothing(slots):
    """Prompts of every kind after warm-up: batched and whole prefills, inserts, prompts joining a part at a time,
    a chunked prompt with a cached prefix, steps one and four at a time, frees: no program compiles again."""
    with xla_compiles() as asked:
        long = [2] + list(range(10, 50))
        slots.insert(slots.prefill(long, SlotSettings(max_tokens=6)), 0)
        batch = slots.prefill_batch([[2, 5], [2, 6, 7]], [SlotSettings(), SlotSettings(temperature=0.8, seed=1)])
        slots.discard(batch[0])
        slots.insert(batch[1], 1)
        assert slots.join([2, 40, 41], SlotSettings(), 2)
        assert slots.join(long[:33] + [3, 4], SlotSettings(), 3)  # its first two blocks are cached: the rest joins
        for _ in range(4):
            slots.step()
        slots.step_many(4)  # four rows running: four computed
        assert slots.join([2, 60, 61], SlotSettings(), 4) and slots.join([2, 62], SlotSettings(), 5)
        slots.step_many(4)  # (prompts joining: one step)
        slots.step_many(4)  # six running: all eight computed
        job = slots.open_prefill(long + [7, 8], SlotSettings(prompt_logprobs=True), 16)
        prefix = slots._run(job)
        slots.free(1)
        slots.insert(prefix, 1)
        slots.step()
        for s in range(6):
            slots.free(s)
    assert asked == []


def test_a_warm_up_that_fails_leaves_its_stage_running_its_programs(monkeypatch):
    """A shape that fails stops warm-up with its own error, and the stage runs its programs again (none is left
    compiling instead of running)."""
    from opt_serving.model import param_tree
    from opt_serving.runner import warmup
    from opt_serving.runner.load import local_slots
    params = param_tree.init_params(CFG, seed=3, std=0.3)
    model, fresh = (local_slots(CFG, params, num_slots=2, max_seq_len=64) for _ in range(2))

    def fail(self, shape):
        raise RuntimeError("a shape failed")
    monkeypatch.setattr(warmup._Runner, "decode", fail)
    with pytest.raises(RuntimeError, match="a shape failed"):
        model.warmup()
    stage = model.stages.stages[0]
    assert not stage.programs.compiling and not stage._warming
    # its prefill computes (a compile-only call would have returned token 0): the same token as a model never warmed
    got, want = (m.prefill([2, 5, 6, 7], SlotSettings()).first for m in (model, fresh))
    assert got.id == want.id and got.logprob == want.logprob and got.logprob not in (None, 0.0)


def test_warming_what_generation_runs_leaves_only_scored_prompts_to_compile(slots):
    """`every_shape=False` on ragged stages: the list keeps each window's steps (and the one prefill and insert
    that put a row in it) and drops the chunked and scored prefills. After it, prompts joining a part at a time
    (a cached prefix among them), steps one and four at a time and frees compile nothing; a scored prompt then
    compiles its prefill at its first use, and scores as a model warmed for every shape does."""
    from opt_serving.runner.warmup import compiled_shapes
    model = _small_slots()  # (the fixture's weights: its scores are the reference below)
    every, serving = (compiled_shapes(model, 16, 4, every_shape=e) for e in (True, False))
    kinds = lambda shapes: {s.kind for s in shapes}  # noqa: E731
    assert set(serving) < set(every) and kinds(every) - kinds(serving) == {"job"}
    assert not any(s.scored for s in serving) and len(serving) < len(every)
    for kind in ("decode", "decode_steps", "join", "store_row", "free"):
        assert [s for s in serving if s.kind == kind] == [s for s in every if s.kind == kind]
    model.warmup(16, decode_steps=4, every_shape=False)
    long = [2] + list(range(10, 50))
    with xla_compiles() as asked:
        assert model.join(long, SlotSettings(max_tokens=6), 0)
        assert model.join([2, 40, 41], SlotSettings(), 1)
        for _ in range(4):
            model.step()
        assert model.join(long[:33] + [3, 4], SlotSettings(), 2)  # its first two blocks are cached: the rest joins
        for _ in range(3):
            model.step()
        model.step_many(4)
        for s in range(3):
            model.free(s)
    assert asked == []
    with xla_compiles() as asked:
        scored = model.prefill([2, 5, 6, 7, 8], SlotSettings(prompt_logprobs=True))
    assert asked != []
    want = slots.prefill([2, 5, 6, 7, 8], SlotSettings(prompt_logprobs=True))  # (warmed for every shape)
    model.discard(scored)
    slots.discard(want)
    assert scored.first == want.first and scored.prompt == want.prompt and len(want.prompt) == 5

"""The engine's driver over pipeline stages, in this process: two stages (the model's own modules over
layers 0-1 and 2-3) and two micro-batch groups give the one-device engine's tokens, with requests that
arrive, finish and are cancelled while the other group is in flight."""
import threading

import pytest

from opt_serving.engine.scheduler import Engine, SlotSettings

from conftest import SMALL, xla_compiles

CFG = SMALL


class Collect:
    def __init__(self, hook=None):
        self.ids, self.finish, self.done, self.hook = [], None, threading.Event(), hook

    def __call__(self, out):
        if not out.is_prompt:
            self.ids += [t.id for t in out.tokens]
        if out.finish_reason is not None:
            self.finish = out.finish_reason
            self.done.set()
        if self.hook is not None:
            self.hook(self)


@pytest.fixture(scope="module")
def params():
    from opt_serving.model import param_tree
    return param_tree.init_params(CFG, seed=3, std=0.3)  # large weights: clear argmaxes


@pytest.fixture(scope="module")
def one_device(params):
    """The one-device engine's slots the pipelines are checked against: one for the module's tests, whose runs
    reuse its compiled steps (no prefix cache: each run frees every slot and leaves nothing behind)."""
    from opt_serving.engine.scheduler import OPTSlots
    return OPTSlots(CFG, params, num_slots=4, max_seq_len=64)


def two_stage_slots(params, num_slots=4, groups=2, xla=False):
    """Two stages in this process (`xla`: on plain XLA, without ragged steps)."""
    from opt_serving.backend import Backend
    from opt_serving.model import param_tree
    from opt_serving.parallel.stage_weights import stage_specs
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.stage import LocalStages, StageSlots
    stages = [StageSlots(CFG, param_tree.stage_params(params, s), s, num_slots // groups, groups, 64,
                         backend=Backend.xla() if xla else None) for s in stage_specs(CFG, 2)]
    return Slots(CFG, LocalStages(stages), num_slots, groups, 64)


def run(model, jobs, hooks=None, chunk=None):
    """Every job queued before the scheduler starts (it admits them at once); hooks[i](collector, engine,
    collectors) runs after each of job i's outputs, on the engine thread. `chunk`: the engine's prefill_chunk."""
    e = Engine(model, start=False, prefill_chunk=chunk)
    hooks = hooks or {}
    cols = []
    cols += [Collect(None if i not in hooks else (lambda c, h=hooks[i]: h(c, e, cols))) for i in range(len(jobs))]
    e.reqs = [e.submit(prompt, settings, c) for (prompt, settings), c in zip(jobs, cols)]
    e.start()
    try:
        for c in cols:
            assert c.done.wait(300)  # (compiles included, on a shared machine)
    finally:
        e.close()
    return cols


JOBS = [([2, 5, 9, 17], SlotSettings(max_tokens=6)), ([2, 40, 41], SlotSettings(max_tokens=3)),
        ([2] + list(range(10, 30)), SlotSettings(max_tokens=9)),
        ([2, 7], SlotSettings(max_tokens=5, temperature=0.9, top_p=0.8, seed=4)),
        ([2, 8, 8, 8], SlotSettings(max_tokens=7, repetition_penalty=1.4)),
        ([2, 99], SlotSettings(max_tokens=4))]


def test_warm_up_on_a_cpu_keeps_the_heap_for_the_steps(params, monkeypatch):
    # once the weights are in place (not before: the load's freed float32 weights would stay in the process)
    from opt_serving.engine.scheduler import OPTSlots
    from opt_serving.runner import stage
    calls = []
    monkeypatch.setattr(stage.heap, "keep_heap", lambda: calls.append(len(calls)))
    slots = OPTSlots(CFG, params, num_slots=2, max_seq_len=32)
    assert calls == []
    slots.warmup()
    assert calls == [0]


def test_two_stages_and_two_groups_equal_one_device(params, one_device):
    want = [c.ids for c in run(one_device, JOBS)]  # six jobs, four slots: later ones wait for a free slot
    piped = two_stage_slots(params)
    piped.warmup()
    with xla_compiles() as asked:
        got = run(piped, JOBS)
    assert [c.ids for c in got] == want
    # six jobs in four slots: prompts joined both groups, after inserts and frees, and serving compiled nothing
    # (group 1's sampler arrays are as warm-up left group 0's; a cache is spelled alike whatever made it)
    assert asked == []
    assert [len(c.ids) for c in got] == [s.max_tokens for _, s in JOBS]
    # a step returns one group's slots (consecutive slots alternate groups)
    assert piped.group_of(0) == (0, 0) and piped.group_of(1) == (1, 0) and piped.group_of(2) == (0, 1)


def test_after_warm_up_prompts_joining_each_group_right_after_an_insert_compile_nothing():
    # the step after an insert gets the cache the insert made, and the smallest join block is the first that
    # warm-up steps (after a plain step): the two spelled a replicated cache apart, and this compiled again
    from opt_serving.model import sources
    from opt_serving.parallel.stage_weights import load_stage, stage_specs
    from opt_serving.runner.slots import Slots
    from opt_serving.runner.stage import LocalStages, StageSlots
    stages = []
    for spec in stage_specs(CFG, 2):  # each stage's weights placed as a served stage's are
        backend, stage_params = load_stage(sources.RandomSource(3), CFG, spec)
        stages.append(StageSlots(CFG, stage_params, spec, 2, 2, 64, backend=backend))
    piped = Slots(CFG, LocalStages(stages), 4, 2, 64)
    piped.warmup(decode_steps=4)  # (as an engine warms: four steps a call, which a pipeline takes one at a time)
    assert not piped.table.lengths.any()  # every slot left free
    with xla_compiles() as asked:
        for slot in (0, 1):  # groups 0 and 1
            piped.insert(piped.prefill([2, 5, 6, 7], SlotSettings(max_tokens=4)), slot)
            assert piped.join([2, 9, 9], SlotSettings(max_tokens=4), slot + 2)  # 3 tokens: the smallest block
        for _ in range(4):
            piped.step()
        piped.step_many(4)
    assert asked == []


def test_a_slot_cancelled_and_refilled_while_its_group_is_in_flight_gets_no_stale_token(params, one_device):
    """Job 0 (slot 0, group 0) is cancelled while group 1's tokens are handed out, i.e. while group 0 is
    in the stages; its slot is freed then, and job 4 takes it: none of them gets another's token."""
    jobs = JOBS[:5]
    want = [c.ids for c in run(one_device, jobs)]
    piped = two_stage_slots(params)
    freed_in_flight = []
    real_free = piped.free
    piped.free = lambda slot: (freed_in_flight.append(piped._in_flight(piped.group_of(slot)[0])), real_free(slot))

    def cancel_job0(col, engine, cols):  # job 1 is in slot 1: group 1
        if len(col.ids) == 2:
            engine.cancel(engine.reqs[0])
            cols[0].done.set()  # no output follows a cancel
    got = run(piped, jobs, hooks={1: cancel_job0})
    assert got[0].finish is None and got[0].ids == want[0][:len(got[0].ids)] and len(got[0].ids) < 6
    assert [c.ids for c in got[1:]] == want[1:]  # job 4 took job 0's slot: its tokens are its own
    assert freed_in_flight[0]  # the case under test: job 0's slot was freed with its group in the stages


@pytest.mark.parametrize("xla", [False, True])
def test_chunked_prefill_through_two_stages_gives_the_whole_prefill_tokens(params, one_device, xla, monkeypatch):
    """Prompts longer than the chunk go through both stages a chunk at a time and get the one-device engine's
    tokens with whole prefills: on ragged stages a part of 8 tokens a step riding the decode steps of both micro-
    batch groups, elsewhere a chunk per engine iteration in passes of their own; nothing is left behind in either
    stage."""
    long_jobs = [([2] + list(range(10, 40)), SlotSettings(max_tokens=6)),
                 ([2] + list(range(60, 81)), SlotSettings(max_tokens=5, temperature=0.9, top_p=0.8, seed=4)),
                 ([2] + list(range(90, 99)), SlotSettings(max_tokens=4, repetition_penalty=1.4))]
    jobs = JOBS[:3] + long_jobs
    want = [c.ids for c in run(one_device, jobs, chunk=None)]
    piped = two_stage_slots(params, xla=xla)
    if not xla:  # (the stages' own fixed-shape params are float32 on one CPU device: ragged steps)
        assert piped.ragged and all(st.ragged for st in piped.stages.stages)
    piped.warmup(prefill_chunk=8)
    chunks, parts = [], []
    real, real_block = piped.prefill_chunk, piped._block
    monkeypatch.setattr(piped, "prefill_chunk", lambda job: (chunks.append((job.state, job.done)), real(job))[1])
    monkeypatch.setattr(piped, "_block", lambda ps: (parts.extend((p.start, p.end) for p in ps), real_block(ps))[1])
    got = run(piped, jobs, chunk=8)
    assert [c.ids for c in got] == want
    if xla:
        assert len(chunks) == 3 + 4 + 3 + 2  # 21, 31, 22 and 10 tokens in chunks of 8
    else:  # every prompt joins; the long ones a part of at most 8 tokens a step
        assert chunks == [] and max(e - b for b, e in parts) == 8 and sum(e - b for b, e in parts) == sum(
            len(p) for p, _ in jobs)
    assert all(not s.pending and (s.sampler is None or not s.sampler.pending) for s in piped.stages.stages)


def test_a_step_result_hands_out_each_slots_token_as_python_values():
    """StepResult.token: the id and log-probability as Python numbers, the log-probability only when asked,
    the top alternatives of the rows the step found them for (-1 ids left out), none for the others."""
    import numpy as np
    from opt_serving.runner.types import MAX_TOP_LOGPROBS, StepResult
    top_ids = np.full((3, MAX_TOP_LOGPROBS), -1, np.int32)
    top_lps = np.zeros((3, MAX_TOP_LOGPROBS), np.float32)
    top_ids[1, :2], top_lps[1, :2] = [7, 9], [-0.5, -1.25]
    r = StepResult(np.array([5, 7, 11], np.int32), np.array([-0.25, -0.5, -2.0], np.float32), top_ids, top_lps)
    a, b, c = r.token(0), r.token(1), r.token(2, logprob=False)
    assert (a.id, a.logprob, a.top) == (5, -0.25, [])
    assert (b.id, b.logprob, b.top) == (7, -0.5, [(7, -0.5), (9, -1.25)])
    assert (c.id, c.logprob, c.top) == (11, None, [])
    assert all(type(t.id) is int and type(t.logprob) in (float, type(None)) for t in (a, b, c))
    assert all(type(i) is int and type(lp) is float for i, lp in b.top)


def ascii_tokenizer():
    """A byte-level tokenizer of SMALL's size: OPT's four specials, then the printable ASCII characters (99 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from opt_serving.text.token_text import byte_decoder
    to_char = {b: c for c, b in byte_decoder().items()}
    vocab = {s: i for i, s in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    vocab.update({to_char[b]: 4 + b - 32 for b in range(32, 127)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def test_structured_output_through_two_stages_and_two_groups_equals_one_device(params):
    """The last stage keeps the matchers of its groups' rows: constrained requests (prefilled, joining a step,
    cancelled mid-way, refilled) give the one-device engine's tokens, and those follow their regexes."""
    import re
    from opt_serving.engine.scheduler import OPTSlots
    from opt_serving.runner.grammar import tokenizer_json
    from opt_serving.text.structured import StructuredOutput, grammar_of
    tok = ascii_tokenizer()
    regexes = [r"[a-f]{3,6}", r"(yes|no)!", r"[0-9]{1,3}\.[0-9]"]  # each ends within max_tokens
    jobs = [(prompt, SlotSettings(max_tokens=9, stop_token_ids=(2,), temperature=t, seed=i,
                                  grammar=grammar_of(StructuredOutput.of("regex", rx, "x"))))
            for i, (prompt, rx, t) in enumerate(zip(([2, 5, 9], [2] + list(range(10, 50)), [2, 7]), regexes,
                                                    (0.0, 0.0, 1.0)))]
    jobs = jobs + JOBS[:3] + jobs[:1]
    runs = []
    for slots in (OPTSlots(CFG, params, num_slots=4, max_seq_len=64), two_stage_slots(params)):
        slots.use_tokenizer(tokenizer_json(tok), 2)
        runs.append([c.ids for c in run(slots, jobs)])
    assert runs[0] == runs[1]
    for ids, rx in zip(runs[0], regexes + [None] * 3 + regexes[:1]):
        if rx is not None:
            assert ids[-1] == 2 and re.fullmatch(rx, tok.decode(ids[:-1])), (rx, tok.decode(ids))


def test_a_step_of_up_to_four_rows_computes_four_tokens_and_more_rows_the_next_block(params):
    """The CPU kernels take four rows in one pass over each weight block, so a packed step of one to four rows
    (and no prompt) is padded to four tokens, not to the eight a prompt's smallest block holds."""
    from opt_serving.engine.scheduler import OPTSlots
    from opt_serving.runner.slots import ROWS_BLOCK
    m = OPTSlots(CFG, params, num_slots=8, max_seq_len=64)
    try:
        assert m.joins.sizes[:2] == (ROWS_BLOCK, 8) == (4, 8)
        widths = []
        for running in (1, 4, 5):
            m.table.lengths[:] = 0
            m.table.lengths[:running] = 3  # (rows mid-sequence: no prompt joins the step)
            step, parts = m._decode_step(0, m.table.group_slots(0))
            widths.append(len(step.packed.src))
        assert parts == [] and widths == [4, 4, 8]
    finally:
        m.table.lengths[:] = 0
        m.close()

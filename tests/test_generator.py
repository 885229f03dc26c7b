"""The text-level generator over the fake engine, whose outputs are worked out by hand.

Fake model (opt_serving/engine/fake.py): greedy continues with `last + 1`; the top alternatives after
`t` are t+1..t+5 with logprobs -ln2, -2ln2, ...; sampling takes `last + 1 + (seed + k) % 3` for the k-th token.
Byte tokenizer: byte b is id 4 + b, so "a" is 101 and greedy after "a" spells "bcdef...".
"""
import asyncio
import gc
import math
import threading
import time

import pytest

from opt_serving.engine.scheduler import Engine, QueueFull
from opt_serving.text.completion import Detokenizer, Mailbox
from opt_serving.text.generator import Completion, Generator, SamplingParams
from opt_serving.engine.fake import GatedSlots, fake_logprob
from opt_serving.text.fake import byte_tokenizer, fake_generator

LN2 = math.log(2)
greedy = lambda **kw: SamplingParams(temperature=0.0, **kw)


@pytest.fixture(scope="module")
def gen():
    g = fake_generator(num_slots=4, max_seq_len=64)
    yield g
    g.close()


def run(coro):
    return asyncio.run(coro)


async def collect(gen, prompt, params):
    return [d async for d in gen.stream(prompt, params)]


def test_greedy_completion(gen):
    c = run(gen.complete("a", greedy(max_tokens=5, score_tokens=True)))
    assert c.text == "bcdef"
    assert c.token_ids == [102, 103, 104, 105, 106]
    assert c.tokens == ["b", "c", "d", "e", "f"]
    assert c.token_logprobs == pytest.approx([-LN2] * 5)
    assert c.text_offset == [1, 2, 3, 4, 5]  # into prompt + completion, as OpenAI counts
    assert c.top_logprobs == [None] * 5      # not asked for
    assert (c.finish_reason, c.prompt_tokens, c.completion_tokens) == ("length", 2, 5)
    assert c.cumulative_logprob == pytest.approx(-5 * LN2)


def test_stop_string_cuts_text(gen):
    c = run(gen.complete("a", greedy(max_tokens=10, stop=["zz", "de"])))
    assert (c.text, c.finish_reason) == ("bc", "stop")
    assert c.tokens == ["b", "c"]
    assert c.completion_tokens == 4  # b c d e were generated; d and e are cut


def test_stream_holds_back_possible_stop_strings(gen):
    deltas = run(collect(gen, "a", greedy(max_tokens=10, stop=["efx", "h"])))
    # "e" and "ef" could start "efx": held until "g" rules it out; "h" stops
    assert [d.text for d in deltas] == ["b", "c", "d", "efg", ""]
    assert [d.tokens for d in deltas] == [["b"], ["c"], ["d"], ["e", "f", "g"], []]
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["stop"]
    assert [d.completion_tokens for d in deltas] == [1, 2, 3, 6, 7]


def test_stream_never_sends_part_of_a_stop_string(gen):
    deltas = run(collect(gen, "a", greedy(max_tokens=10, stop=["cd"])))
    assert [d.text for d in deltas] == ["b", ""]
    assert deltas[-1].finish_reason == "stop"
    # a held tail that never completes the stop string is sent at the end
    deltas = run(collect(gen, "a", greedy(max_tokens=2, stop=["cd"])))
    assert [d.text for d in deltas] == ["b", "c"]
    assert deltas[-1].finish_reason == "length"


def test_several_steps_a_call_stream_their_tokens_together_and_stop_where_one_step_does():
    """With 4 decode steps a call, a stream's deltas carry up to 4 tokens (the prefill's alone); stop strings
    and max_tokens falling inside a call end the completion exactly where single steps end it, with the same
    text, tokens, scores and usage."""
    g1, g4 = fake_generator(num_slots=2, max_seq_len=64), fake_generator(num_slots=2, max_seq_len=64, decode_steps=4)
    try:
        deltas = run(collect(g4, "a", greedy(max_tokens=10)))
        # the prefill's token, the engine's first step alone (its time: may four fit the call's budget?), then 4 a call
        assert [d.text for d in deltas] == ["b", "c", "defg", "hijk"] and deltas[-1].finish_reason == "length"
        for params in (greedy(max_tokens=10, stop=["zz", "fg"]), greedy(max_tokens=7, logprobs=2),
                       greedy(max_tokens=10, stop=["efx", "h"]), SamplingParams(max_tokens=9, temperature=1.0, seed=3)):
            one, four = run(g1.complete("a", params)), run(g4.complete("a", params))
            assert four == one
        assert run(g4.complete("a", greedy(max_tokens=10, stop=["fg"]))).text == "bcde"
    finally:
        g1.close()
        g4.close()


def test_logprobs_top_alternatives(gen):
    c = run(gen.complete("a", greedy(max_tokens=2, logprobs=2)))
    assert c.top_logprobs[0] == pytest.approx({"b": -LN2, "c": -2 * LN2})
    assert c.top_logprobs[1] == pytest.approx({"c": -LN2, "d": -2 * LN2})
    c = run(gen.complete("a", greedy(max_tokens=1, logprobs=0)))
    assert c.top_logprobs == [pytest.approx({"b": -LN2})]  # the chosen token is always there


def test_echo_with_logprobs(gen):
    c = run(gen.complete("a", greedy(max_tokens=2, echo=True, logprobs=1)))
    assert c.text == "abc"
    # every token the model read, as OpenAI and vLLM echo: the tokenizer's </s> first, with no logprob and no text
    # (the text is the prompt as sent); "a" is scored after it
    assert c.tokens == ["</s>", "a", "b", "c"]
    assert c.text_offset == [0, 0, 1, 2]
    assert c.token_logprobs[0] is None and c.top_logprobs[0] is None
    assert c.token_logprobs[1:] == pytest.approx([fake_logprob(2, 101), -LN2, -LN2])
    assert c.top_logprobs[1] == pytest.approx({"<unk>": -LN2, "a": fake_logprob(2, 101)})
    assert (c.prompt_tokens, c.completion_tokens) == (2, 2)  # usage counts what the model read


def test_echo_of_token_ids_keeps_an_explicit_bos(gen):
    c = run(gen.complete([2, 101], greedy(max_tokens=1, echo=True, logprobs=0)))
    assert (c.text, c.tokens, c.text_offset) == ("ab", ["</s>", "a", "b"], [0, 0, 1])
    assert c.token_logprobs[0] is None and c.top_logprobs[0] is None  # nothing before it to score it by
    assert c.token_logprobs[1:] == pytest.approx([fake_logprob(2, 101), -LN2])


def test_echo_without_logprobs_and_scoring_only(gen):
    deltas = run(collect(gen, "ab", greedy(max_tokens=1, echo=True)))
    assert [d.text for d in deltas] == ["ab", "c"]
    assert (deltas[0].tokens, deltas[0].token_logprobs) == (["</s>", "a", "b"], [None] * 3)  # not scored: not asked
    # max_tokens=0 with echo scores the prompt and generates nothing
    c = run(gen.complete("ab", greedy(max_tokens=0, echo=True, logprobs=0)))
    assert (c.text, c.finish_reason, c.completion_tokens) == ("ab", "length", 0)
    assert c.token_logprobs[0] is None and c.token_logprobs[1:] == pytest.approx([fake_logprob(2, 101), -LN2])
    with pytest.raises(ValueError, match="max_tokens"):
        run(gen.complete("ab", greedy(max_tokens=0)))


def test_eos_min_tokens_and_ignore_eos(gen):
    # after byte 255 (id 259) greedy wraps to ids 0 <s>, 1 <pad>, 2 </s> = EOS
    c = run(gen.complete([2, 259], greedy(max_tokens=8)))
    assert (c.token_ids, c.text, c.finish_reason, c.completion_tokens) == ([0, 1], "", "stop", 3)
    c = run(gen.complete([2, 259], greedy(max_tokens=5, min_tokens=5)))
    assert (c.token_ids, c.finish_reason) == ([0, 1, 3, 4, 5], "length")  # EOS skipped for the next one
    c = run(gen.complete([2, 259], greedy(max_tokens=4, ignore_eos=True)))
    assert (c.token_ids, c.finish_reason) == ([0, 1, 2, 3], "length")


def test_unscored_tokens_carry_no_logprobs_unless_something_needs_them(gen):
    c = run(gen.complete("a", greedy(max_tokens=3, score_tokens=False)))
    assert (c.text, c.token_logprobs, c.cumulative_logprob) == ("bcd", [None] * 3, None)
    c = run(gen.complete("a", greedy(max_tokens=3)))  # the default: nothing asks for them
    assert (c.text, c.token_logprobs, c.cumulative_logprob) == ("bcd", [None] * 3, None)
    c = run(gen.complete("a", greedy(max_tokens=3, score_tokens=False, logprobs=1)))  # asked for: scored
    assert c.token_logprobs == pytest.approx([-LN2] * 3) and c.cumulative_logprob == pytest.approx(-3 * LN2)
    # best_of ranks by the scores, so its samples are scored whatever score_tokens says
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, score_tokens=False)
    [all3] = gen.complete_many(["a"], params, n=3)
    assert all(c.cumulative_logprob is None for c in all3)
    [best] = gen.complete_many(["a"], params, n=1, best_of=3)
    assert best[0].cumulative_logprob == pytest.approx(
        max(sum(-LN2 * (1 + (s + k) % 3) for k in range(4)) for s in (p.seed for p in gen.choice_params(params, 3))))


def test_seeded_sampling_and_best_of(gen):
    # seed 0: steps j = 1, 2, 3, 1 from "a" (101): 102 104 107 108
    c = run(gen.complete("a", SamplingParams(max_tokens=4, temperature=1.0, seed=0, score_tokens=True)))
    assert c.text == "bdgh"
    assert c.cumulative_logprob == pytest.approx(-7 * LN2)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, score_tokens=True)
    seeds = [p.seed for p in gen.choice_params(params, 3)]
    assert seeds[0] == 5 and len(set(seeds)) == 3
    [all3] = gen.complete_many(["a"], params, n=3)
    for s, comp in zip(seeds, all3):
        js = [1 + (s + k) % 3 for k in range(4)]
        assert comp.cumulative_logprob == pytest.approx(-LN2 * sum(js))
        assert comp.token_ids == [101 + sum(js[:k + 1]) for k in range(4)]
    [best] = gen.complete_many(["a"], params, n=1, best_of=3)
    assert best[0].cumulative_logprob == pytest.approx(max(c.cumulative_logprob for c in all3))
    ranked = run(gen.complete_n("a", params, n=2, best_of=3))
    assert [c.cumulative_logprob for c in ranked] == pytest.approx(
        sorted((c.cumulative_logprob for c in all3), reverse=True)[:2])
    with pytest.raises(ValueError, match="best_of"):
        gen.complete_many(["a"], params, n=3, best_of=2)


def test_complete_many_keeps_prompt_order_and_batches(gen):
    before = gen.stats()
    prompts = ["a", "b", [2, 120], "ab", "x", "y"]
    out = gen.complete_many(prompts, greedy(max_tokens=6))
    assert [o[0].text for o in out] == ["bcdefg", "cdefgh", "uvwxyz", "cdefgh", "yz{|}~", "z{|}~\x7f"]
    after = gen.stats()
    steps = after["steps"] - before["steps"]
    step_tokens = after["step_tokens"] - before["step_tokens"]
    assert step_tokens == 6 * 5  # the first token of each comes from prefill
    assert step_tokens > steps   # requests shared decode steps
    hist = after["active_per_step"]
    assert sum(hist.values()) == after["steps"] and sum(k * v for k, v in hist.items()) == after["step_tokens"]
    assert after["running"] == 0 and after["queue_length"] == 0


def test_prompt_too_long_and_bad_params(gen):
    with pytest.raises(ValueError, match="maximum context length is 64"):
        gen.stream("a" * 60, greedy(max_tokens=10))  # raised at once, before any iteration
    with pytest.raises(ValueError, match="maximum context length is 64"):
        gen.complete_many(["a", "a" * 62], greedy(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        run(gen.complete("", greedy()))
    with pytest.raises(ValueError, match="vocabulary"):
        run(gen.complete([2, 999], greedy()))
    # beyond what this engine's model gives (the fake one: 5 alternatives; the real engine's: 20)
    with pytest.raises(ValueError, match="logprobs: at most 5 alternatives per token with this model, got 6"):
        run(gen.complete("ab", SamplingParams(max_tokens=2, logprobs=6)))
    for bad in [dict(temperature=-1), dict(top_p=0), dict(logprobs=21), dict(stop=["a"] * 5), dict(stop=[""]),
                dict(max_tokens=-1), dict(min_tokens=20, max_tokens=4)]:
        field = next(iter(bad))
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad).validate()


def test_cancelled_stream_frees_its_slot():
    model = GatedSlots(num_slots=1, max_seq_len=64)
    gen = Generator(Engine(model), byte_tokenizer())

    async def main():
        stream = gen.stream("a", greedy(max_tokens=50))
        first = await stream.__anext__()  # the first token comes from prefill, no step needed
        await stream.aclose()             # the client goes away
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        model.gate.release(100)
        # one slot only: the next request can run only once the cancelled one left it
        return first, await gen.complete("x", greedy(max_tokens=3))

    try:
        first, nxt = run(main())
        assert first.text == "b" and nxt.text == "yz{"
        stats = gen.stats()
        assert stats["generated_tokens"] == 1 + 3  # nothing more was generated for the cancelled request
        assert model.active == 0 and model.inserted == [0, 0]
    finally:
        gen.close()


def test_a_steps_deltas_for_every_stream_reach_the_loop_in_one_wake_up_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        box = Mailbox.for_loop(loop)
        assert Mailbox.for_loop(loop) is box  # one a loop
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
        try:
            queues = [asyncio.Queue() for _ in range(4)]
            for step in range(3):  # three steps' deltas put before the loop gets a turn
                for i, q in enumerate(queues):
                    box.put(q, (i, step))
            assert len(wakes) == 1 and all(q.empty() for q in queues)
            await asyncio.sleep(0)  # the one wake-up delivers all of them
            got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
            box.put(queues[0], "next")  # the mailbox is empty again: a new wake-up
            assert len(wakes) == 2
            await asyncio.sleep(0)
            return got, queues[0].get_nowait()
        finally:
            loop.call_soon_threadsafe = real

    got, nxt = run(main())
    assert got == [[(i, 0), (i, 1), (i, 2)] for i in range(4)] and nxt == "next"
    gc.collect()
    assert not [loop for loop in Mailbox._of_loop if loop.is_closed()]  # a finished loop's mailbox went with it


def test_a_stream_past_its_deadline_ends_with_timeout_after_its_deltas_and_frees_its_slot():
    model = GatedSlots(num_slots=1, max_seq_len=64)
    gen = Generator(Engine(model), byte_tokenizer())

    async def main():
        loop = asyncio.get_running_loop()
        stream = gen.stream("a", greedy(max_tokens=50))
        stream.expire_at(loop.time() + 0.05)  # the gate holds every step: only the prefill's token comes
        first = await stream.__anext__()
        with pytest.raises(TimeoutError):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        model.gate.release(100)
        return first, await gen.complete("x", greedy(max_tokens=3))  # the slot was freed

    try:
        first, nxt = run(main())
        assert first.text == "b" and nxt.text == "yz{"
        assert gen.stats()["generated_tokens"] == 1 + 3
    finally:
        gen.close()


def test_queue_full_is_raised_at_submit():
    gen = fake_generator(num_slots=1, max_queue=2, start=False)  # nothing is admitted yet
    try:
        async def main():
            s1 = gen.stream("a", greedy(max_tokens=2))
            s2 = gen.stream("b", greedy(max_tokens=2))
            with pytest.raises(QueueFull):
                gen.stream("c", greedy(max_tokens=2))
            gen.engine.start()
            return [Completion.join([d async for d in s]) for s in (s1, s2)]
        c1, c2 = run(main())
        assert (c1.text, c2.text) == ("bc", "cd")
    finally:
        gen.close()


def test_complete_n_cancels_started_streams_when_a_later_one_cannot_start():
    gen = fake_generator(num_slots=1, max_queue=2, start=False)  # nothing leaves the queue
    try:
        with pytest.raises(QueueFull):
            run(gen.complete_n("a", SamplingParams(max_tokens=2, seed=1), n=3))
        assert gen.stats()["queue_length"] == 0  # the two that were queued are gone again
        gen.engine.start()
        assert run(gen.complete("a", greedy(max_tokens=2))).text == "bc"
    finally:
        gen.close()


class BlockingBeamModel:
    """A fake beam model that holds every search until `release` is set and records overlapping calls."""

    def __init__(self):
        from opt_serving.engine.fake import FakeBeamModel
        self.inner, self.release = FakeBeamModel(), threading.Event()
        self.started, self.running, self.most_at_once = threading.Semaphore(0), 0, 0
        self.lock = threading.Lock()

    def generate(self, **kw):
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.started.release()
        self.release.wait()
        with self.lock:
            self.running -= 1
        return self.inner.generate(**kw)


def test_beam_search_gives_the_most_likely_continuation(gen):
    # the fake's best sequence is the greedy one (every step's best costs -ln2 whatever came before)
    async def main():
        return await gen.beam("a", greedy(max_tokens=4), num_beams=4)
    c = run(main())
    assert (c.text, c.token_ids, c.finish_reason) == ("bcde", [102, 103, 104, 105], "length")
    assert (c.prompt_tokens, c.completion_tokens) == (2, 4)

    async def stops():
        eos = await gen.beam([2, 257], greedy(max_tokens=8), num_beams=2)   # 258, 259, 0, 1, then EOS
        cut = await gen.beam("a", greedy(max_tokens=8, stop=["de"]), num_beams=2)
        return eos, cut
    eos, cut = run(stops())
    assert (eos.token_ids, eos.finish_reason, eos.completion_tokens) == ([258, 259, 0, 1], "stop", 5)
    assert (cut.text, cut.finish_reason) == ("bc", "stop")
    with pytest.raises(ValueError, match="context length"):
        gen.beam("a", greedy(max_tokens=63), num_beams=2)  # refused at once, before anything is queued


def test_beam_searches_run_one_at_a_time_in_a_bounded_queue():
    from opt_serving.engine.fake import fake_engine
    model = BlockingBeamModel()
    gen = Generator(fake_engine(max_queue=2), byte_tokenizer(), model=model)
    try:
        async def main():
            first = gen.beam("a", greedy(max_tokens=2), num_beams=2)
            second = gen.beam("k", greedy(max_tokens=2), num_beams=2)
            await asyncio.to_thread(model.started.acquire)  # the first is running, the second waits
            with pytest.raises(QueueFull):
                gen.beam("x", greedy(max_tokens=2), num_beams=2)
            model.release.set()
            return [c.text for c in await asyncio.gather(first, second)]
        assert run(main()) == ["bc", "lm"]
        assert model.most_at_once == 1
    finally:
        gen.close()


def _wait_done(gen, timeout=30.0):
    """Until no search is queued or running (the worker's own bookkeeping, updated as each one ends)."""
    deadline = time.monotonic() + timeout
    while gen._beams.pending != (0, 0):
        assert time.monotonic() < deadline, gen._beams.pending
        time.sleep(0.01)


def test_a_cancelled_running_beam_search_stops_before_its_next_step():
    from opt_serving.engine.fake import FakeBeamModel, fake_engine
    model = FakeBeamModel().hold(2)
    gen = Generator(fake_engine(max_seq_len=256), byte_tokenizer(), model=model)
    try:
        async def main():
            search = gen.beam("a", greedy(max_tokens=200), num_beams=2)
            assert await asyncio.to_thread(model.reached.wait, 30)  # running, inside step 2
            search.cancel()  # the client left
            # the future's done callbacks (which stop the search) are scheduled with call_soon: one turn of the
            # loop runs them, before this task resumes
            await asyncio.sleep(0)
            model.go.set()
            await asyncio.to_thread(_wait_done, gen)
            return (await gen.beam("k", greedy(max_tokens=2), num_beams=2)).text
        assert run(main()) == "lm"  # the worker is free again
        assert model.stopped_at == 3  # of 200 steps: the one after the cancel did not run
    finally:
        gen.close()


def test_beam_streams_past_their_deadline_end_with_timeout_and_stop_the_search():
    from opt_serving.engine.fake import FakeBeamModel, fake_engine
    from opt_serving.text.beam import BeamSearch
    model = FakeBeamModel().hold(2)
    gen = Generator(fake_engine(max_seq_len=256), byte_tokenizer(), model=model)
    try:
        async def main():
            loop = asyncio.get_running_loop()
            streams = gen.beam_streams([("a", greedy(max_tokens=200))], BeamSearch(2, num_return=2))
            for st in streams:
                st.expire_at(loop.time() + 0.05)
            assert await asyncio.to_thread(model.reached.wait, 30)  # running, held inside step 2
            for st in streams:  # both choices end with the deadline's error
                with pytest.raises(TimeoutError):
                    await st.__anext__()
            model.go.set()
            await asyncio.to_thread(_wait_done, gen)
            return (await gen.beam("k", greedy(max_tokens=2), num_beams=2)).text
        assert run(main()) == "lm"  # the search stopped; the worker is free again
        assert model.stopped_at == 3
    finally:
        gen.close()


def test_beam_searches_are_bounded_by_a_budget_of_beam_tokens():
    """num_beams x (prompt + max_tokens), summed over a request's prompts: over what is left, QueueFull
    (429) while others hold it; over the whole budget, a 400 naming it (a retry could never fit)."""
    from opt_serving.errors import InvalidRequest
    from opt_serving.engine.fake import FakeBeamModel, fake_engine
    model = FakeBeamModel().hold(0)
    gen = Generator(fake_engine(max_queue=16), byte_tokenizer(), model=model, beam_budget=100)
    try:
        async def main():
            # "a" is 2 tokens: 4 beams x (2 + 8) = 40 each
            first = gen.beams([("a", greedy(max_tokens=8)), ("k", greedy(max_tokens=8))], num_beams=4)
            assert gen._beams.pending == (2, 80)
            assert await asyncio.to_thread(model.reached.wait, 30)
            with pytest.raises(QueueFull, match="80 beam tokens are running or waiting; 40 more"):
                gen.beam("x", greedy(max_tokens=8), num_beams=4)
            with pytest.raises(InvalidRequest, match="104 beam tokens .* budget of 100") as e:
                gen.beams([("x", greedy(max_tokens=11))] * 2, num_beams=4)
            assert (e.value.param, e.value.code) == ("num_beams", "beam_budget_exceeded")
            assert gen._beams.pending == (2, 80)  # neither refusal queued anything
            model.go.set()
            texts = [c.text for c in await asyncio.gather(*first)]
            await asyncio.to_thread(_wait_done, gen)
            return texts, (await gen.beam("x", greedy(max_tokens=4), num_beams=4)).text  # room again
        assert run(main()) == (["bcdefghi", "lmnopqrs"], "yz{|")
    finally:
        gen.close()


def test_closing_the_generator_stops_a_running_beam_search_and_tells_its_caller():
    from opt_serving.engine.scheduler import EngineClosed
    from opt_serving.engine.fake import FakeBeamModel, fake_engine
    model = FakeBeamModel().hold(1)
    gen = Generator(fake_engine(max_seq_len=256), byte_tokenizer(), model=model)

    async def main():
        search = gen.beam("a", greedy(max_tokens=200), num_beams=2)
        assert await asyncio.to_thread(model.reached.wait, 30)
        gen.close()  # (shutting down: it does not wait for the search)
        model.go.set()
        with pytest.raises(EngineClosed):
            await search
    try:
        run(main())
    finally:
        model.go.set()
        gen.close()
    assert model.stopped_at == 2


def test_beam_search_needs_a_model():
    from opt_serving.engine.fake import fake_engine
    gen = Generator(fake_engine(), byte_tokenizer())  # FakeSlots has no parameters to search with
    try:
        with pytest.raises(ValueError, match="beam search"):
            gen.beam("a", greedy(max_tokens=2), num_beams=2)
    finally:
        gen.close()


def test_detokenizer_holds_partial_characters():
    tok = byte_tokenizer()
    d = Detokenizer(tok)
    e_acute = [4 + b for b in "é".encode()]  # two bytes, two tokens
    assert d.add(4 + ord("x")) == "x"
    assert d.add(e_acute[0]) == ""   # half a character is held
    assert d.add(e_acute[1]) == "é"
    assert d.add(e_acute[0]) == "" and d.flush() == "\ufffd"  # a character cut off at the end


# ---- the real OPT tokenizer ----

@pytest.fixture(scope="module")
def opt_gen(opt_tokenizer):
    g = fake_generator(num_slots=2, max_seq_len=64, tokenizer=opt_tokenizer)
    yield g
    g.close()


def test_real_tokenizer_encodes_and_round_trips(opt_gen):
    assert opt_gen.encode("Hello world") == [2, 31414, 232]
    for text in ["Hello world", " leading space", "naïve café ☕ 😀\nnew line\ttab", "a  b   c"]:
        assert opt_gen.decode(opt_gen.encode(text)) == text


def test_real_tokenizer_streams_whole_characters(opt_tokenizer):
    ids = opt_tokenizer.encode(" 😀 ok")[1:]
    d = Detokenizer(opt_tokenizer)
    pieces = [d.add(i) for i in ids]
    assert "".join(pieces) == " 😀 ok"
    assert all("\ufffd" not in p for p in pieces)


def test_real_tokenizer_echo_and_stop(opt_gen, opt_tokenizer):
    # greedy continues 233, 234, ... after "Hello world" = [2, 31414, 232]
    expected = [opt_tokenizer.decode([i]) for i in (233, 234, 235)]
    c = run(opt_gen.complete("Hello world", greedy(max_tokens=3, echo=True, logprobs=1)))
    assert c.text == "Hello world" + "".join(expected)
    # as vLLM: every token the model read as text, the added </s> first (no logprob, no text)
    assert c.tokens[:3] == ["</s>", "Hello", " world"]
    assert c.text_offset == [0, 0, 5, 11, 11 + len(expected[0]), 11 + len(expected[0] + expected[1])]
    assert c.token_logprobs[0] is None and c.token_logprobs[1] is not None
    assert c.token_logprobs[3:] == pytest.approx([-LN2] * 3)
    # stop at the second generated token's text: only the first survives
    c = run(opt_gen.complete("Hello world", greedy(max_tokens=3, stop=[expected[1]])))
    assert (c.text, c.token_ids, c.finish_reason) == (expected[0], [233], "stop")


def test_negative_seeds_are_valid_and_reproducible(gen):
    """OpenAI seeds are any int64 (schemathesis found -2 crashing the GPT-J route's n-way seeding)."""
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=-2)
    seeds = [p.seed for p in gen.choice_params(params, 3)]
    assert seeds[0] == -2 and len(set(seeds)) == 3 and all(s >= 0 for s in seeds[1:])
    assert seeds == [p.seed for p in gen.choice_params(params, 3)]
    first = gen.complete_many(["a"], params, n=2)[0]
    again = gen.complete_many(["a"], params, n=2)[0]
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


# ---- token text in logprobs (OpenAI's and vLLM's convention, not the vocabulary's spelling) ----

def _token_bytes(token: str) -> bytes:
    """A logprobs token back to its bytes: text, or OpenAI's escape "bytes:\\xf0\\x9f" for part of a character."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def test_logprob_tokens_are_their_text_and_join_to_the_completion(opt_gen, opt_tokenizer):
    # greedy continues 39301, 39302, ... after "... naïve" (39300): whatever those are, each is its own text
    c = run(opt_gen.complete("Hello world, café naïve", greedy(max_tokens=3, echo=True, logprobs=2)))
    assert c.tokens[:6] == ["</s>", "Hello", " world", ",", " café", " naïve"]
    assert "".join(c.tokens[1:]) == c.text  # (the </s> the tokenizer added is no part of the text)
    assert [c.text_offset[i] + len(c.tokens[i]) for i in range(1, len(c.tokens) - 1)] == c.text_offset[2:]
    # the keys of top_logprobs are text too: a client finds the chosen token under its own text
    assert all(tok in top for tok, top in zip(c.tokens[2:], c.top_logprobs[2:]))
    assert not any("\u0120" in k for top in c.top_logprobs[2:] for k in top)
    expected = {opt_tokenizer.decode([i]) for i in (39301, 39302)}
    assert set(c.top_logprobs[-3]) >= expected  # after " naïve": its two most likely successors


def test_part_of_a_multibyte_character_is_a_byte_escape(opt_gen):
    # " 😀" is two tokens, " \xf0\x9f\x98" and "\x80": neither is text alone
    c = run(opt_gen.complete(" 😀 ok", greedy(max_tokens=1, echo=True, logprobs=0)))
    assert c.tokens[:4] == ["</s>", "bytes:\\x20\\xf0\\x9f\\x98", "bytes:\\x80", " ok"]
    assert b"".join(_token_bytes(t) for t in c.tokens[1:]).decode() == c.text
    assert c.text_offset[:4] == [0, 0, 0, 2]  # both halves start where the character does; " ok" after it

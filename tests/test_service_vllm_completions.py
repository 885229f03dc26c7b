"""vLLM's extensions to `/v1/completions` as its own tests (tests/entrypoints/openai/test_completion*.py,
test_return_token_ids.py) and its clients (RL rollout frameworks, eval harnesses) use them, through the official
`openai` client's `extra_body`: return_token_ids, return_tokens_as_token_ids, truncate_prompt_tokens with
truncation_side, stream_options.continuous_usage_stats, use_beam_search, bad_words.

The fake engine behind the byte tokenizer (engine/fake.py): greedy continues with the next byte, so prompt "a"
(ids [2, 101]) gives "bcdef..." (ids 102, 103, ...); id 2 (</s>) is EOS, and after id 259 comes id 0.
"""
import pytest

openai = pytest.importorskip("openai")

from opt_serving.service.app import create_app  # noqa: E402
from opt_serving.service.testserver import serve_in_thread  # noqa: E402
from opt_serving.text.fake import fake_generator  # noqa: E402


@pytest.fixture(scope="module")
def client():
    g = fake_generator(num_slots=4, max_seq_len=64, max_queue=32)
    with serve_in_thread(create_app(g)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    g.close()


def complete(client, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("prompt", "max_tokens", "temperature", "n", "stream",
                                                         "logprobs", "echo", "stop", "seed", "stream_options")}
    return client.completions.create(model="opt-fake", extra_body=extra, **kw)


def test_return_token_ids_gives_the_generated_and_the_prompt_ids(client):
    r = complete(client, prompt="a", max_tokens=5, temperature=0, return_token_ids=True)
    assert r.choices[0].token_ids == [102, 103, 104, 105, 106] and r.choices[0].prompt_token_ids == [2, 101]
    plain = complete(client, prompt="a", max_tokens=5, temperature=0, return_token_ids=False).model_dump()
    assert plain["choices"][0].get("token_ids") is None and plain.get("prompt_token_ids") is None
    # the EOS that ended it is among the generated ids (what a trainer scores), not in the text
    eos = complete(client, prompt=[2, 257], max_tokens=8, temperature=0, return_token_ids=True).choices[0]
    assert (eos.finish_reason, eos.token_ids) == ("stop", [258, 259, 0, 1, 2])
    # a stop string cuts the text, not the ids of the tokens generated
    cut = complete(client, prompt="a", max_tokens=8, temperature=0, stop=["cd"], return_token_ids=True).choices[0]
    assert (cut.text, cut.token_ids) == ("b", [102, 103, 104])


def test_streamed_token_ids_join_to_the_answers(client):
    chunks = list(complete(client, prompt="a", max_tokens=6, temperature=0, stream=True, return_token_ids=True,
                           logprobs=0, return_tokens_as_token_ids=True))
    assert chunks[0].choices[0].prompt_token_ids == [2, 101]
    streamed = [t for c in chunks for t in c.choices[0].token_ids]
    named = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == [102, 103, 104, 105, 106, 107] and named == [f"token_id:{t}" for t in streamed]


def test_return_tokens_as_token_ids_names_tokens_and_alternatives_by_id(client):
    lp = complete(client, prompt="a", max_tokens=2, temperature=0, logprobs=2, echo=True,
                  return_tokens_as_token_ids=True).choices[0].logprobs
    assert lp.tokens == ["token_id:2", "token_id:101", "token_id:102", "token_id:103"]
    assert set(lp.top_logprobs[2]) == {"token_id:102", "token_id:103"}


@pytest.mark.parametrize("side, kept", [("right", [0, 1, 2, 3]), ("left", [4, 5, 6, 7]), (None, [4, 5, 6, 7])])
def test_truncate_prompt_tokens_keeps_the_side_asked(client, side, kept):
    prompt = [t + 10 for t in range(8)]
    extra = {"truncation_side": side} if side else {}
    r = complete(client, prompt=prompt, max_tokens=1, temperature=0, return_token_ids=True,
                 truncate_prompt_tokens=4, **extra)
    assert r.choices[0].prompt_token_ids == [prompt[i] for i in kept] and r.usage.prompt_tokens == 4
    assert r.choices[0].token_ids == [prompt[kept[-1]] + 1]  # the fake continues from the last token kept


def test_truncating_a_text_prompt_and_to_what_fits(client):
    r = complete(client, prompt="abcdefgh", max_tokens=2, temperature=0, return_token_ids=True,
                 truncate_prompt_tokens=3)
    assert r.choices[0].prompt_token_ids == [ord(c) + 4 for c in "fgh"] and r.choices[0].text == "ij"
    # -1: as many as fit beside max_tokens; a prompt too long for the context is cut instead of refused
    long = complete(client, prompt="x" * 100, max_tokens=4, temperature=0, return_token_ids=True,
                    truncate_prompt_tokens=-1)
    assert long.usage.prompt_tokens == 60 and long.choices[0].text == "yz{|"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        complete(client, prompt="x" * 100, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"truncate_prompt_tokens \(61\) must be at most"):
        complete(client, prompt="a", max_tokens=4, truncate_prompt_tokens=61)
    with pytest.raises(openai.BadRequestError, match="truncation_side"):
        complete(client, prompt="a", truncate_prompt_tokens=1, truncation_side="middle")


def test_stream_options_as_vllms_tests_check_them(client):
    def stream(**options):
        return list(complete(client, prompt="abc", max_tokens=5, temperature=0, stream=True,
                             stream_options=options))
    assert all(c.usage is None for c in stream(include_usage=False, continuous_usage_stats=False))
    assert all(c.usage is None for c in stream(include_usage=False, continuous_usage_stats=True))
    chunks = stream(include_usage=True, continuous_usage_stats=False)
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 5)
    chunks = stream(include_usage=True, continuous_usage_stats=True)
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 5, 5]
    assert all(c.usage.prompt_tokens == 4 and c.usage.total_tokens == 4 + c.usage.completion_tokens for c in chunks)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError, match="stream_options"):
            complete(client, prompt="abc", stream_options=options)


def test_continuous_usage_is_each_choices_own_with_n(client):
    chunks = list(complete(client, prompt="a", max_tokens=3, n=2, seed=1, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
    seen = {0: [], 1: []}
    for c in chunks[:-1]:
        seen[c.choices[0].index].append(c.usage.completion_tokens)
    assert seen == {0: [1, 2, 3], 1: [1, 2, 3]}
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 6)  # the prompt once


def test_use_beam_search_as_vllms_batch_test(client):
    for prompts in (["a"] * 2, [[2, 101]] * 2):
        batch = complete(client, prompt=prompts, n=2, max_tokens=5, temperature=0, use_beam_search=True)
        texts = [c.text for c in batch.choices]
        assert len(texts) == 4 and texts[0] != texts[1], "beam search should be different"
        assert texts[0] == texts[2] and texts[1] == texts[3], "two copies of the same prompt should be the same"
        assert texts[:2] == ["bcdef", "bcdeg"]  # the greedy beam first
    with pytest.raises(openai.BadRequestError, match="best_of > n cannot be combined with use_beam_search"):
        complete(client, prompt="a", n=1, best_of=2, use_beam_search=True)
    with pytest.raises(openai.BadRequestError, match="length_penalty goes with use_beam_search"):
        complete(client, prompt="a", length_penalty=0.5)
    assert complete(client, prompt="a", max_tokens=1, length_penalty=1.0).choices  # vLLM's default, as clients send it
    streamed = list(complete(client, prompt="a", n=2, max_tokens=3, stream=True, use_beam_search=True,
                             return_token_ids=True))
    by_index = {c.choices[0].index: (c.choices[0].text, c.choices[0].token_ids) for c in streamed}
    assert by_index == {0: ("bcd", [102, 103, 104]), 1: ("bce", [102, 103, 105])}


def test_bad_words_beyond_what_the_slots_hold_are_a_400_naming_them(client):
    with pytest.raises(openai.BadRequestError, match="bad_words: at most 8 token sequences") as e:
        complete(client, prompt="a", bad_words=[f"w{i}" for i in range(9)])
    assert e.value.body["param"] == "bad_words"


def test_bad_words_are_not_generated(opt_vocab_server):
    """The real engine (random weights of OPT's vocabulary): the greedy answer's first word, banned, is not its
    first word any more."""
    g, _, client, _ = opt_vocab_server
    prompt = "The capital of France is"
    first = client.completions.create(model="opt-small", prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0]
    word = first.text.strip() or first.text
    banned = client.completions.create(model="opt-small", prompt=prompt, max_tokens=1, temperature=0,
                                       extra_body={"return_token_ids": True, "bad_words": [word]})
    assert banned.choices[0].token_ids != first.token_ids

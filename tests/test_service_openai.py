"""The official `openai` client against a running server (uvicorn on 127.0.0.1 in a thread).

Fake engine: exact expected text (see tests/test_service_app.py). The real tiny model's checks (greedy text over
HTTP equals offline generate()) are in tests/test_service_tiny.py, which compiles it once.
"""
import math

import pytest

openai = pytest.importorskip("openai")

from opt_serving.generator import SamplingParams  # noqa: E402
from opt_serving.service.app import create_app  # noqa: E402
from opt_serving.service.testserver import serve_in_thread  # noqa: E402
from opt_serving.testing.fake_engine import fake_generator  # noqa: E402


@pytest.fixture(scope="module")
def fake_server():
    g = fake_generator(num_slots=4, max_seq_len=64, max_queue=32)
    with serve_in_thread(create_app(g)) as url:
        yield g, openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=30)
    g.close()


def test_completion(fake_server):
    _, client = fake_server
    r = client.completions.create(model="opt-fake", prompt="a", max_tokens=5, temperature=0)
    assert r.choices[0].text == "bcdef" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 5
    assert client.models.list().data[0].id == "opt-fake"


def test_streaming(fake_server):
    _, client = fake_server
    chunks = list(client.completions.create(model="opt-fake", prompt="a", max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "bcdefg"
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason == "length"


def test_logprobs(fake_server):
    _, client = fake_server
    r = client.completions.create(model="opt-fake", prompt="a", max_tokens=2, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["b", "c"] and lp.text_offset == [1, 2]
    assert lp.token_logprobs == pytest.approx([-math.log(2)] * 2)
    assert set(lp.top_logprobs[0]) == {"b", "c", "d"}


def test_echo(fake_server):
    _, client = fake_server
    r = client.completions.create(model="opt-fake", prompt="hi", max_tokens=2, temperature=0, echo=True,
                                  logprobs=0)
    assert r.choices[0].text == "hijk"
    # the prompt's tokens as vLLM echoes them: the tokenizer's </s> first, with a null logprob
    assert r.choices[0].logprobs.tokens == ["</s>", "h", "i", "j", "k"]
    assert r.choices[0].logprobs.token_logprobs[0] is None and r.choices[0].logprobs.token_logprobs[1] < 0


def test_stop(fake_server):
    _, client = fake_server
    r = client.completions.create(model="opt-fake", prompt="a", max_tokens=10, temperature=0, stop=["e"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("bcd", "stop")
    chunks = list(client.completions.create(model="opt-fake", prompt="a", max_tokens=10, temperature=0,
                                            stop="ef", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "bcd"


def test_errors_raise_the_clients_typed_exceptions(fake_server):
    _, client = fake_server
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="opt-fake", prompt="a", max_tokens=100)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="opt-fake", prompt="a", n=2, best_of=1)


def test_greedy_over_http_equals_offline_generation_fake(fake_server):
    g, client = fake_server
    prompts = ["a", "hello", "xyz"]
    offline = g.complete_many(prompts, SamplingParams(max_tokens=7, temperature=0))
    for prompt, [c] in zip(prompts, offline):
        r = client.completions.create(model="opt-fake", prompt=prompt, max_tokens=7, temperature=0)
        assert r.choices[0].text == c.text


def test_vllm_extensions_through_extra_body(fake_server):
    _, client = fake_server
    r = client.completions.create(model="opt-fake", prompt="a", max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [104], "include_stop_str_in_output": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("bcd", "stop")
    with pytest.raises(openai.BadRequestError, match="min_p"):  # vLLM's range: 0 to 1
        client.completions.create(model="opt-fake", prompt="a", extra_body={"min_p": 1.5})


@pytest.fixture(scope="module")
def opt_server(opt_tokenizer):
    """The fake engine behind the real OPT tokenizer: its greedy tokens are whatever ids follow the prompt's."""
    g = fake_generator(num_slots=4, max_seq_len=64, max_queue=32, tokenizer=opt_tokenizer)
    with serve_in_thread(create_app(g)) as url:
        yield g, url, openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=30)
    g.close()


def test_logprob_tokens_are_text_in_every_route(opt_server):
    import requests
    _, url, client = opt_server
    prompt = "Is it café? yes"
    r = client.completions.create(model="opt-fake", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens[:6] == ["</s>", "Is", " it", " café", "?", " yes"] and "".join(lp.tokens[1:]) == r.choices[0].text
    assert lp.top_logprobs[-1][lp.tokens[-1]] == pytest.approx(lp.token_logprobs[-1])
    chunks = list(client.completions.create(model="opt-fake", prompt=prompt, max_tokens=3, temperature=0,
                                            logprobs=1, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens[6:] and "".join(streamed) == "".join(c.choices[0].text for c in chunks)
    meta = requests.post(url + "/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0},
                         timeout=30).json()["choices"][0]
    assert meta["logprobs"]["tokens"] == lp.tokens[6:] and "".join(meta["logprobs"]["tokens"]) == meta["text"]

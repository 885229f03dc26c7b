"""The official `openai` client against a running server (uvicorn on 127.0.0.1 in a thread).

Fake engine: exact expected text (see tests/test_service_app.py). The real tiny model's checks (greedy text over
HTTP equals offline generate()) are in tests/test_service_tiny.py, which compiles it once.
"""
import math

import numpy as np

import pytest

openai = pytest.importorskip("openai")

from opt_serving.text.generator import SamplingParams  # noqa: E402
from opt_serving.service.app import create_app  # noqa: E402
from opt_serving.service.testserver import serve_in_thread  # noqa: E402
from opt_serving.text.fake import fake_generator  # noqa: E402


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


# ---- what vLLM's clients expect (random weights of OPT's vocabulary behind the real tokenizer: conftest) ----
def _hf_logprobs(hf, ids):
    """Hugging Face's log-softmax of the next-token logits at every position of `ids` -> [n, V] numpy."""
    import torch
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def test_a_text_prompts_echo_lists_its_leading_bos_with_a_null_logprob(opt_vocab_server):
    g, _, client, _ = opt_vocab_server
    prompt = "Hello, my name is"
    r = client.completions.create(model="opt-small", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 11 and lp.tokens[:3] == ["</s>", "Hello", ","]  # as vLLM: 6 prompt tokens + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and None not in lp.token_logprobs[1:]
    assert r.choices[0].text.startswith(prompt) and r.usage.prompt_tokens == 6
    # the same ids sent as tokens are echoed the same way
    ids = client.completions.create(model="opt-small", prompt=g.encode(prompt), max_tokens=5, temperature=0,
                                    echo=True, logprobs=1).choices[0].logprobs
    assert ids.tokens == lp.tokens and ids.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:])


def test_stream_options_need_stream(opt_vocab_server):
    _, _, client, _ = opt_vocab_server
    with pytest.raises(openai.BadRequestError, match="stream_options can only be set when stream is true"):
        client.completions.create(model="opt-small", prompt="hi", max_tokens=2, stream_options={"include_usage": True})
    chunks = list(client.completions.create(model="opt-small", prompt="hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


def test_only_the_served_names_are_served(opt_vocab_server):
    import requests
    _, url, client, _ = opt_vocab_server
    assert [m.id for m in client.models.list()] == ["opt-small", "my-opt"]  # --served-model-name opt-small my-opt
    assert client.completions.create(model="my-opt", prompt="hi", max_tokens=1).model == "my-opt"
    with pytest.raises(openai.NotFoundError, match="The model `opt-125m` does not exist.") as e:
        client.completions.create(model="opt-125m", prompt="hi", max_tokens=1)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    r = requests.post(url + "/tokenize", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `nope` does not exist."


def test_tokenize_and_detokenize_in_vllms_shapes(opt_vocab_server):
    import requests
    _, url, _, _ = opt_vocab_server
    post = lambda path, body: requests.post(url + path, json=body, timeout=30)  # noqa: E731
    assert post("/tokenize", {"model": "opt-small", "prompt": "Hello world"}).json() == {
        "tokens": [2, 31414, 232], "count": 3, "max_model_len": 256, "token_strs": None}
    r = post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}).json()
    assert (r["tokens"], r["token_strs"]) == ([31414, 232], ["Hello", " world"])
    assert post("/detokenize", {"tokens": [2, 31414, 232]}).json() == {"prompt": "</s>Hello world"}
    bad = post("/detokenize", {"tokens": [31414, 50272]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post("/tokenize", {"messages": []}).status_code == 400  # (no chat template here: a prompt is needed)


def test_prompt_logprobs_are_the_models_own(opt_vocab_server):
    g, _, client, hf = opt_vocab_server
    prompt = "The capital of France is Paris"
    ids = g.encode(prompt)
    r = client.completions.create(model="opt-small", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 3})
    got = r.choices[0].model_extra["prompt_logprobs"]
    ref = _hf_logprobs(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, tok = ref[i - 1], ids[i]
        entry = got[i][str(tok)]
        assert entry["logprob"] == pytest.approx(row[tok], abs=1e-4)
        # rank: the tokens at least as likely (near-ties within float32's error either way)
        assert (row > row[tok] + 1e-4).sum() < entry["rank"] <= (row >= row[tok] - 1e-4).sum()
        assert entry["decoded_token"] == g.token_text(tok)
        top = np.argsort(-row)[:3]
        assert {int(t) for t in top} <= {int(k) for k in got[i]}
        assert [got[i][str(t)]["rank"] for t in top if t != tok] == [r + 1 for r, t in enumerate(top) if t != tok]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="opt-small", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 21})


def test_logit_bias_is_added_to_the_logits_the_token_is_chosen_from(opt_vocab_server):
    """Against Hugging Face's logits of the same weights: a token biased by its gap to the best (and a little more)
    is chosen, by a little less it is not; the bias applies at every step; the logprobs stay the model's own."""
    g, _, client, hf = opt_vocab_server
    ids = g.encode("Paris is the capital city of")
    first = _hf_logprobs(hf, ids)[-1]
    order = np.argsort(-first)
    best, target = int(order[0]), int(order[9])
    gap = first[best] - first[target]  # (log-softmax differences are logit differences)

    def complete(bias, n=1):
        return client.completions.create(model="opt-small", prompt=ids, max_tokens=n, temperature=0, logprobs=0,
                                         logit_bias={str(t): b for t, b in bias.items()}).choices[0]
    c = complete({target: gap + 0.01})
    assert c.logprobs.tokens == [g.token_text(target)]
    assert c.logprobs.token_logprobs[0] == pytest.approx(first[target], abs=1e-4)  # not the biased distribution
    assert complete({target: gap - 0.01}).logprobs.tokens == [g.token_text(best)]
    # the bias holds at the second step (a decode step) too: a token it lifts above that step's best, but not above
    # the first step's
    second = _hf_logprobs(hf, ids + [best])[-1]
    lift = {int(t): (second.max() - second[t], first[best] - first[t]) for t in np.argsort(-second)[1:200]
            if t != best}
    t, (lo, hi) = next((t, r) for t, r in lift.items() if r[0] + 0.02 < r[1])
    assert complete({t: (lo + hi) / 2}, n=2).logprobs.tokens == [g.token_text(best), g.token_text(t)]
    for bad, match in (({50272: 1}, "outside the vocabulary"), ({5: 101}, r"\[-100, 100\]")):
        with pytest.raises(openai.BadRequestError, match=match):
            complete(bad)

"""The service over the real embedded tiny OPT (random weights, its own tokenizer), one generator per module:
greedy text through the `openai` client equals offline generate(), and 64 concurrent streaming clients all get
their offline output while the decode steps carry more than one request each."""
import asyncio
import json
import re

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from opt_serving.text.generator import SamplingParams  # noqa: E402
from opt_serving.text.loading import load_generator  # noqa: E402
from opt_serving.service.app import create_app  # noqa: E402
from opt_serving.service.testserver import serve_in_thread  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny():
    try:
        from opt_serving.model.embedded import ensure_embedded_model
    except ImportError:
        pytest.skip("opt_serving.model.embedded not available yet")
    path = ensure_embedded_model()
    # each step compiled at its first use: the service is tested here, warm-up in test_engine.py and test_runner.py
    g = load_generator("jax/opt-tiny", str(path), max_batch_size=16, max_seq_len=64, max_queue=64, warmup=False)
    with serve_in_thread(create_app(g)) as url:
        yield g, path, url
    g.close()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_greedy_over_http_equals_offline_generate(tiny):
    from opt_serving.model.wrapper import get_model
    g, path, url = tiny
    model = get_model("jax/opt-tiny", path)
    client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=120)
    for prompt in ["Hello world", "The quick brown fox"]:
        ids = g.encode(prompt)
        out = model.generate(input_ids=np.asarray([ids], np.int32), max_new_tokens=12, do_sample=False)
        new = np.asarray(getattr(out, "sequences", out))[0][len(ids):].tolist()
        if g.eos_token_id in new:  # the server stops at EOS; offline generate pads after it
            new = new[:new.index(g.eos_token_id)]
        r = client.completions.create(model="jax/opt-tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == g.decode(new)
        streamed = client.completions.create(model="jax/opt-tiny", prompt=prompt, max_tokens=12, temperature=0,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == g.decode(new)


async def _stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    text = ""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_64_concurrent_streaming_clients(tiny):
    g, _, url = tiny
    prompts = [f"Request number {i} says" for i in range(64)]
    lengths = [24 + i % 8 for i in range(64)]   # they leave at different steps; waiting ones take the slots
    offline = [c.text for [c] in g.complete_many(
        prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=100)) as c:
            before = (await c.get("/metrics")).text
            texts = await asyncio.gather(*(_stream_one(c, p, n) for p, n in zip(prompts, lengths)))
            return texts, before, (await c.get("/metrics")).text

    texts, before, after = asyncio.run(main())
    assert texts == offline
    steps = metric(after, "opt_serving_decode_steps_total") - metric(before, "opt_serving_decode_steps_total")
    advanced = (metric(after, "opt_serving_decode_step_requests_total")
                - metric(before, "opt_serving_decode_step_requests_total"))
    print(f"\ntiny model, 64 streaming clients: {steps:.0f} decode steps, "
          f"{advanced / steps:.1f} requests per step on average")
    assert advanced / steps > 1
    single = (metric(after, 'opt_serving_requests_per_decode_step_bucket{le="1.0"}')
              - metric(before, 'opt_serving_requests_per_decode_step_bucket{le="1.0"}'))
    assert single < steps  # the histogram agrees: some steps carried more than one request
    assert metric(after, "opt_serving_running_slots") == 0


def test_gptj_beam_search_over_http_equals_offline_generate(tiny):
    from opt_serving.model.wrapper import get_model
    g, path, url = tiny
    prompt = "The quick brown fox"
    ids = g.encode(prompt)
    out = get_model("jax/opt-tiny", path).generate(input_ids=np.asarray([ids], np.int32), num_beams=4,
                                                   max_new_tokens=10, do_sample=False)
    new = np.asarray(out)[0][len(ids):].tolist()
    if g.eos_token_id in new:
        new = new[:new.index(g.eos_token_id)]
    greedy = g.complete_many([prompt], SamplingParams(max_tokens=10, temperature=0))[0][0].text
    body = {"prompt": [prompt], "max_length": 10, "min_length": 0, "do_sample": False, "num_beams": 4}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json() == {"gen_text": [prompt + g.decode(new)]}
    print(f"\nbeam: {g.decode(new)!r}  greedy: {greedy!r}")


def test_vllm_extensions_change_the_tokens_as_vllm_documents(tiny):
    """top_k=1 leaves only the most likely token (sampling = greedy); repetition_penalty > 1 discourages every
    token already in the prompt or the output (a random model's loops stop); ignore_eos fixes the length."""
    g, _, url = tiny
    client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=120)
    ask = dict(model="jax/opt-tiny", prompt="Hello world", max_tokens=12)
    greedy = client.completions.create(**ask, temperature=0, extra_body={"ignore_eos": True})
    top1 = client.completions.create(**ask, temperature=1.0, seed=3, extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].text == greedy.choices[0].text
    # min_p = 1 keeps only tokens as likely as the likeliest: sampling becomes greedy too
    minp1 = client.completions.create(**ask, temperature=1.0, seed=3, extra_body={"min_p": 1.0, "ignore_eos": True})
    assert minp1.choices[0].text == greedy.choices[0].text
    assert greedy.usage.completion_tokens == 12 and greedy.choices[0].finish_reason == "length"
    penalised = client.completions.create(**ask, temperature=0, extra_body={"repetition_penalty": 1e4,
                                                                             "ignore_eos": True})
    [[plain]], [[offline]] = (g.complete_many(["Hello world"], SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=p)) for p in (1.0, 1e4))
    assert plain.text == greedy.choices[0].text and offline.text == penalised.choices[0].text
    prompt_ids, new = g.encode("Hello world"), offline.token_ids
    assert len(set(plain.token_ids)) < len(plain.token_ids)  # unpenalised, greedy repeats itself
    assert not set(new) & set(prompt_ids) and len(set(new)) == len(new)  # penalised: nothing seen is chosen again


def test_cached_prompt_tokens_in_usage_and_the_hit_rate_in_metrics(tiny):
    """Prompts that start as an earlier one did (the server's prefix cache is on by default): usage says how many
    prompt tokens were reused, in a JSON answer and in a stream's usage chunk, the text is what the model gives
    without the cache, and /metrics counts the hits and their rate."""
    g, path, url = tiny
    client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=120)
    head = "Prefix caching keeps the cache of a prompt's blocks for the prompts that begin the same way, so that"
    prompts = [head + tail for tail in (" one", " two, and then", " three")]
    ids = [g.encode(p) for p in prompts]
    assert 40 <= len(ids[0]) and max(map(len, ids)) <= 56, [len(i) for i in ids]  # not a joining prompt, fits 64
    shared = next(i for i, col in enumerate(zip(*ids)) if len(set(col)) > 1 or i + 1 == len(ids[0]))
    want = [0] + [min(shared, len(i) - 1) // 16 * 16 for i in ids[1:]]
    assert want[1] >= 32
    metrics = lambda: httpx.get(url + "/metrics", timeout=30).text  # noqa: E731
    before = metrics()
    ask = dict(model="jax/opt-tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r0, r1 = (client.completions.create(prompt=p, **ask) for p in prompts[:2])
    chunks = list(client.completions.create(prompt=prompts[2], stream=True, stream_options={"include_usage": True},
                                            **ask))
    usage = chunks[-1].usage
    got = [r0.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens_details.cached_tokens,
           usage.prompt_tokens_details.cached_tokens]
    assert got == want
    assert (usage.prompt_tokens, r1.usage.prompt_tokens) == (len(ids[2]), len(ids[1]))
    # a prompt computed after its cached prefix gets the model's own text: offline generate() has no prefix cache
    from opt_serving.model.wrapper import get_model
    model = get_model("jax/opt-tiny", path)
    for i, r in ((1, r1.choices[0].text), (2, "".join(c.choices[0].text for c in chunks if c.choices))):
        out = model.generate(input_ids=np.asarray([ids[i]], np.int32), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False)
        assert r == g.decode(np.asarray(getattr(out, "sequences", out))[0][len(ids[i]):].tolist())
    after = metrics()
    hits = metric(after, "opt_serving_prefix_cache_hits_total") - metric(before, "opt_serving_prefix_cache_hits_total")
    assert hits == sum(want)
    rate = metric(after, "opt_serving_prefix_cache_hit_rate")
    assert rate == pytest.approx(metric(after, "opt_serving_prefix_cache_hits_total")
                                 / metric(after, "opt_serving_prefix_cache_queries_total"))
    assert 0 < rate < 1


def test_speculative_decoding_served_gives_the_greedy_text_and_counts_its_drafts():
    """`--speculative-config`'s ngram and draft model through the HTTP routes: the `openai` client's greedy text,
    and its seeded sampled text, are plain decoding's (the server without it), with drafts checked in the steps
    and counted by /metrics. The embedded model drafting for itself has every greedy draft kept. (How many the random
    tiny model accepts from prompt lookup is its own affair: test_runner_ngram.py checks acceptance on a model
    built for it.)"""
    from opt_serving.model.embedded import ensure_embedded_model
    path = str(ensure_embedded_model())
    kw = dict(max_batch_size=4, max_seq_len=64, warmup=False)
    prompts = ["the the the the the", "Hello world, hello world, hello", "1 2 3 1 2 3 1 2"]
    texts, metrics = {}, {}
    configs = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 3},
               "draft": {"model": "opt-tiny", "num_speculative_tokens": 3}}
    for name, spec in configs.items():
        g = load_generator("jax/opt-tiny", path, speculative=spec, **kw)
        if spec is not None:
            g.engine.model.spec.adaptive = False  # (the tiny model's steps cost the host's time: drafts ride anyway)
        try:
            with serve_in_thread(create_app(g)) as url:
                client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=120)
                texts[name] = [client.completions.create(
                    model="jax/opt-tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text for p in prompts]
                metrics[name, "greedy"] = httpx.get(url + "/metrics", timeout=30).text
                texts[name] += [client.completions.create(
                    model="jax/opt-tiny", prompt=p, max_tokens=24, temperature=0.7, top_p=0.9, seed=11 + i
                ).choices[0].text for i, p in enumerate(prompts)]
                metrics[name] = httpx.get(url + "/metrics", timeout=30).text
        finally:
            g.close()
    assert texts["ngram"] == texts["draft"] == texts["plain"]
    assert texts["plain"][3:] != texts["plain"][:3]  # (the sampled text is not greedy's)
    for name in ("ngram", "draft"):
        text = metrics[name]
        drafts, drafted = (metric(text, f"opt_serving_spec_decode_num_{k}_total") for k in ("drafts", "draft_tokens"))
        accepted = metric(text, "opt_serving_spec_decode_num_accepted_tokens_total")
        assert 0 < drafts <= drafted and accepted <= drafted
        assert metric(text, "opt_serving_spec_decode_mean_acceptance_length") == pytest.approx(1 + accepted / drafts)
    # the draft model's drafts are the model's own greedy tokens: greedy rows keep them all (sampled rows keep each
    # with the probability the model gives it)
    greedy = metrics["draft", "greedy"]
    drafted, accepted = (metric(greedy, f"opt_serving_spec_decode_num_{k}_total")
                         for k in ("draft_tokens", "accepted_tokens"))
    assert accepted == drafted > 0

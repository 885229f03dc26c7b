"""`/v1/chat/completions` through the official `openai` client (service/routes_chat.py, text/chat.py).

The fake engine behind the byte tokenizer (engine/fake.py: greedy continues with the next byte) and the shipped
example template (deploy/opt-chat-template.jinja): the messages [user "a"] render to "</s>User: a\\nAssistant:",
19 tokens, after whose ":" greedy decoding writes ";<=>?@A...". The real engine (random weights of OPT's
vocabulary behind the real tokenizer, conftest's opt_vocab_server) shows that structured output and greedy text
are the completion path's own.
"""
import json
import math
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from opt_serving.service.app import create_app  # noqa: E402
from opt_serving.service.testserver import serve_in_thread  # noqa: E402
from opt_serving.text.chat import load_chat_template  # noqa: E402
from opt_serving.text.fake import fake_generator  # noqa: E402

TEMPLATE = load_chat_template(str(Path(__file__).resolve().parents[1] / "deploy" / "opt-chat-template.jinja"))
USER_A = [{"role": "user", "content": "a"}]
LN2 = math.log(2)


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat():
    """(client of a server with the template, client of one without) over one fake generator."""
    g = fake_generator(num_slots=4, max_seq_len=64, max_queue=32)
    with serve_in_thread(create_app(g, chat_template=TEMPLATE)) as url, \
            serve_in_thread(create_app(g)) as bare:
        yield _client(url), _client(bare)
    g.close()


def test_a_chat_completion_renders_the_template_and_answers_in_the_chat_shape(chat):
    client, _ = chat
    r = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "opt-fake"
    [choice] = r.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", ";<=>?", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (19, 5, 24)
    # OpenAI's older max_tokens means the same; neither: what the 64-token context leaves after the prompt
    assert client.chat.completions.create(model="opt-fake", messages=USER_A, max_tokens=5,
                                          temperature=0).choices[0].message.content == ";<=>?"
    unbounded = client.chat.completions.create(model="opt-fake", messages=USER_A, temperature=0)
    assert unbounded.usage.completion_tokens == 45
    assert [m.id for m in client.models.list()] == ["opt-fake"]  # /v1/models as before


def test_streaming_sends_the_role_then_deltas_then_usage(chat):
    client, _ = chat
    chunks = list(client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=5,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content, first.finish_reason) == ("assistant", "", None)
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == ";<=>?"
    assert [c.choices[0].finish_reason for c in body].count("length") == 1 and body[-1].choices[0].finish_reason
    assert all(c.usage is None for c in body)
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (19, 5)


def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(chat):
    client, _ = chat
    chunks = list(client.chat.completions.create(
        model="opt-fake", messages=USER_A, max_completion_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chunks] == [0, 1, 2, 3, 4, 4]  # role, four tokens, the total
    assert all(c.usage.prompt_tokens == 19 and c.usage.total_tokens == 19 + c.usage.completion_tokens for c in chunks)
    plain = list(client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=4,
                                                stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)  # (with include_usage only, as vLLM)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.chat.completions.create(model="opt-fake", messages=USER_A, stream_options={"include_usage": True})


def test_n_seed_stop_temperature_and_logprobs_in_the_chat_shape(chat):
    client, _ = chat
    r = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=3, n=2, seed=7,
                                       temperature=1.0, top_p=1.0)
    # the fake sampler: the k-th token is last + 1 + (seed + k) % 3; choice 0 keeps the seed (";" is 58 + 4 + 1)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content == "<?@"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 19  # the prompt counted once
    stopped = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=9,
                                             temperature=0, stop=["="]).choices[0]
    assert (stopped.message.content, stopped.finish_reason) == (";<", "stop")
    lp = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=2, temperature=0,
                                        logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [t.token for t in lp] == [";", "<"] and lp[0].bytes == [59]
    assert lp[1].logprob == pytest.approx(-LN2) and [t.token for t in lp[1].top_logprobs] == ["<", "="]
    assert lp[1].top_logprobs[1].logprob == pytest.approx(-2 * LN2)
    none = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=2, logprobs=True)
    assert none.choices[0].logprobs.content[0].top_logprobs == []  # logprobs alone: the chosen tokens'


def test_a_model_without_a_template_is_a_400_naming_the_flag(chat):
    _, bare = chat
    with pytest.raises(openai.BadRequestError, match="--chat-template") as e:
        bare.chat.completions.create(model="opt-fake", messages=USER_A)
    assert e.value.status_code == 400 and e.value.body["code"] == "no_chat_template"
    with pytest.raises(openai.BadRequestError, match="--chat-template"):  # streaming: refused before the 200
        bare.chat.completions.create(model="opt-fake", messages=USER_A, stream=True)


@pytest.mark.parametrize("extra, message", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "knows the roles system, user and assistant, not tool"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts"),
    ({"messages": []}, "messages"),
    ({"chat_template": "{{ messages }}"}, "cannot bring its own template"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "parses no tool calls"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"continue_final_message": True}, "cannot both be true"),
    ({"chat_template_kwargs": {"tokenize": True}}, "tokenize cannot be set there"),
    ({"echo": True}, "echo is not supported"),
    ({"max_completion_tokens": 60}, "maximum context length is 64"),
])
def test_bad_chat_requests_are_400s_naming_the_problem(chat, extra, message):
    client, _ = chat
    openai_fields = {"messages", "tools", "tool_choice", "top_logprobs", "max_completion_tokens"}
    body = {"messages": USER_A, **{k: v for k, v in extra.items() if k in openai_fields}}
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="opt-fake", **body,
                                       extra_body={k: v for k, v in extra.items() if k not in openai_fields})


def test_text_parts_system_and_assistant_turns_and_continue_final_message(chat):
    client, _ = chat
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "x"}]},
                {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]
    r = client.chat.completions.create(model="opt-fake", messages=messages, max_completion_tokens=1,
                                       extra_body={"return_token_ids": True})
    # "</s>S\n\nUser: x\nAssistant: y</s>\nUser: z\nAssistant:" rendered without another BOS (vLLM's default)
    assert r.usage.prompt_tokens == 1 + len("S\n\nUser: x\nAssistant: y") + 1 + len("\nUser: z\nAssistant:")
    assert r.model_extra["prompt_token_ids"][:2] == [2, ord("S") + 4]
    cont = client.chat.completions.create(
        model="opt-fake", messages=USER_A + [{"role": "assistant", "content": "b"}], max_completion_tokens=2,
        temperature=0, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert cont.choices[0].message.content == "cd"  # the assistant's "b" continued, not a new turn


def test_return_token_ids_in_a_chat_answer_and_stream(chat):
    client, _ = chat
    r = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=3, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [63, 64, 65]  # ";<=" (byte + 4)
    prompt_ids = r.prompt_token_ids
    assert len(prompt_ids) == 19 and prompt_ids[0] == 2
    stream = list(client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=3,
                                                 temperature=0, stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in stream[1:])  # the first chunk only, as vLLM
    assert [t for c in stream for t in (c.choices[0].model_extra.get("token_ids") or [])] == [63, 64, 65]
    plain = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=3)
    assert "prompt_token_ids" not in plain.model_dump() and "token_ids" not in plain.choices[0].model_dump()


def test_prompt_logprobs_come_once_for_the_prompt(chat):
    client, _ = chat
    r = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=1,
                                       extra_body={"prompt_logprobs": 1})
    scores = r.model_extra["prompt_logprobs"]
    assert len(scores) == 19 and scores[0] is None  # vLLM's: top-level in a chat answer, the first token unscored
    assert scores[1][str(ord("U") + 4)]["logprob"] < 0  # "</s>" then "U" of "User: a"
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs are not available when stream is true"):
        client.chat.completions.create(model="opt-fake", messages=USER_A, stream=True,
                                       extra_body={"prompt_logprobs": 1})


def test_beam_search_returns_the_n_best_beams(chat):
    client, _ = chat
    r = client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=3, n=2,
                                       extra_body={"use_beam_search": True})
    # the fake's beams: the greedy one, then the one whose last token is the second likeliest
    assert [c.message.content for c in r.choices] == [";<=", ";<>"]
    streamed = list(client.chat.completions.create(model="opt-fake", messages=USER_A, max_completion_tokens=3,
                                                   n=2, stream=True, extra_body={"use_beam_search": True}))
    texts = ["", ""]
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == [";<=", ";<>"]
    with pytest.raises(openai.BadRequestError, match="logprobs is not available with beam search"):
        client.chat.completions.create(model="opt-fake", messages=USER_A, logprobs=True,
                                       extra_body={"use_beam_search": True})


# ---- the real engine: chat is the completion path's own (structured output, greedy text)
@pytest.fixture(scope="module")
def real_chat(opt_vocab_server):
    g = opt_vocab_server[0]
    with serve_in_thread(create_app(g, model_name="opt-small", chat_template=TEMPLATE)) as url:
        yield g, _client(url)


def test_greedy_chat_is_the_completion_of_the_rendered_prompt(real_chat):
    g, client = real_chat
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    r = client.chat.completions.create(model="opt-small", messages=messages, max_completion_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    ids = r.prompt_token_ids
    assert g.detokenize(ids) == "</s>User: Hello, how are you?\nAssistant:"
    plain = client.completions.create(model="opt-small", prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text


def test_structured_output_in_a_chat(real_chat):
    jsonschema = pytest.importorskip("jsonschema")
    _, client = real_chat
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="opt-small", messages=[{"role": "user", "content": "Your age?"}], max_completion_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    choice = client.chat.completions.create(
        model="opt-small", messages=[{"role": "user", "content": "Yes or no?"}], max_completion_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")

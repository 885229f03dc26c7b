"""text/chat.py: where a chat template comes from (--chat-template's file or text, else the tokenizer folder's own:
tokenizer_config.json's chat_template or chat_template.jinja, in every folder form load_tokenizer reads) and how
it renders; and the text level's truncate_prompt_tokens (text/request.py)."""
import json
import shutil
from pathlib import Path

import pytest

from opt_serving.errors import InvalidRequest
from opt_serving.text.chat import ChatTemplate, load_chat_template
from opt_serving.text.fake import byte_tokenizer
from opt_serving.text.request import SamplingParams, truncate_prompt
from opt_serving.text.tokenizer import OPT_TOKENIZER_CONFIG, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / ".." / "shared" / "opt-assets"
PLAIN = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_the_flag_takes_a_file_or_the_template_itself(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(PLAIN)
    assert load_chat_template(str(f)) == PLAIN == load_chat_template(PLAIN)
    with pytest.raises(ValueError, match="no-such.jinja: no such file"):
        load_chat_template(str(tmp_path / "no-such.jinja"))
    f.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not parse.*line 1"):
        load_chat_template(str(f))


def test_rendering_writes_the_templates_bos_once_and_tokenises_without_another():
    tok = byte_tokenizer()
    chat = ChatTemplate(tok, PLAIN)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert chat.render(messages) == "</s>[system] s\n[user] hi\n"
    assert chat.prompt_ids(messages) == tok("[system] s\n[user] hi\n")["input_ids"]  # one </s>, the template's
    assert chat.prompt_ids(messages, add_special_tokens=True)[:2] == [2, 2]  # vLLM's add_special_tokens: one more
    with pytest.raises(InvalidRequest, match="--chat-template"):
        ChatTemplate(tok).render(messages)


@pytest.fixture
def opt_folder(tmp_path):
    if not ASSETS.is_dir():
        pytest.skip(f"OPT tokenizer files not found at {ASSETS} (../shared/opt-assets is absent)")
    return tmp_path


@pytest.mark.parametrize("form", ["tokenizer_config.json", "chat_template.jinja", "vocab.json only",
                                  "metaseq names"])
def test_the_tokenizer_folders_own_template_is_used(opt_folder, form):
    d = opt_folder
    names = ("gpt2-vocab.json", "gpt2-merges.txt") if form == "metaseq names" else ("vocab.json", "merges.txt")
    for src, dst in zip(("gpt2-vocab.json", "gpt2-merges.txt"), names):
        shutil.copy(ASSETS / src, d / dst)
    if form == "tokenizer_config.json":
        (d / "tokenizer_config.json").write_text(json.dumps({**OPT_TOKENIZER_CONFIG, "chat_template": PLAIN}))
    else:
        if form == "chat_template.jinja":
            (d / "tokenizer_config.json").write_text(json.dumps(OPT_TOKENIZER_CONFIG))
        (d / "chat_template.jinja").write_text(PLAIN)
    chat = ChatTemplate(load_tokenizer(d))
    assert chat.available and chat.prompt_ids([{"role": "user", "content": "Hello"}])[:1] == [2]
    assert chat.render([{"role": "user", "content": "Hello"}]) == "</s>[user] Hello\n"
    # --chat-template wins over the folder's own
    assert ChatTemplate(load_tokenizer(d), "{{ messages[0]['content'] }}").render(
        [{"role": "user", "content": "Hello"}]) == "Hello"


@pytest.mark.parametrize("keep, side, expected", [
    (None, "left", [1, 2, 3, 4, 5]), (3, "left", [3, 4, 5]), (3, "right", [1, 2, 3]), (4, "right", [1, 2, 3, 4]),
    (-1, "left", [2, 3, 4, 5]), (0, "left", []),
])
def test_truncate_prompt_keeps_the_side_asked(keep, side, expected):
    params = SamplingParams(max_tokens=4, truncate_prompt_tokens=keep, truncation_side=side)
    params.validate()
    assert truncate_prompt([1, 2, 3, 4, 5], params, max_seq_len=8) == expected  # -1: the 4 that fit beside 4


def test_truncate_prompt_refuses_more_than_fits():
    params = SamplingParams(max_tokens=4, truncate_prompt_tokens=5)
    with pytest.raises(InvalidRequest, match=r"truncate_prompt_tokens \(5\) must be at most") as e:
        truncate_prompt([1, 2, 3], params, max_seq_len=8)
    assert e.value.param == "truncate_prompt_tokens"
    for bad in (dict(truncate_prompt_tokens=-2), dict(truncation_side="up"), dict(tokens_as_ids=1)):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad).validate()

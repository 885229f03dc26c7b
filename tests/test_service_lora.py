"""LoRA adapters through the HTTP service, with the `openai` client as vLLM's users call it: the `serve` flags
(--lora-modules, --max-loras, --max-lora-rank, --enable-lora-runtime-updates) build the generator, /v1/models
lists each adapter with its parent, a request's `model` picks its adapter (PEFT's tokens, requests of several
adapters at once), an unknown one is a 404 in OpenAI's shape, and /v1/load_lora_adapter and
/v1/unload_lora_adapter work as vLLM's do (and answer 404 where runtime updates are off)."""
import concurrent.futures
import os

import pytest
import requests
import torch

from opt_serving.cli import build_parser
from opt_serving.config import config_for
from opt_serving.model.embedded import ensure_embedded_model
from opt_serving.models import get_model
from opt_serving.service.app import create_app
from opt_serving.service.cli_args import check_args, serve_args_from
from opt_serving.service.deployment import build_generator
from opt_serving.service.testserver import serve_in_thread
from opt_serving.testing.lora import write_adapter

from conftest import ALL_TARGETS

openai = pytest.importorskip("openai")
NEW = 8


def parse(*argv):
    parser, _ = build_parser("serve")
    return parser.parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def embedded():
    folder = ensure_embedded_model()
    return folder, config_for("jax/opt-tiny", folder)


@pytest.fixture(scope="module")
def folders(embedded, tmp_path_factory):
    _, cfg = embedded
    d = tmp_path_factory.mktemp("adapters")
    return {"sql": write_adapter(d / "sql", cfg, ALL_TARGETS, rank=8, seed=0, std=0.05),
            "chat": write_adapter(d / "chat", cfg, ("q_proj", "v_proj"), rank=4, seed=1, std=0.2),
            "late": write_adapter(d / "late", cfg, ("v_proj",), rank=8, seed=2, std=0.2)}


@pytest.fixture(scope="module")
def server(folders):
    """The embedded model served with two adapters from the start (two slots), runtime updates on, built from the
    command line as `serve` builds a replica's generator -> (generator, base URL, openai client)."""
    args = serve_args_from(parse("--lora-modules", f"sql={folders['sql']}", f"chat={folders['chat']}",
                                 "--max-loras", "2", "--max-lora-rank", "8", "--enable-lora-runtime-updates",
                                 "--max-batch-size", "4", "--max-seq-len", "64", "--no-prefix-caching",
                                 "--no-warmup"))  # (LoRA's warm-up: test_runner_lora.py)
    assert check_args(args) is None
    g = build_generator(args)
    app = create_app(g, model_name=args.model_names(), lora_runtime_updates=args.enable_lora_runtime_updates)
    with serve_in_thread(app) as url:
        yield g, url, openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    g.close()


def reference_text(g, embedded, lora, prompt):
    """PEFT's greedy completion of token ids `prompt` (lora None: Hugging Face's model alone), as text."""
    folder, _ = embedded
    model = get_model("facebook/opt-tiny", folder, lora=lora)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=1, eos_token_id=None)
    return g.decode(out[0, len(prompt):].tolist())


def complete(client, model, prompt, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_the_models_list_each_adapter_with_its_parent(server, folders):
    g, _, client = server
    cards = {m.id: m for m in client.models.list().data}
    base = g.model_name
    assert set(cards) == {base, "sql", "chat"}
    assert cards["sql"].parent == base and cards["sql"].root == str(folders["sql"])
    assert getattr(cards[base], "parent", None) is None


def test_a_requests_model_picks_its_adapter(server, embedded, folders):
    """Three requests at once, of two adapters and the base model: each gets PEFT's text for its own."""
    g, _, client = server
    prompt = [2, 100, 200, 300, 400, 17]
    names = ["sql", "chat", g.model_name]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda m: complete(client, m, prompt), names))
    texts = [a.choices[0].text for a in answers]
    for name, a, text in zip(names, answers, texts):
        assert a.model == name
        lora = folders.get(name)
        assert text == reference_text(g, embedded, None if lora is None else str(lora), prompt), name
    assert len(set(texts)) == 3  # the adapters change the answer
    streamed = "".join(c.choices[0].text for c in complete(client, "chat", prompt, stream=True) if c.choices)
    assert streamed == texts[1]


def test_an_unknown_adapter_is_a_404_in_openais_shape(server):
    _, url, client = server
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "no-such-adapter", [2, 5, 6])
    assert e.value.body["code"] == "model_not_found" and "no-such-adapter" in e.value.body["message"]


def test_adapters_load_and_unload_at_run_time(server, embedded, folders, tmp_path):
    g, url, client = server
    load = lambda name, path: requests.post(url + "/v1/load_lora_adapter",  # noqa: E731
                                            json={"lora_name": name, "lora_path": str(path)})
    unload = lambda name: requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": name})  # noqa: E731
    r = load("late", folders["late"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in {m.id for m in client.models.list().data}
    prompt = [2, 31, 41, 59, 26]
    assert complete(client, "late", prompt).choices[0].text == reference_text(g, embedded, str(folders["late"]), prompt)
    again = load("late", folders["late"])
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    missing = load("other", tmp_path / "nowhere")
    assert missing.status_code == 400 and "no such folder" in missing.json()["error"]["message"]
    assert load(g.model_name, folders["late"]).status_code == 400  # the base model's name
    r = unload("late")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(client, "late", prompt)
    assert unload("late").status_code == 404


def test_runtime_updates_are_off_unless_asked(server, folders):
    g, _, _ = server
    with serve_in_thread(create_app(g)) as url:
        r = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folders["late"])})
        assert r.status_code == 404 and "--enable-lora-runtime-updates" in r.json()["error"]["message"]
        assert {m["id"] for m in requests.get(url + "/v1/models").json()["data"]} >= {"sql", "chat"}


def test_the_lora_flags_are_checked_before_anything_starts(folders, tmp_path, monkeypatch):
    monkeypatch.chdir(folders["sql"].parent)
    args = serve_args_from(parse("--lora-modules", "sql=sql", '{"name": "c", "path": "chat"}', "--max-loras", "3"))
    assert args.lora_modules == [f"sql={folders['sql']}", f"c={folders['chat']}"] and args.max_loras == 3
    options = args.lora_options()
    assert options.modules == (("sql", str(folders["sql"])), ("c", str(folders["chat"])))
    assert "no such folder" in check_args(serve_args_from(parse("--lora-modules", f"x={tmp_path}/none")))
    assert "name given twice" in check_args(serve_args_from(parse("--lora-modules", "a=sql", "a=chat")))
    assert "serves no LoRA adapters" in check_args(serve_args_from(parse("--engine", "fake", "--enable-lora")))
    assert serve_args_from(parse()).lora_options() is None
    assert os.path.isabs(serve_args_from(parse("--lora-modules", "x=sql")).lora_modules[0].split("=", 1)[1])

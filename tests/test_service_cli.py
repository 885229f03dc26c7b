"""`opt-serving serve`'s model arguments (opt_serving/service/cli.py, cli_args.py): --dummy, --seed, --tokenizer
and --speculative-config reach the generator a replica builds, and bad combinations exit 2 before Ray starts. No Ray
here: the Ray round trip is tests/test_service_signals.py."""
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from opt_serving.cli import build_parser, main
from opt_serving.config import SpeculativeConfig, get_config
from opt_serving.model.embedded import ensure_embedded_model
from opt_serving.service import cli as serve_cli
from opt_serving.service.deployment import ServeArgs, build_generator
from opt_serving.service.cli_args import check_args, serve_args_from
from opt_serving.text import loading
from opt_serving.text.tokenizer import load_tokenizer

from conftest import BAD_SPECULATIVE_CONFIGS, NGRAM

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / ".." / "shared" / "opt-assets"


def parse(*argv):
    parser, _ = build_parser("serve")
    return parser.parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def metaseq_dir(tmp_path_factory) -> Path:
    """The embedded tokenizer under metaseq's file names (as ../shared/opt-assets spells them), with the ids
    of "Hello"'s first token and token 1000 swapped, so ids show which tokenizer encoded a text."""
    tiny = ensure_embedded_model()
    d = tmp_path_factory.mktemp("tok")
    vocab = json.loads((tiny / "vocab.json").read_text())
    first = load_tokenizer(tiny)("Hello")["input_ids"][1]  # [</s>, ...]
    assert first != 1000
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (first, 1000))
    vocab[a], vocab[b] = 1000, first
    (d / "gpt2-vocab.json").write_text(json.dumps(vocab))
    shutil.copyfile(tiny / "merges.txt", d / "gpt2-merges.txt")
    return d


def test_dummy_large_vocab_without_tokenizer_exits_2_naming_the_flag():
    # as a user runs it: the real command line, in a subprocess
    res = subprocess.run([sys.executable, "-m", "opt_serving", "serve", "--model", "jax/opt-125m", "--dummy"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert "--tokenizer" in res.stderr and "50272" in res.stderr
    assert "opt-serving: serving" not in res.stdout  # it never got as far as serving


@pytest.mark.parametrize("argv, message", [
    (["--dummy"], "--model"),
    (["--model", "jax/opt-tiny", "--dummy", "--path", "weights"], "not both"),
    (["--model", "jax/opt-125m"], "--path"),
    (["--model", "jax/opt-3q", "--dummy"], "unknown OPT model"),
    (["--tokenizer", "."], "--tokenizer"),
    (["--model", "jax/opt-tiny", "--dummy", "--tokenizer", "no/such/folder"], "no such folder"),
    (["--ray-nice", "20"], "--ray-nice"),
    (["--engine", "fake", "--dummy"], "--engine fake"),
    (["--engine", "fake", "--chat-template", "no/such.jinja"], "--chat-template no/such.jinja: no such file"),
    (["--engine", "fake", "--chat-template", "{% if %}"], "the chat template does not parse"),
    (["--engine", "fake", "--speculative-config", json.dumps(NGRAM)], "does not speculate"),
], ids=["dummy-without-model", "dummy-and-path", "model-without-weights", "unknown-size",
        "tokenizer-for-embedded", "missing-tokenizer-folder", "niceness-out-of-range", "fake-with-weights",
        "missing-chat-template", "chat-template-syntax", "fake-speculating"])
def test_bad_model_arguments_exit_2(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opt-serving serve: ") and message in err, err


def test_tokenizer_folder_without_tokenizer_files_exits_2(tmp_path, capsys):
    assert main(["serve", "--model", "jax/opt-tiny", "--dummy", "--tokenizer", str(tmp_path)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


@pytest.mark.skipif(not (ASSETS / "gpt2-vocab.json").is_file(),
                    reason="../shared/opt-assets (the real OPT tokenizer) is not on this machine")
def test_tokenizer_larger_than_the_dummy_vocabulary_exits_2(capsys):
    assert main(["serve", "--model", "jax/opt-tiny", "--dummy", "--tokenizer", str(ASSETS)]) == 2
    err = capsys.readouterr().err
    assert "50265 tokens" in err and "1024" in err
    fits = serve_args_from(parse("--model", "jax/opt-125m", "--dummy", "--tokenizer", str(ASSETS)))
    assert check_args(fits) is None


def test_engine_fake_builds_the_fake_engine():
    args = serve_args_from(parse("--engine", "fake", "--max-batch-size", "2"))
    assert (args.engine, check_args(args)) == ("fake", None)
    gen = build_generator(args)
    try:
        assert (gen.model_name, gen.engine.num_slots) == ("opt-fake", 2)
    finally:
        gen.close()


def test_a_chat_template_file_reaches_the_replica_as_an_absolute_path(monkeypatch):
    monkeypatch.chdir(REPO)
    args = serve_args_from(parse("--engine", "fake", "--chat-template", "deploy/opt-chat-template.jinja"))
    assert args.chat_template == str(REPO / "deploy" / "opt-chat-template.jinja") and check_args(args) is None
    inline = "{{ bos_token }}{{ messages[0]['content'] }}"  # (the template itself, as vLLM's flag takes it)
    assert serve_args_from(parse("--engine", "fake", "--chat-template", inline)).chat_template == inline


class _Loaded(Exception):
    """What the stand-in load_engine raises once it has seen its arguments (nothing is loaded)."""


def test_the_speculative_config_flag_reaches_load_engine(monkeypatch):
    """--speculative-config (vLLM's flag and JSON) is parsed with the command line, travels to the replica as
    ServeArgs' dict (every key spelt out, the model_dump() the replica is given) and reaches load_engine as the
    parsed config; left out, or empty, load_engine gets None (no speculation)."""
    seen = []

    def load_engine(*args, **kwargs):
        seen.append(kwargs)
        raise _Loaded
    monkeypatch.setattr(loading, "load_engine", load_engine)
    args = serve_args_from(parse("--speculative-config", json.dumps(NGRAM), "--max-batch-size", "2"))
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                       "prompt_lookup_min": 1}
    assert check_args(args) is None
    for serve_args in (args, ServeArgs(**args.model_dump())):  # this process's, the replica's
        with pytest.raises(_Loaded):
            build_generator(serve_args)
        assert seen.pop()["speculative"] == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
    for argv in ([], ["--speculative-config", "{}"], ["--speculative-config", ""]):
        args = serve_args_from(parse(*argv))
        assert args.speculative_config is None
        with pytest.raises(_Loaded):
            build_generator(args)
        assert seen.pop()["speculative"] is None


def test_the_warmup_flags_reach_load_engine(monkeypatch):
    """Warm-up by default (what generation runs), --warmup-all every shape, --no-warmup none: each reaches
    load_engine through ServeArgs as the replica gets it; load_engine refuses another value before any weight."""
    seen = []

    def load_engine(*args, **kwargs):
        seen.append(kwargs["warmup"])
        raise _Loaded
    with monkeypatch.context() as m:
        m.setattr(loading, "load_engine", load_engine)
        for argv, want in (([], True), (["--warmup-all"], "all"), (["--no-warmup"], False)):
            args = ServeArgs(**serve_args_from(parse("--model", "jax/opt-tiny", "--dummy", *argv)).model_dump())
            with pytest.raises(_Loaded):
                build_generator(args)
            assert args.warmup == want and seen.pop() == want
    with pytest.raises(ValueError, match="warmup is True, False or 'all', not 'some'"):
        loading.load_engine("jax/opt-tiny", dummy=True, warmup="some")
    with pytest.raises(ValueError):
        ServeArgs(warmup="some")


@pytest.mark.parametrize("value, message", BAD_SPECULATIVE_CONFIGS.values(), ids=BAD_SPECULATIVE_CONFIGS.keys())
def test_a_bad_speculative_config_exits_2_naming_the_flag(value, message, capsys, monkeypatch):
    """A bad --speculative-config is refused when the command line is parsed (argparse's exit 2, the flag and the
    problem named): the command never runs, so nothing loads and Ray does not start."""
    monkeypatch.setattr(serve_cli, "run", lambda args: pytest.fail("the command ran"))
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--speculative-config", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config: " in err and message in err, err


def test_dummy_tiny_needs_no_tokenizer():
    assert check_args(serve_args_from(parse("--model", "jax/opt-tiny", "--dummy"))) is None


def test_dummy_serve_arguments_build_a_working_generator(metaseq_dir, monkeypatch):
    monkeypatch.chdir(metaseq_dir.parent)  # a relative --tokenizer reaches the replica as an absolute path
    args = serve_args_from(parse("--model", "jax/opt-tiny", "--dummy", "--seed", "3", "--tokenizer",
                                 metaseq_dir.name, "--max-batch-size", "2", "--max-seq-len", "32"))
    assert (args.dummy, args.seed, args.tokenizer, args.path) == (True, 3, str(metaseq_dir), None)
    assert check_args(args) is None
    gen = build_generator(args)
    try:
        # the seeded random weights param_tree.init_params draws (seed 3, not 0), not the embedded model's; compared
        # on the embeddings, which the engine keeps as drawn (it may regroup the layers' projections)
        from opt_serving.model import param_tree
        cfg = get_config("jax/opt-tiny")
        got = gen.engine.model.params
        for seed, same in ((3, True), (0, False)):
            want = param_tree.init_params(cfg, seed, jnp.float32)
            for name in ("embed_tokens", "embed_positions"):
                assert np.array_equal(got[name]["embedding"], want[name]["embedding"]) is same, (seed, name)
        # the tokenizer read from the metaseq-named folder, not the embedded one
        embedded = load_tokenizer()("Hello world")["input_ids"]
        assert gen.encode("Hello world") == [embedded[0], 1000, *embedded[2:]]
        from opt_serving.text.generator import SamplingParams
        c = asyncio.run(gen.complete("Hello world", SamplingParams(temperature=0.0, max_tokens=4)))
        assert c.completion_tokens == 4 and all(0 <= t < 1024 for t in c.token_ids)
        assert (gen.engine.num_slots, gen.max_seq_len) == (2, 32)
    finally:
        gen.close()


def _titled_child(title: str) -> subprocess.Popen:
    """A child process whose command line reads `title` (as Ray's workers rename themselves)."""
    return subprocess.Popen(["bash", "-c", f"exec -a '{title}' sleep 300"])


def test_lower_ray_priority_spares_replicas_idle_workers_and_a_busy_proxy():
    import psutil

    from opt_serving.service.ray_session import lower_ray_priority, replica_priority_env
    assert replica_priority_env(19) == {"RAY_worker_niceness": "0"} and replica_priority_env(-1) == {}
    titles = ["ray::ServeReplica:opt:OPTServer", "ray::IDLE", "ray::ProxyActor", "ray::ServeController", "raylet"]
    procs = [_titled_child(t) for t in titles]
    try:
        for p, title in zip(procs, titles):  # until each has become its title (exec done)
            deadline = time.monotonic() + 30
            while not " ".join(psutil.Process(p.pid).cmdline()).startswith(title):
                assert time.monotonic() < deadline, "child did not exec"
        base = os.nice(0)
        ours = [psutil.Process(p.pid) for p in procs]  # not other tests' children
        assert lower_ray_priority(-1, include_proxy=True, procs=ours) == 0
        assert [p.nice() for p in ours] == [base] * 5
        assert lower_ray_priority(19, include_proxy=False, procs=ours) == 2
        assert [p.nice() for p in ours] == [base, base, base, 19, 19]
        assert lower_ray_priority(19, include_proxy=True, procs=ours) == 1  # the proxy now; the others already are
        assert [p.nice() for p in ours] == [base, base, 19, 19, 19]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_refused_application_is_printed_with_what_serve_says_of_its_failed_deployments(monkeypatch):
    from ray import serve
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger
    from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    from opt_serving.service import serve_deploy

    def deployment(status, message):
        return DeploymentStatusOverview(status=status, status_trigger=DeploymentStatusTrigger.REPLICA_STARTUP_FAILED,
                                        replica_states={}, message=message)
    app = ApplicationStatusOverview(status=ApplicationStatus.DEPLOY_FAILED, message="", last_deployed_time_s=0.0,
                                    deployments={"OPTServer": deployment(DeploymentStatus.DEPLOY_FAILED,
                                                                         "ValueError: the shard is missing"),
                                                 "Router": deployment(DeploymentStatus.HEALTHY, "all well")})
    monkeypatch.setattr(serve, "status", lambda: ServeStatus(applications={"opt": app}))
    assert serve_deploy.deployment_messages("opt") == "\n  OPTServer: ValueError: the shard is missing"
    assert serve_deploy.deployment_messages("someone-else") == ""

    def gone():
        raise ConnectionError("the controller died")
    monkeypatch.setattr(serve, "status", gone)
    assert serve_deploy.deployment_messages("opt") == ""


def test_a_draft_model_is_found_or_refused_before_anything_loads(tmp_path):
    """speculative_config's draft model: the embedded one by name alone; another needs its folder, which must
    exist; a parallel plan's name is refused (the draft runs on one device); each error names the draft model."""
    def spec(**kw):
        return loading.draft_spec(SpeculativeConfig.parse({"num_speculative_tokens": 2, **kw}))
    assert spec() is None
    tiny = spec(model="opt-tiny")
    assert tiny.name == "jax/opt-tiny" and (tiny.weights.folder / "config.json").is_file()
    for kw, error, message in (
            (dict(model="jax/opt-125m"), ValueError, "give 'path', jax/opt-125m's numpy weights folder"),
            (dict(model="jax/opt-125m", path=str(tmp_path / "nowhere")), FileNotFoundError, "nowhere"),
            (dict(model="alpa/opt-125m", path=str(tmp_path)), ValueError, "alpa/opt-125m names a parallel plan"),
            (dict(model="opt-125m"), ValueError, "unknown model 'opt-125m'")):
        with pytest.raises(error, match=message) as refused:
            spec(**kw)
        assert str(refused.value).startswith("speculative_config's draft model: ")

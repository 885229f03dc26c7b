"""Smoke runs of the two benchmark scripts on tiny models: the JSON they write and the sums behind it."""
from __future__ import annotations

import csv
import importlib
import json
import os
import sys

import pytest

def load(name: str):
    """A script or helper of benchmark/ as the scripts import one another: `benchmark.FOLDER.NAME` (the checkout's
    root is on sys.path: pyproject.toml's pythonpath)."""
    return importlib.import_module(f"benchmark.{name}")


common = load("common")


def test_tflops_is_alpas_formula():
    # B=2 rows, T=3 tokens, S=12, h=1, L=1, V=5:
    # 24*2*3*1*1*(1 + 12/6) + 2*2*3*1*5 = 432 + 60 = 492 FLOPs in 1 us on 2 devices
    assert common.gpt_inference_tflops(2, 3, 12, 1, 1, 5, 1e-6, num_devices=2) == pytest.approx(492 / 1e-6 / 2 / 1e12)


def test_summarize_and_tsv_header(tmp_path):
    s = common.summarize([1.0, 2.0, 3.0, 10.0])
    assert (s["mean"], s["median"], s["min"], s["max"]) == (4.0, 2.5, 1.0, 10.0)
    assert 3.0 < s["p99"] <= 10.0
    tsv = tmp_path / "r.tsv"
    common.append_tsv(tsv, {"time": "t1", "a": 1})
    common.append_tsv(tsv, {"time": "t2", "a": 2})
    common.append_tsv(tsv, {"time": "t3", "a": 3, "b": 0.5})  # new columns: a new header line first
    assert tsv.read_text().splitlines() == ["time\ta", "t1\t1", "t2\t2", "time\ta\tb", "t3\t3\t0.5"]


def test_text_gen_side_by_side(tmp_path, monkeypatch, capsys):
    pytest.importorskip("opt_serving.model.wrapper", reason="the model issue's wrapper is not built yet")
    from opt_serving.model.embedded import ensure_embedded_model
    bench = load("benchmark_text_gen")
    monkeypatch.chdir(tmp_path)
    # both sides read the same numpy folder, so their greedy tokens must agree
    argv = ["--model", "jax/opt-tiny", "--path", str(ensure_embedded_model()), "--compare", "facebook/opt-tiny",
            "--batch-size", "2",
            "--prompt-len", "5", "--max-length", "9", "--n-warmup", "1", "--n-iter", "2", "--json", "out.json"]
    bench.main(argv)
    out = json.loads((tmp_path / "out.json").read_text())
    for res, name in ((out, "jax/opt-tiny"), (out["baseline"], "facebook/opt-tiny")):
        assert res["model"] == name
        assert (res["batch_size"], res["prompt_len"], res["gen_len"]) == (2, 5, 4)
        for key in ("tokens_per_s", "latency_s", "load_s", "compile_s", "peak_rss_mb", "tflops"):
            assert res[key] >= 0, key
        assert res["latency_min_s"] <= res["latency_s"] <= res["latency_max_s"]
        assert res["tokens_per_s"] == pytest.approx(2 * 4 / res["latency_s"])
        assert res["first_call_s"] >= res["compile_s"]
        assert res["peak_rss_mb"] > 50  # at least the interpreter and the framework
    assert out["speedup"] == pytest.approx(out["tokens_per_s"] / out["baseline"]["tokens_per_s"])
    assert out["tokens_agree"] == 1.0
    # each side ran in a process of its own, neither of them this one
    assert len({out["pid"], out["baseline"]["pid"], os.getpid()}) == 3
    assert "speedup jax/opt-tiny / facebook/opt-tiny" in capsys.readouterr().out
    # one TSV row per model, under one header; a second run appends rows only
    bench.main(["--model", "facebook/opt-tiny", "--dummy", "--gen-len", "2", "--n-warmup", "0", "--n-iter", "1"])
    rows = list(csv.reader(open(tmp_path / "results.tsv"), delimiter="\t"))
    same = bench.main(argv[:-2] + ["--same-process", "--tsv", ""])
    assert same["pid"] == same["baseline"]["pid"] == os.getpid() and same["tokens_agree"] == 1.0
    assert rows[0][:2] == ["time", "model"] and [r[1] for r in rows[1:]] == [
        "jax/opt-tiny", "facebook/opt-tiny", "facebook/opt-tiny"]


@pytest.mark.parametrize("argv, message", [
    (["--prompt-len", "8", "--max-length", "8"], "--gen-len must be at least 1"),
    (["--model", "torch/opt-tiny", "--dummy"], "unknown model prefix"),
    (["--model", "jax/opt-tiny"], "give --path"),
    (["--model", "jax/opt-7b", "--dummy"], "unknown OPT model"),
])
def test_text_gen_bad_arguments(argv, message, capsys):
    bench = load("benchmark_text_gen")
    with pytest.raises((SystemExit, ValueError)) as e:
        bench.main(argv + ["--tsv", ""])
    assert message in str(e.value) + capsys.readouterr().err


# ---- serving: against the real HTTP app over the fake engine (exact, fast) ----

def fake_server(start: bool = True):
    from opt_serving.service.app import create_app
    from opt_serving.service.testserver import serve_in_thread
    from opt_serving.text.fake import fake_generator
    # greedy fake model: next id = last + 1, so ids <= 100 plus <= 32 new tokens never reach EOS (wraps at 260)
    return serve_in_thread(create_app(fake_generator(num_slots=4, max_seq_len=64, max_queue=64, start=start),
                                      close_generator=True))


SERVE_ARGS = ["--num-requests", "12", "--prompt-len", "3:12", "--output-len", "4:32", "--token-ids", "4:100"]


@pytest.mark.parametrize("load_args", [["--concurrency", "8"], ["--request-rate", "200", "--concurrency", "4"]])
def test_serving_counts_every_token(tmp_path, load_args):
    bench = load("served.benchmark_serving")
    planned = bench.make_requests(bench.parse_args(SERVE_ARGS))
    with fake_server() as url:
        bench.main(["--url", url, *SERVE_ARGS, *load_args, "--json", str(tmp_path / "s.json")])
    s = json.loads((tmp_path / "s.json").read_text())
    assert (s["completed"], s["failed"], s["unfinished"]) == (12, 0, 0)
    assert s["model"] == "opt-fake"
    assert s["total_output_tokens"] == sum(m for _, m in planned)
    assert s["total_input_tokens"] == sum(len(p) for p, _ in planned)
    assert s["output_tokens_per_s"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        st = s[key]
        assert 0 <= st["min"] <= st["median"] <= st["p99"] <= st["max"], key
    assert s["ttft_s"]["max"] <= s["e2e_s"]["max"] <= s["duration_s"]


def test_serving_deadline_cancels_unfinished_requests():
    bench = load("served.benchmark_serving")
    with fake_server(start=False) as url:  # an engine that never runs: every request hangs
        s = bench.main(["--url", url, *SERVE_ARGS, "--concurrency", "4", "--max-duration", "0.5"])
    assert (s["completed"], s["unfinished"]) == (0, 12)


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com", "ftp://127.0.0.1"])
def test_serving_refuses_non_loopback(url, capsys):
    bench = load("served.benchmark_serving")
    with pytest.raises(SystemExit):
        bench.parse_args(["--url", url])
    assert "--url" in capsys.readouterr().err


def test_serving_reports_server_errors():
    bench = load("served.benchmark_serving")
    with fake_server() as url:  # ids beyond the fake vocabulary (260): the server answers 400
        s = bench.main(["--url", url, "--num-requests", "3", "--token-ids", "300:400", "--concurrency", "2"])
    assert (s["completed"], s["failed"]) == (0, 3)
    assert s["errors"] and s["errors"][0].startswith("HTTP 400")


def test_lm_eval_task_is_built_from_its_own_corpus(tmp_path):
    bench = load("served.benchmark_lm_eval")
    corpus = [line for line in bench.CORPUS.read_text().splitlines() if line.strip()]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        bench.make_task(tmp_path / d)
    rows = {d: [json.loads(line) for f in ("train", "test") for line in (tmp_path / d / f"{f}.jsonl").open()]
            for d in ("a", "b")}
    assert rows["a"] == rows["b"]  # seeded: the same task every run
    assert len(rows["a"]) == len(corpus)
    # each document: a corpus sentence with its last words cut off, the true ending among the choices
    assert sorted(r["context"] + " " + r["choices"][r["label"]] for r in rows["a"]) == sorted(corpus)
    assert all(len(r["choices"]) >= 3 and len(set(r["choices"])) == len(r["choices"]) for r in rows["a"])

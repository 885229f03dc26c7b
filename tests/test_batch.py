"""Offline batch runner: request checks, budget batching, resume, and end-to-end runs."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from opt_serving import batch as B


# ---- parsing ---------------------------------------------------------------------------------

def test_parse_fills_openai_defaults_and_keeps_the_line():
    line = '{"prompt": "hi", "engine": "gpt-j-6b", "stop": "\\n", "n": 2}'
    r = B.parse_request(3, line)
    assert r.request == json.loads(line)  # echoed as given, unknown fields kept
    assert r.params == dict(max_tokens=16, temperature=1.0, top_p=1.0, n=2, best_of=2, logprobs=None,
                            echo=False, stop=["\n"], seed=None)
    assert r.key == "body:" + json.dumps(json.loads(line), sort_keys=True)


def test_parse_uses_the_id_field_as_key():
    assert B.parse_request(1, '{"prompt": "a", "request_id": 7}').key == "id:7"
    assert B.parse_request(1, '{"prompt": "a", "custom_id": "x"}').key == "id:x"


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "a", "max_tokens": 3', "not valid JSON"),
    ('["a"]', "JSON object"),
    ('{"max_tokens": 3}', "missing field 'prompt'"),
    ('{"prompt": ""}', "non-empty"),
    ('{"prompt": ["a", "b"]}', "one prompt per line"),
    ('{"prompt": [1, -2]}', "token ids"),
    ('{"prompt": "a", "max_tokens": "5"}', "max_tokens must be an integer"),
    ('{"prompt": "a", "max_tokens": true}', "max_tokens must be an integer"),
    ('{"prompt": "a", "max_tokens": -1}', "max_tokens must be >= 0"),
    ('{"prompt": "a", "temperature": "hot"}', "temperature must be a number"),
    ('{"prompt": "a", "top_p": 1.5}', "top_p must be in"),
    ('{"prompt": "a", "n": 3, "best_of": 2}', "best_of (2) must be >= n (3)"),
    ('{"prompt": "a", "logprobs": 9}', "logprobs must be in"),
    ('{"prompt": "a", "echo": "yes"}', "echo must be true or false"),
    ('{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', "stop must be"),
    ('{"prompt": "a", "stop": [3]}', "stop must be"),
    ('{"prompt": "a", "max_tokens": 0}', "0 only with echo"),
])
def test_parse_rejects_bad_lines_with_a_message(line, words):
    with pytest.raises(B.RequestError) as e:
        B.parse_request(4, line)
    assert words in str(e.value) and "line 4" in str(e.value)
    assert e.value.request == (json.loads(line) if "not valid" not in words else line)


# ---- resume bookkeeping ----------------------------------------------------------------------

def test_read_done_counts_records_and_cuts_a_torn_tail(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    recs = [{"request": {"prompt": "a"}, "result": {"choices": []}},
            {"request": {"prompt": "a"}, "result": {"choices": []}},
            {"request": {"prompt": "b", "id": 3}, "error": {"message": "x"}},
            {"request": "not json {", "error": {"message": "x"}}]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    out.write_text(text + '{"request": {"prompt": "c"}, "res')
    done = B.read_done(out)
    assert done == {B.request_key({"prompt": "a"}): 2, "id:3": 1, "raw:not json {": 1}
    assert out.read_text() == text


def test_read_done_finishes_a_complete_last_line_without_newline(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"request": {"prompt": "a"}, "result": {}}))
    assert sum(B.read_done(out).values()) == 1
    assert out.read_text().endswith("}\n")


def test_read_done_refuses_a_foreign_file(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"hello": 1}\n' + json.dumps({"request": {"prompt": "a"}, "result": {}}) + "\n")
    with pytest.raises(SystemExit, match="line 1 is not a result record"):
        B.read_done(out)


# ---- end to end on the fake engine (see opt_serving/engine/fake.py: greedy continues
# last + 1 with log-probability -ln2; bytes are ids 4 + b, so after "a" greedy writes "bcd...") ----

LN2 = math.log(2)


@pytest.fixture
def fake():
    from opt_serving.text.fake import fake_generator
    gen = fake_generator(num_slots=4, max_seq_len=64, max_queue=16)
    yield gen
    gen.close()


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


MIXED = [
    {"prompt": "a", "max_tokens": 3, "temperature": 0, "logprobs": 1, "engine": "opt-fake", "best_of": 1,
     "n": 1, "echo": False, "stop": ["\n"], "top_p": 1},
    {"prompt": "hello", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "n": 2, "best_of": 3, "seed": 1},
    {"prompt": "ab", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0},
    {"prompt": [2, 101], "max_tokens": 2, "temperature": 0.0},
    {"prompt": "a", "max_tokens": 10, "temperature": 0, "stop": "e", "request_id": "s1"},
    {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1},
    {"prompt": "xyz", "max_tokens": 4, "temperature": 1.0, "n": 3, "logprobs": 2, "seed": 5},
]


def test_mixed_settings_round_trip_in_the_seed_shape(tmp_path, fake):
    inp = _write(tmp_path / "in.jsonl", MIXED)
    s = B.run_file(inp, tmp_path / "out.jsonl", fake, budget=10_000, progress=False)
    assert (s.done, s.failed, s.skipped) == (len(MIXED), 0, 0)
    recs = _records(tmp_path / "out.jsonl")
    assert sorted(json.dumps(r["request"], sort_keys=True) for r in recs) == \
        sorted(json.dumps(r, sort_keys=True) for r in MIXED)       # each answered once, echoed as given
    by_prompt = {json.dumps(r["request"], sort_keys=True): r for r in recs}
    for req in MIXED:
        rec = by_prompt[json.dumps(req, sort_keys=True)]
        assert set(rec) == {"request", "result"} and set(rec["result"]) == {"choices", "request_time"}
        assert set(rec["result"]["request_time"]) == {"batch_time", "batch_size"}
        choices = rec["result"]["choices"]
        assert [c["index"] for c in choices] == list(range(req.get("n", 1)))
        for c in choices:
            assert set(c) == {"text", "index", "logprobs", "finish_reason"}
            assert set(c["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    get = lambda i: by_prompt[json.dumps(MIXED[i], sort_keys=True)]["result"]["choices"]  # noqa: E731
    [c] = get(0)  # greedy: b c d, each at -ln2, offsets count from the end of the prompt
    assert (c["text"], c["finish_reason"], c["logprobs"]["tokens"]) == ("bcd", "length", ["b", "c", "d"])
    assert c["logprobs"]["token_logprobs"] == pytest.approx([-LN2] * 3)
    assert c["logprobs"]["text_offset"] == [1, 2, 3]
    assert [list(t) for t in c["logprobs"]["top_logprobs"]] == [["b"], ["c"], ["d"]]
    assert get(2)[0]["text"] == "abcd"                       # echo
    assert get(3)[0]["text"] == "bc"                         # a token-id prompt, same as "a"
    assert (get(4)[0]["text"], get(4)[0]["finish_reason"]) == ("bcd", "stop")
    # echo lists every token the model read, the tokenizer's </s> first (no logprob, no text), as vLLM does:
    # "b" after "a" is the fake's greedy pick
    assert get(5)[0]["text"] == "ab" and get(5)[0]["logprobs"]["tokens"] == ["</s>", "a", "b"]
    assert get(5)[0]["logprobs"]["token_logprobs"][0] is None
    assert get(5)[0]["logprobs"]["token_logprobs"][2] == pytest.approx(-LN2)
    assert all(len(t) <= 3 for c in get(6) for t in c["logprobs"]["top_logprobs"])


def test_bad_lines_become_error_records_and_the_run_goes_on(tmp_path, fake):
    lines = ['{"prompt": "a", "max_tokens": 2, "temperature": 0}',
             '{"prompt": "a", "max_tokens": ',                              # torn JSON
             {"prompt": "a", "max_tokens": "two"},                         # bad type
             {"prompt": "a" * 70, "max_tokens": 2},                         # too long for 64 positions
             {"prompt": [2, 999], "max_tokens": 2},                         # outside the vocabulary
             {"prompt": "b", "max_tokens": 2, "temperature": 0, "id": 1},
             {"prompt": "c", "max_tokens": 2, "temperature": 0, "id": 1},   # duplicate id
             "",                                                            # blank lines are skipped
             {"prompt": "c", "max_tokens": 1, "temperature": 0}]
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    s = B.run_file(inp, out, fake, progress=False)
    assert (s.done, s.failed) == (3, 5)
    errors = {json.dumps(r["request"]): r["error"]["message"] for r in _records(out) if "error" in r}
    msgs = sorted(errors.values())
    assert [m.split(":")[0] for m in msgs] == ["line 2", "line 3", "line 4", "line 5", "line 7"]
    assert "not valid JSON" in errors[json.dumps('{"prompt": "a", "max_tokens":')]
    assert "max_tokens must be an integer" in errors[json.dumps(lines[2])]
    assert "maximum context length is 64 tokens" in errors[json.dumps(lines[3])]
    assert "999 is outside the vocabulary" in errors[json.dumps(lines[4])]
    assert "duplicate request id 1" in errors[json.dumps(lines[6])]
    # a re-run finds everything answered, errors included, and adds nothing
    before = out.read_text()
    s2 = B.run_file(inp, out, fake, progress=False)
    assert (s2.done, s2.failed, s2.skipped) == (0, 0, 8) and out.read_text() == before


def test_budget_limits_what_is_in_flight(tmp_path, fake):
    reqs = [{"prompt": "a" * (i % 7 + 1), "max_tokens": 8, "temperature": 0, "id": i} for i in range(24)]
    inp = _write(tmp_path / "in.jsonl", reqs)
    # each request holds 2 + len(prompt) + 8 tokens in flight; a budget of 12 admits only one at a time
    s = B.run_file(inp, tmp_path / "one.jsonl", fake, budget=12, progress=False)
    assert s.done == 24 and s.peak_requests == 1
    assert {r["result"]["request_time"]["batch_size"] for r in _records(tmp_path / "one.jsonl")} == {1}
    s = B.run_file(inp, tmp_path / "many.jsonl", fake, budget=60, progress=False)
    assert s.done == 24 and 1 < s.peak_requests and s.peak_tokens <= 60
    assert max(r["result"]["request_time"]["batch_size"] for r in _records(tmp_path / "many.jsonl")) > 1
    # same greedy answers either way
    texts = lambda p: {r["request"]["id"]: r["result"]["choices"][0]["text"] for r in _records(p)}  # noqa
    assert texts(tmp_path / "one.jsonl") == texts(tmp_path / "many.jsonl")


def test_a_request_over_the_budget_runs_alone(tmp_path, fake):
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "abc", "max_tokens": 30, "temperature": 0},
                                         {"prompt": "a", "max_tokens": 2, "temperature": 0}])
    s = B.run_file(inp, tmp_path / "out.jsonl", fake, budget=10, progress=False)
    assert (s.done, s.peak_requests) == (2, 1)


def test_missing_input_and_bad_budget_are_clear_errors(tmp_path, fake):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        B.run_file(tmp_path / "nope.jsonl", tmp_path / "out.jsonl", fake)
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "a"}])
    with pytest.raises(ValueError, match="budget must be positive"):
        B.run_file(inp, tmp_path / "out.jsonl", fake, budget=0)



def test_an_engine_failure_stops_the_run_and_a_rerun_finishes_it(tmp_path):
    from opt_serving.engine.scheduler import Engine
    from opt_serving.text.generator import Generator
    from opt_serving.engine.fake import FakeSlots
    from opt_serving.text.fake import byte_tokenizer

    class FailsOnce(FakeSlots):
        def step(self):
            if self.steps == 5 and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("device lost")
            return super().step()

    gen = Generator(Engine(FailsOnce(2, 64), max_queue=8), byte_tokenizer())
    n = 12
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "a", "max_tokens": 4, "temperature": 0, "id": i}
                                         for i in range(n)])
    out = tmp_path / "out.jsonl"
    try:
        with pytest.raises(RuntimeError, match="the engine failed .*device lost.*re-run to finish"):
            B.run_file(inp, out, gen, budget=16, progress=False)
        first = _records(out)
        assert len(first) < n and all("result" in r for r in first)  # nothing written as failed
        s = B.run_file(inp, out, gen, budget=16, progress=False)  # the engine recovered
    finally:
        gen.close()
    assert (s.skipped, s.done) == (len(first), n - len(first))
    assert sorted(r["request"]["id"] for r in _records(out)) == list(range(n))


KILLABLE = """
import signal, sys, time
from opt_serving import batch as B
from opt_serving.engine.scheduler import Engine
from opt_serving.text.generator import Generator
from opt_serving.engine.fake import FakeSlots
from opt_serving.text.fake import byte_tokenizer

class SlowSlots(FakeSlots):  # a decode step that takes time, like a real model's
    def step(self):
        time.sleep(0.01)  # (long enough that the test sees its first lines while most are still to come)
        return super().step()

signal.signal(signal.SIGTERM, B._interrupt)  # as `opt-serving batch` does
gen = Generator(Engine(SlowSlots(4, 64), max_queue=16), byte_tokenizer())
B.run_file(sys.argv[1], sys.argv[2], gen, budget=200, progress=False)
"""


def _expected(i: int) -> str:  # greedy after one letter: the next 6 letters
    return "".join(chr(97 + i % 20 + k) for k in range(1, 7))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_run_resumes_with_every_request_exactly_once(tmp_path, fake, sig):
    n = 400
    inp = _write(tmp_path / "in.jsonl", [{"prompt": chr(97 + i % 20), "max_tokens": 6, "temperature": 0,
                                          "request_id": i} for i in range(n)])
    out = tmp_path / "out.jsonl"
    script = tmp_path / "run.py"
    script.write_text(KILLABLE)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, str(script), str(inp), str(out)], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.PIPE)
    try:
        while proc.poll() is None and (not out.exists() or out.read_text().count("\n") < 20):
            time.sleep(0.005)  # polling the output, not standing in for synchronisation
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()}"
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    written = out.read_text()
    kept = written.count("\n")
    assert 20 <= kept < n
    if sig == signal.SIGKILL:  # what a kill in the middle of a write leaves behind
        out.write_text(written + '{"request": {"prompt": "q", "max_tokens": 6, "temperature": 0, "req')
    s = B.run_file(inp, out, fake, progress=False)
    assert (s.skipped, s.done, s.failed) == (kept, n - kept, 0)
    recs = _records(out)
    assert sorted(r["request"]["request_id"] for r in recs) == list(range(n))
    assert all(r["result"]["choices"][0]["text"] == _expected(r["request"]["request_id"]) for r in recs)


# ---- the real tiny model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.text.loading import load_generator
    path = ensure_embedded_model()
    gen = load_generator("jax/opt-tiny", path, max_batch_size=4, max_seq_len=64, warmup=False)
    yield path, gen
    gen.close()


def test_greedy_results_equal_generate(tmp_path, tiny):
    from opt_serving.model.wrapper import get_model
    path, gen = tiny
    prompts = ["the cat sat on", "hello", "north of the garden is the", "a b c d e f g h i j k l m n o p q r"]
    lines = []
    for i, p in enumerate(prompts):  # greedy lines mixed with sampled ones sharing the decode steps
        lines.append({"prompt": p, "max_tokens": 12, "temperature": 0, "id": f"g{i}"})
        lines.append({"prompt": p, "max_tokens": 7, "temperature": 1.0, "top_p": 0.9, "n": 2, "id": f"s{i}"})
    out = tmp_path / "out.jsonl"
    s = B.run_file(_write(tmp_path / "in.jsonl", lines), out, gen, budget=200, progress=False)
    assert (s.done, s.failed) == (8, 0) and s.peak_requests > 1
    got = {r["request"]["id"]: r["result"]["choices"] for r in _records(out)}
    model = get_model("jax/opt-tiny", path)
    tok = gen.tokenizer
    enc = [tok(p)["input_ids"] for p in prompts]
    width = max(map(len, enc))  # one left-padded generate() call: one compile
    ids = np.array([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = np.array([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    seqs = np.asarray(model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    for i, p in enumerate(prompts):
        seq = seqs[i, width:].tolist()
        if tok.eos_token_id in seq:  # the generator stops at EOS and leaves it out of the text
            seq = seq[:seq.index(tok.eos_token_id)]
        [c] = got[f"g{i}"]
        assert c["logprobs"]["tokens"] == [gen.token_text(t) for t in seq], p  # each token's own text
        assert c["text"] == tok.decode(seq, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert c["finish_reason"] == ("length" if len(seq) == 12 else "stop")
        assert len(got[f"s{i}"]) == 2


def test_cli_runs_the_embedded_model_and_skips_what_is_done(tmp_path):
    lines = [{"prompt": "the cat", "max_tokens": 4, "temperature": 0, "engine": "opt-tiny"},
             {"prompt": "a garden", "max_tokens": 3, "temperature": 0.5, "n": 2, "logprobs": 1},
             {"prompt": "already answered", "max_tokens": 3},
             '{"prompt": broken']
    inp = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    done = {"request": lines[2], "result": {"choices": [], "request_time": {}}}
    out.write_text(json.dumps(done) + "\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "opt_serving", "batch", "--input", str(inp), "--output",
                           str(out), "--max-seq-len", "32", "--max-batch-size", "2", "--no-progress"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "done 2, failed 1, skipped 1" in proc.stderr
    recs = _records(out)
    assert recs[0] == done and len(recs) == 4
    by_prompt = {json.dumps(r["request"]): r for r in recs}
    assert len(by_prompt[json.dumps(lines[1])]["result"]["choices"]) == 2
    assert "not valid JSON" in by_prompt[json.dumps(lines[3])]["error"]["message"]

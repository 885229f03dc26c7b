"""A load generator no one here wrote, NVIDIA's AIPerf (PyPI `aiperf`, requirements-bench.txt), against our
server: the in-process fake engine behind the real FastAPI app. What it counts (requests, prompt and output
tokens) must equal what the server's /metrics counted, and what our own client (benchmark_serving.py) counts
for the same request shape. Skipped where aiperf is not installed (it lives in a venv of its own:
`python3.11 -m venv .venv-bench && .venv-bench/bin/pip install -r requirements-bench.txt`)."""
from __future__ import annotations

import re

import httpx
import pytest

from benchmark.served import compare_loadgen as compare

AIPERF = compare.find_aiperf()
pytestmark = pytest.mark.skipif(AIPERF is None, reason="aiperf not installed (requirements-bench.txt: "
                                                       ".venv-bench/bin/aiperf, PATH or $AIPERF)")

REQUESTS, CONCURRENCY, PROMPT, OUTPUT = 24, 4, 8, 16


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text

    def value(pattern):
        m = re.search(r"^" + pattern + r" ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return {"requests": value(r'opt_serving_requests_total\{endpoint="completions",status="200"\}'),
            "prompt_tokens": value("opt_serving_prompt_tokens_total"),
            "output_tokens": value("opt_serving_generation_tokens_total")}


def delta(before: dict, after: dict) -> dict:
    return {k: int(after[k] - before[k]) for k in after}


@pytest.mark.slow
def test_aiperf_counts_what_the_server_and_our_client_count(tmp_path):
    from opt_serving.service.app import create_app
    from opt_serving.service.testserver import serve_in_thread
    from opt_serving.text.fake import byte_tokenizer, fake_generator

    tokdir = str(tmp_path / "tokenizer")
    byte_tokenizer().save_pretrained(tokdir)  # AIPerf sizes its prompts with the server's own tokenizer
    gen = fake_generator(num_slots=8, max_seq_len=128, max_queue=64)
    with serve_in_thread(create_app(gen, model_name="opt-fake")) as url:
        before = scrape(url)
        art = str(tmp_path / "aiperf")
        cmd = compare.aiperf_command(AIPERF, url, "opt-fake", tokdir, CONCURRENCY, REQUESTS, PROMPT, OUTPUT, art)
        theirs = compare.run_aiperf(cmd, art, timeout=240)
        mid = scrape(url)
        ours = compare.run_ours(url, "opt-fake", CONCURRENCY, REQUESTS, PROMPT, OUTPUT,
                                str(tmp_path / "ours.json"), timeout=120,
                                token_ids="4:259")  # inside the byte vocabulary
        after = scrape(url)
    server_theirs, server_ours = delta(before, mid), delta(mid, after)
    print("aiperf:", {k: theirs[k] for k in ("completed", "total_input_tokens", "total_output_tokens")},
          "server:", server_theirs)
    print("ours:", {k: ours[k] for k in ("completed", "total_input_tokens", "total_output_tokens")},
          "server:", server_ours)
    assert theirs["failed"] == 0 and ours["failed"] == 0
    # every request made exactly OUTPUT tokens (min_tokens = max_tokens, ignore_eos), counted alike by all three
    assert theirs["completed"] == server_theirs["requests"] == REQUESTS
    assert theirs["total_output_tokens"] == server_theirs["output_tokens"] == REQUESTS * OUTPUT
    assert theirs["total_input_tokens"] == server_theirs["prompt_tokens"]
    assert ours["completed"] == server_ours["requests"] == REQUESTS
    assert ours["total_output_tokens"] == server_ours["output_tokens"] == REQUESTS * OUTPUT
    assert ours["total_input_tokens"] == server_ours["prompt_tokens"] == REQUESTS * PROMPT
    # AIPerf's text prompts come to the same lengths in the server's tokenizer (</s> included), give or take
    # a token where its synthesised text re-tokenises differently
    assert abs(theirs["total_input_tokens"] - REQUESTS * PROMPT) <= REQUESTS
    assert theirs["output_tokens_per_s"] > 0 and theirs["ttft_s"]["median"] > 0

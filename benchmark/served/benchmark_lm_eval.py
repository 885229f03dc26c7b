"""lm-eval's `local-completions` on a multiple-choice task through `opt-serving serve`, with prefix caching and
with `--no-prefix-caching`, alternating: wall time, time in requests, and the scores (which must be identical).

Usage (lm-eval lives in a venv of its own, .venv-bench: `.venv-bench/bin/pip install -r requirements-bench.txt`):
  python benchmark/served/benchmark_lm_eval.py --model jax/opt-125m --dummy --tokenizer ../shared/opt-assets \\
      --limit 40 --rounds 2 --json lm_eval.json

The task is a local one (no dataset download): lm-eval's YAML task format over a jsonl file this script writes
from benchmark/served/data/lm_eval_corpus.txt (plain English sentences, one a line, fixed so that the task never changes
with the project's text), seeded: each document is a sentence with its last words cut off, the true ending among
three others, preceded by the same five solved examples (`num_fewshot: 5`, `sampler: first_n`, as MMLU's few-shot
prompts are). lm-eval scores each of a document's four endings with one request (echo, logprobs, max_tokens 1):
the documents share their few-shot prefix and a document's four requests their context, which is what a prefix
cache reuses. Requests go one at a time (lm-eval's default `num_concurrent=1`), so the run's time is the sum of
its requests' latencies; the server's own sum of them (/metrics, `e2e_request_latency_seconds_sum`) is printed
beside lm-eval's wall time, which also holds its start-up (imports, tokenising).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmark.* and its opt_serving
from benchmark import harness  # noqa: E402
from benchmark.common import machine_description, now, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parent / "data" / "lm_eval_corpus.txt"
TASK = "opt_serving_mc"


def make_task(folder: Path, seed: int = 0) -> None:
    """The task's jsonl (train: the five few-shot examples; test: the documents) and its YAML, in `folder`."""
    sentences = [line.split() for line in CORPUS.read_text().splitlines() if line.strip()]
    rng = np.random.default_rng(seed)
    rng.shuffle(sentences)
    rows = []
    for i, words in enumerate(sentences):
        cut = int(rng.integers(3, 7))
        others = [sentences[int(j)][-cut:] for j in rng.choice(len(sentences), 3, replace=False) if int(j) != i][:3]
        endings = [" ".join(words[-cut:])] + [" ".join(o) for o in others]
        order = rng.permutation(len(endings))
        rows.append({"context": " ".join(words[:-cut]), "choices": [endings[k] for k in order],
                     "label": int(np.argmax(order == 0))})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[5:]))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    train: {folder / 'train.jsonl'}
    test: {folder / 'test.jsonl'}
output_type: multiple_choice
training_split: train
test_split: test
fewshot_split: train
num_fewshot: 5
fewshot_config:
  sampler: first_n
doc_to_text: "Sentence: {{{{context}}}}\\nEnding:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
metric_list:
  - metric: acc
  - metric: acc_norm
""")


def make_tokenizer(folder: Path, assets: Path) -> None:
    """The real OPT tokenizer as transformers' AutoTokenizer reads it (../shared/opt-assets' README), in `folder`."""
    shutil.copy(assets / "gpt2-vocab.json", folder / "vocab.json")
    shutil.copy(assets / "gpt2-merges.txt", folder / "merges.txt")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>", "unk_token": "</s>",
        "pad_token": "<pad>", "add_bos_token": True}))


def start_server(args, prefix_caching: bool, log: Path) -> harness.Server:
    argv = ["--model", args.model, "--max-batch-size", str(args.max_batch_size), "--max-seq-len",
            str(args.max_seq_len), "--dtype", args.dtype]
    argv += ["--dummy"] if args.dummy else ["--path", args.path]
    argv += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    argv += [] if prefix_caching else ["--no-prefix-caching"]
    name = f"opt-serving serve ({'with' if prefix_caching else 'without'} the prefix cache)"
    return harness.serve(argv, port=args.port, name=name, log=log, timeout=args.start_timeout)


def server_metric(port: int, name: str) -> float:
    import httpx
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def run_lm_eval(args, work: Path, tag: str) -> dict:
    out = work / f"out-{tag}"
    model_args = (f"model={args.model},base_url=http://127.0.0.1:{args.port}/v1/completions,"
                  f"tokenizer_backend=huggingface,tokenizer={work / 'tokenizer'},num_concurrent=1,max_retries=1,"
                  "tokenized_requests=True")
    cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(work / "task"), "--limit", str(args.limit), "--output_path", str(out),
           "--log_samples"]
    before = server_metric(args.port, "opt_serving_e2e_request_latency_seconds_sum")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                                                                   "TOKENIZERS_PARALLELISM": "false"})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"lm_eval failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    in_requests = server_metric(args.port, "opt_serving_e2e_request_latency_seconds_sum") - before
    hits = server_metric(args.port, "opt_serving_prefix_cache_hit_rate")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    samples = [json.loads(line) for f in out.rglob(f"samples_{TASK}_*.jsonl") for line in f.read_text().splitlines()]
    loglik = [[float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]
    return {"wall_s": wall, "requests_s": in_requests, "hit_rate": hits, "acc": results["acc,none"],
            "acc_norm": results["acc_norm,none"], "loglikelihoods": loglik}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="jax/opt-125m")
    p.add_argument("--path", default=None)
    p.add_argument("--dummy", action="store_true")
    p.add_argument("--tokenizer", default=str(ROOT / ".." / "shared" / "opt-assets"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--limit", type=int, default=40,
                   help="documents (four requests each; at most the corpus's lines less five)")
    p.add_argument("--rounds", type=int, default=2, help="each round: with the prefix cache, then without")
    p.add_argument("--lm-eval", default=str(ROOT / ".venv-bench" / "bin" / "lm_eval"))
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    if not Path(args.lm_eval).exists():
        raise SystemExit(f"no lm_eval at {args.lm_eval}: python3.11 -m venv .venv-bench && "
                         ".venv-bench/bin/pip install -r requirements-bench.txt")
    runs = []
    with tempfile.TemporaryDirectory(prefix="opt-serving-lm-eval-") as tmp:
        work = Path(tmp)
        for d in ("task", "tokenizer"):
            (work / d).mkdir()
        make_task(work / "task")
        make_tokenizer(work / "tokenizer", Path(args.tokenizer))
        for rnd, side in harness.in_turn(["on", "off"], args.rounds):
            on, tag = side == "on", f"{rnd}-{side}"
            server = start_server(args, on, work / f"server-{tag}.log")
            try:
                res = run_lm_eval(args, work, tag)
            finally:
                server.stop()
            res.update(round=rnd, prefix_caching=on, time=now())
            runs.append(res)
            print(f"round {rnd} prefix caching {'on ' if on else 'off'}: lm_eval {res['wall_s']:.1f} s, in "
                  f"requests {res['requests_s']:.1f} s, hit rate {res['hit_rate']:.2f}, acc {res['acc']:.4f}, "
                  f"acc_norm {res['acc_norm']:.4f}", flush=True)
    on = [r for r in runs if r["prefix_caching"]]
    off = [r for r in runs if not r["prefix_caching"]]
    same = all((a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]) for a in on for b in off)
    diff = max(abs(x - y) for a in on for b in off for da, db in zip(a["loglikelihoods"], b["loglikelihoods"])
               for x, y in zip(da, db))
    speed = (np.median([r["requests_s"] for r in off]) / np.median([r["requests_s"] for r in on]),
             np.median([r["wall_s"] for r in off]) / np.median([r["wall_s"] for r in on]))
    print(f"{machine_description()}; {args.model}, {args.limit} documents x 4 requests")
    print(f"prefix caching: {speed[0]:.2f}x faster in requests, {speed[1]:.2f}x in lm_eval's wall time; scores "
          f"{'identical' if same else 'DIFFERENT'} (largest log-likelihood difference {diff:.2e})")
    med = harness.medians(runs, "prefix_caching", ("requests_s", "wall_s"))
    harness.print_comparison([("time in requests s", med[True]["requests_s"], med[False]["requests_s"]),
                              ("lm_eval wall time s", med[True]["wall_s"], med[False]["wall_s"])],
                             ours="prefix cache", peer="no prefix cache",
                             title=f"medians over {args.rounds} rounds", digits=2)
    if args.json:
        write_json(args.json, {"time": now(), "machine": machine_description(), "model": args.model,
                               "limit": args.limit, "runs": runs, "speedup_requests": speed[0],
                               "speedup_wall": speed[1], "scores_identical": same, "max_loglik_diff": diff})


if __name__ == "__main__":
    harness.script(main)

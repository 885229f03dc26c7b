"""Benchmark generation in the command line, Alpa's interface, optionally side by side with Hugging Face.

Usage:
  # Hugging Face PyTorch (the baseline), OPT-125m shape, random weights
  python benchmark/benchmark_text_gen.py --model facebook/opt-125m --dummy
  # our JAX model, one device, printing the generated text
  python benchmark/benchmark_text_gen.py --model jax/opt-125m --path /data/opt-125m-np --debug
  # ours against Hugging Face, each in its own process, runs interleaved so both see the same load
  python benchmark/benchmark_text_gen.py --model jax/opt-125m --dummy --batch-size 16 --compare facebook/opt-125m
  # the parallel backend on a Ray cluster
  python benchmark/benchmark_text_gen.py --model alpa/opt-175b --path /data/opt-175b-np

Every run is greedy and makes exactly --gen-len new tokens per row (min_new_tokens = max_new_tokens,
so EOS cannot end it early), which keeps two backends doing the same number of steps. Prompts are
random token ids (seeded) of exactly --prompt-len, no padding.

Reported: latency of one generate() call, generated tokens/s (batch x gen_len / latency), TFLOP/s by
Alpa's formula (common.gpt_inference_tflops), load time, compile time (first call minus a steady
call: tracing + XLA compilation + first-touch), and peak resident memory (process-wide).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: benchmark.* and its opt_serving
from benchmark.common import (append_tsv, gpt_inference_tflops, machine_description, now, peak_rss_mb,  # noqa: E402
                    rss_mb, write_json)

from opt_serving.config import OPTConfig, get_config  # noqa: E402

OPT_ASSETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "opt-assets"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="facebook/opt-125m",
                   help="facebook/opt-* (Hugging Face PyTorch), jax/opt-* (one device) or alpa/opt-* (parallel)")
    p.add_argument("--path", help="weights: a numpy folder (any prefix) or a Hugging Face folder (facebook/)")
    p.add_argument("--dummy", action="store_true", help="random weights of the named size, no files")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=8)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gen-len", type=int, help="new tokens per row (default 64)")
    g.add_argument("--max-length", type=int, help="prompt + new tokens per row (Hugging Face's max_length)")
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--quantize", choices=["int8"], default=None, help="ours: int8 weights (get_model(quantize=))")
    p.add_argument("--n-warmup", type=int, default=1, help="untimed calls first (the first one compiles)")
    p.add_argument("--n-iter", type=int, default=3, help="timed calls")
    p.add_argument("--debug", action="store_true", help="print the generated text")
    p.add_argument("--compare", metavar="MODEL",
                   help="a second model (e.g. facebook/opt-125m) run in the same invocation with the same "
                        "settings, interleaved call by call; prints ours / baseline")
    p.add_argument("--same-process", action="store_true",
                   help="with --compare, load both models in this process (by default each runs in its own "
                        "process: both frameworks run OpenMP thread teams, and two in one process slow "
                        "each other down)")
    p.add_argument("--tensor-parallel", type=int, help="alpa/ only")
    p.add_argument("--pipeline-parallel", type=int, help="alpa/ only")
    p.add_argument("--device-memory", help="alpa/ only: what each device may hold, e.g. 16GB (the plan is made "
                                          "for --ray-address's cluster, else this process's devices)")
    p.add_argument("--ray-address", default=None,
                   help="alpa/ only: the Ray cluster to plan for and run on (e.g. auto, HEAD:6379); by default "
                        "none is joined: a pp > 1 plan starts a Ray of its own, so another program's cluster on "
                        "this machine never changes the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--tsv", default="results.tsv", help="append one row per model here ('' to skip)")
    args = p.parse_args(argv)
    if args.max_length is not None:
        args.gen_len = args.max_length - args.prompt_len
    elif args.gen_len is None:
        args.gen_len = 64
    for name in ("batch_size", "prompt_len", "gen_len", "num_beams", "n_iter"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)}; "
                    "--max-length must exceed --prompt-len)")
    if args.n_warmup < 0:
        p.error("--n-warmup must be >= 0")
    return args


# ---- loading ----

def load_config(name: str, path: str | None) -> OPTConfig:
    if path and (Path(path) / "config.json").exists():
        return OPTConfig.from_hf_json(path)
    return get_config(name)  # raises with the list of known sizes


def load_hf(name: str, path: str | None, dummy: bool, dtype: str, seed: int):
    """The baseline: plain transformers OPTForCausalLM, nothing of ours in the loop."""
    import torch
    import transformers
    torch_dtype = getattr(torch, dtype)
    if dummy:
        hf_cfg = transformers.OPTConfig(**load_config(name, path).to_hf_dict())
        torch.manual_seed(seed)
        model = transformers.OPTForCausalLM(hf_cfg).to(torch_dtype)
    else:
        source = path or name  # a hub name needs the network
        if path and not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")):
            # a numpy folder (the one --compare shares with jax/): plain OPTForCausalLM with its weights
            from opt_serving.model.wrapper import get_model
            model = get_model(name, path=path, dtype=dtype)
            return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        try:
            model = transformers.OPTForCausalLM.from_pretrained(source, dtype=torch_dtype)
        except OSError as e:  # no network / no such folder: say what to do instead
            raise SystemExit(f"{name}: cannot load {source} ({e}); give --path or --dummy") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval()


def load_ours(name: str, path: str | None, dummy: bool, dtype: str, args):
    from opt_serving.model.wrapper import get_model
    kwargs = {}
    if name.startswith("alpa/"):
        if args.ray_address:
            import ray
            ray.init(address=args.ray_address, logging_level="ERROR")
        else:
            from opt_serving.testing.ray_cluster import no_foreign_clusters
            no_foreign_clusters()
        kwargs = dict(tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                      device_memory=args.device_memory, batch_size=args.batch_size)
    return get_model(name, path=path, dtype=dtype, dummy=dummy, quantize=args.quantize, **kwargs)


class Runner:
    """One model under test: load it, then time generate() calls on the same prompts."""

    def __init__(self, name: str, args):
        if not args.dummy and not args.path and not name.startswith("facebook/"):
            raise SystemExit(f"{name}: give --path to a weights folder, or --dummy for random weights")
        self.name, self.args = name, args
        self.is_hf = name.startswith("facebook/")
        self.cfg = load_config(name, args.path if not self.is_hf or args.path else None)
        # import the framework first: load time is reading/making weights, not importing torch or jax
        if self.is_hf:
            from transformers import OPTForCausalLM  # noqa: F401  (a lazy module: import it now)
        else:
            import opt_serving.model.wrapper  # noqa: F401
        rss0, t0 = rss_mb(), time.perf_counter()
        if self.is_hf:
            self.model = load_hf(name, args.path, args.dummy, args.dtype, args.seed)
        elif name.startswith(("jax/", "alpa/")):
            self.model = load_ours(name, args.path, args.dummy, args.dtype, args)
        else:
            raise SystemExit(f"unknown model prefix in {name!r}: use facebook/, jax/ or alpa/")
        self.load_s = time.perf_counter() - t0
        self.load_rss_mb = rss_mb() - rss0
        self.latencies: list[float] = []
        self.first_call_s = None

    def generate(self, input_ids: np.ndarray) -> np.ndarray:
        a = self.args
        gen = dict(max_new_tokens=a.gen_len, min_new_tokens=a.gen_len, do_sample=False,
                   num_beams=a.num_beams, pad_token_id=self.cfg.pad_token_id)
        if self.is_hf:
            import torch
            ids = torch.from_numpy(input_ids).to(self.model.device)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen)
            if out.is_cuda:
                torch.cuda.synchronize()
            return out.cpu().numpy()
        out = self.model.generate(input_ids=input_ids, **gen)
        # np.asarray waits for JAX's asynchronous dispatch, so the timer covers the work
        return np.asarray(getattr(out, "sequences", out))

    def timed(self, input_ids: np.ndarray) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        out = self.generate(input_ids)
        dt = time.perf_counter() - t0
        a = self.args
        want = (a.batch_size, a.prompt_len + a.gen_len)
        if out.shape != want:
            raise SystemExit(f"{self.name}: generate returned shape {out.shape}, expected {want} "
                             f"(batch, prompt + exactly gen_len new tokens)")
        return dt, out

    def result(self) -> dict:
        a, cfg = self.args, self.cfg
        latency = float(np.median(self.latencies))
        tokens = a.batch_size * a.gen_len
        num_devices = 1
        if self.name.startswith("alpa/"):
            num_devices = int(getattr(self.model, "num_devices", 0) or 1)
        return {
            "model": self.name, "dtype": a.dtype, "batch_size": a.batch_size, "prompt_len": a.prompt_len,
            "gen_len": a.gen_len, "num_beams": a.num_beams, "n_iter": a.n_iter,
            "latency_s": latency, "latency_min_s": min(self.latencies), "latency_max_s": max(self.latencies),
            "tokens_per_s": tokens / latency, "step_ms": 1e3 * latency / a.gen_len,
            "tflops": gpt_inference_tflops(a.batch_size * a.num_beams, a.prompt_len + a.gen_len,
                                           a.prompt_len + a.gen_len, cfg.num_hidden_layers,
                                           cfg.hidden_size, cfg.vocab_size, latency, num_devices),
            "load_s": self.load_s,
            # the first call pays tracing + compilation (+ first-touch); a steady call does not
            "compile_s": max(0.0, (self.first_call_s or latency) - latency),
            "first_call_s": self.first_call_s,
            "peak_rss_mb": peak_rss_mb(), "load_rss_mb": self.load_rss_mb,
            "pid": os.getpid(),  # the process it ran in (--compare: one each, unless --same-process)
        }


def _runner_process(conn, name: str, args) -> None:
    """A child process's loop: load `name`, then answer ProcessRunner's calls."""
    try:
        r = Runner(name, args)
        conn.send(("ok", (r.cfg, r.load_s, r.load_rss_mb)))
        while True:
            cmd, payload = conn.recv()
            if cmd == "timed":
                conn.send(("ok", r.timed(payload)))
            elif cmd == "result":
                r.latencies, r.first_call_s = payload
                conn.send(("ok", r.result()))
            else:
                return
    except BaseException as e:  # SystemExit too: the parent reports it and exits
        conn.send(("error", str(e) if isinstance(e, SystemExit) else repr(e)))


class ProcessRunner:
    """A Runner in a process of its own (spawned), driven call by call; timings are taken in there."""

    def __init__(self, name: str, args):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_runner_process, args=(child, name, args), daemon=True)
        self._proc.start()
        self.name = name
        self.cfg, self.load_s, self.load_rss_mb = self._reply()
        self.latencies: list[float] = []
        self.first_call_s = None

    def _reply(self):
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise SystemExit(f"{self.name}: its benchmark process died (exit code {self._proc.exitcode})")
        if status == "error":
            raise SystemExit(payload)
        return payload

    def timed(self, input_ids: np.ndarray) -> tuple[float, np.ndarray]:
        self._conn.send(("timed", input_ids))
        return self._reply()

    def result(self) -> dict:
        self._conn.send(("result", (self.latencies, self.first_call_s)))
        return self._reply()

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("stop", None))
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()


def make_prompts(cfg: OPTConfig, batch_size: int, prompt_len: int, seed: int) -> np.ndarray:
    # ids 4.. skip <s>, <pad>, </s>, <unk>; the same prompts for every model in the run
    rng = np.random.default_rng(seed)
    return rng.integers(4, min(cfg.vocab_size, 50265), size=(batch_size, prompt_len), dtype=np.int64)


def decode(cfg: OPTConfig, ids: np.ndarray) -> list[str]:
    """Text through the real OPT tokenizer where ../shared/opt-assets has it, else the ids."""
    from opt_serving.text.tokenizer import has_tokenizer, load_tokenizer
    if cfg.vocab_size >= 50265 and has_tokenizer(OPT_ASSETS):  # metaseq's file names, read in place
        return load_tokenizer(OPT_ASSETS).batch_decode(ids.tolist(), skip_special_tokens=True)
    return [" ".join(map(str, row)) for row in ids.tolist()]


def main(argv=None) -> dict:
    args = parse_args(argv)
    make = ProcessRunner if args.compare and not args.same_process else Runner
    runners = [make(args.model, args)]
    try:
        if args.compare:
            runners.append(make(args.compare, args))
        return _run(args, runners)
    finally:
        for r in runners:
            if isinstance(r, ProcessRunner):
                r.close()


def _run(args, runners) -> dict:
    cfgs = {(r.cfg.hidden_size, r.cfg.num_hidden_layers, r.cfg.vocab_size) for r in runners}
    if len(cfgs) > 1:
        raise SystemExit(f"--compare needs the same model shape on both sides, got {cfgs}")
    input_ids = make_prompts(runners[0].cfg, args.batch_size, args.prompt_len, args.seed)
    print(f"{machine_description()}; batch {args.batch_size}, prompt {args.prompt_len}, "
          f"gen {args.gen_len}, beams {args.num_beams}, {args.dtype}")
    for r in runners:
        print(f"{r.name}: loaded in {r.load_s:.2f} s (+{r.load_rss_mb:.0f} MB resident)")

    outputs = {}
    for r in runners:
        for i in range(args.n_warmup):
            dt, outputs[r.name] = r.timed(input_ids)
            if i == 0:
                r.first_call_s = dt
            print(f"{r.name}: warm-up {i + 1}/{args.n_warmup}: {dt:.3f} s")
    for i in range(args.n_iter):
        # ABBA order: neither side always runs first after the other's threads go idle
        order = runners if i % 2 == 0 else runners[::-1]
        for r in order:
            dt, outputs[r.name] = r.timed(input_ids)
            if r.first_call_s is None:
                r.first_call_s = dt
            r.latencies.append(dt)
            toks = args.batch_size * args.gen_len / dt
            print(f"{r.name}: run {i + 1}/{args.n_iter}: latency {dt:.3f} s, {toks:.1f} tokens/s")

    results = [r.result() for r in runners]
    for res in results:
        print(f"{res['model']}: median latency {res['latency_s']:.3f} s ({res['step_ms']:.1f} ms/token), "
              f"{res['tokens_per_s']:.1f} tokens/s, {res['tflops']:.4f} TFLOP/s, load {res['load_s']:.2f} s, "
              f"compile {res['compile_s']:.2f} s, peak RSS {res['peak_rss_mb']:.0f} MB")
    if args.debug:
        for r in runners:
            for j, text in enumerate(decode(r.cfg, outputs[r.name])):
                print(f"{r.name} [{j}]: {text!r}")

    summary = dict(results[0], time=now(), machine=machine_description())
    if len(results) > 1:
        summary["baseline"] = results[1]
        summary["speedup"] = results[0]["tokens_per_s"] / results[1]["tokens_per_s"]
        # with shared weights (--path) greedy tokens should agree; with --dummy each side has its own
        new = [outputs[r.name][:, args.prompt_len:] for r in runners]
        summary["tokens_agree"] = float(np.mean(new[0] == new[1]))
        print(f"speedup {args.model} / {args.compare}: {summary['speedup']:.2f}x tokens/s "
              f"(generated tokens agreeing: {summary['tokens_agree']:.0%})")
    if args.tsv:
        for res in results:
            row = {"time": summary["time"], **{k: res[k] for k in (
                "model", "dtype", "batch_size", "prompt_len", "gen_len", "num_beams", "latency_s",
                "tokens_per_s", "tflops", "load_s", "compile_s", "peak_rss_mb")}}
            row["speedup"] = summary.get("speedup", "") if res is results[0] else ""
            row["machine"] = summary["machine"]
            append_tsv(args.tsv, row)
    if args.json:
        write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()

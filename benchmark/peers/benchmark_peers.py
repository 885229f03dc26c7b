"""Ours against CTranslate2 (and Hugging Face PyTorch for prefill), side by side on the same weights.

Usage:
  # once: CTranslate2 and its converter in a virtualenv of their own, .venv-peers (torch first, alone: the CPU
  # build), ~30 s from the local wheel cache:
  bash benchmark/setup_peers.sh
  #   = python3.11 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 \
  #       && .venv-peers/bin/pip install -r requirements-peers.txt
  # generation: float32 and int8, batch 1, 16 and 64, prompt 16, 64 new tokens, 3 runs a side
  .venv/bin/python benchmark/benchmark_peers.py
  .venv/bin/python benchmark/benchmark_peers.py --dtypes float32 --batch-sizes 1,16,64 --reps 3 --json peers.json
  # on a machine others use too: start each timed call once other processes use < 0.3 cores
  .venv/bin/python benchmark/benchmark_peers.py --wait-quiet 0.3 --wait-max 60
  # prefill rate: one prompt of 512 and of 1024 tokens, 1 new token (time to first token), ours / CT2 / HF
  .venv/bin/python benchmark/benchmark_peers.py --prefill 512,1024 --dtypes float32

What it does:
- Makes one Hugging Face OPT folder of random weights (the opt-125m shape by default; `--hf-dir` takes an existing
  one instead). The weights are drawn as `transformers` initialises OPT (normal(0, 0.02), zero biases, unit
  norms) and every 2-D weight is then multiplied by `--weight-scale` (3). As drawn (x1) greedy decoding of
  random prompts is degenerate: ~3 distinct tokens in 24, top-2 logit gaps ~0.13. Larger scales give varied
  text (x3: ~15 distinct tokens in 24) but past ~x4 the random network turns chaotic: a small error anywhere
  flips the output, and int8 weights alone (per-channel, fake-quantized in torch) kept the first greedy token of
  only 38% of rows at x8, against 94-100% at x1-x4. At x3 both engines' int8 keep the float32 first token in
  ~90% of rows (16 rows: ours 94%, CTranslate2 88%), so int8 agreement figures mean something. A word-level
  tokenizer of the vocabulary's size is saved beside the weights (CTranslate2's converter reads the vocabulary
  from it; no text is tokenized).
- Converts that folder twice: with CTranslate2's own converter (`ct2-transformers-converter --quantization
  float32|int8`) in the peer virtualenv, and with ours (`python -m opt_serving convert --dtype float32`).
  Everything lands in `--work-dir` and is reused by later runs (`--rebuild` to start over).
- Runs each side in a process of its own (ours in this interpreter's virtualenv, CTranslate2 in
  `--peer-python`'s, Hugging Face in this one with `torch.set_num_threads`), loaded once per dtype, driven over a
  pipe; every call is timed inside its process. For each batch size: `--warmup` untimed calls per side (ours
  compiles there), then `--reps` timed calls interleaved ABAB (ours, CTranslate2, ours, ...) so both see the same
  machine load, after `--pause` seconds of rest (and with `--wait-quiet`, once the machine is quiet). Prompts are
  seeded random ids (4..50264), the same on both sides, no padding. Each call also records the CPU time its side
  used and what every other process on the machine used meanwhile (/proc/stat), printed per call and summed up
  under the table: CTranslate2's figures fall several-fold when another process takes a core (its threads meet
  at a barrier in every operation), so a run that others disturbed shows it.
- Greedy, exactly `--gen-len` new tokens per row on both sides: ours with min_new_tokens = max_new_tokens,
  CTranslate2 with min_length = max_length = gen_len and include_prompt_in_result=False (so the prompt is
  forwarded at once and max_length counts new tokens only). Every output's shape is checked.
- CTranslate2: `Generator(path, device="cpu", compute_type=float32|int8, inter_threads=1,
  intra_threads=--threads)`. Ours uses every core this process may run on (its kernels and XLA's pool); --threads
  defaults to that count. int8 on our side is `get_model(..., quantize="int8")`; where this code has no such
  option the int8 rows say "ours int8: not available" and still show CTranslate2's figures.

Reported: tokens/s of each timed call (batch x gen_len / latency; prefill: prompt tokens / latency), the median
per side (calls during which other processes used more than `--disturbed` cores are starred and left out of
it), ours / CTranslate2 (and ours / HF for prefill) of the medians, and the share of generated tokens (same row,
same position) that agree: between the sides at the same dtype (with the same float32 weights ~100%), and for
int8 each side's against its own float32 output when float32 ran too (once a row diverges the rest of it mostly
differs, so this is close to the share of each row generated before its first difference).
CTranslate2 is a benchmark-only dependency: nothing in opt_serving imports it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER_PYTHON = REPO / ".venv-peers" / "bin" / "python"
PEER_SETUP = ("bash benchmark/setup_peers.sh   (that is: python3.11 -m venv .venv-peers && "
              ".venv-peers/bin/pip install torch==2.13.0 && .venv-peers/bin/pip install -r requirements-peers.txt)")
SIDES = {"ours": "ours", "ct2": "CTranslate2", "hf": "HF PyTorch"}


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _dtypes(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in ("float32", "int8")]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--dtypes takes float32 and/or int8, got {text!r}")
    return values


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ours against CTranslate2 (and HF for --prefill) on the same weights",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hf-dir", help="an existing Hugging Face OPT folder (config.json, weights, tokenizer); "
                                    "default: build one of random weights in --work-dir")
    p.add_argument("--size", default="opt-125m", help="the shape of the random model to build")
    p.add_argument("--weight-scale", type=float, default=3.0,
                   help="multiply every 2-D random weight by this (varied greedy text; past ~4 the network "
                        "turns chaotic and int8 flips most tokens)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--work-dir", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "opt-serving-peers"),
                   help="where the built folder and the conversions are kept (reused by later runs)")
    p.add_argument("--rebuild", action="store_true", help="build and convert again even if --work-dir has them")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--dtypes", type=_dtypes, default=["float32", "int8"], help="float32 and/or int8")
    p.add_argument("--prefill", type=_ints, metavar="LENS",
                   help="prefill mode instead: one prompt of each length, 1 new token; ours, CTranslate2 and "
                        "Hugging Face PyTorch (float32 only)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per side and shape")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per side and shape first")
    p.add_argument("--pause", type=float, default=0.2,
                   help="seconds of rest before each call, so the other side's threads have gone idle")
    p.add_argument("--wait-quiet", type=float, metavar="CORES",
                   help="before each timed call, wait until other processes use less than CORES cores (measured "
                        "over 1 s; at most --wait-max seconds, then it goes on and says so): for a shared machine")
    p.add_argument("--wait-max", type=float, default=120.0, help="see --wait-quiet")
    p.add_argument("--disturbed", type=float, default=0.2, metavar="CORES",
                   help="a timed call during which other processes used more than CORES cores on average is "
                        "starred in the table and left out of the median (all of a side's calls, if every one is)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="CTranslate2's intra_threads, torch's threads, OPT_SERVING_CPU_THREADS for ours")
    p.add_argument("--peer-python", default=str(DEFAULT_PEER_PYTHON),
                   help="the interpreter that has ctranslate2 (and torch + transformers for its converter)")
    p.add_argument("--ours-python", default=sys.executable, help="the interpreter that has opt_serving's dependencies")
    p.add_argument("--ours-src", default=str(REPO),
                   help="the source tree whose opt_serving is measured (put first on PYTHONPATH), e.g. a built "
                        "`git archive` of another commit")
    p.add_argument("--ct2-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the CTranslate2 process (repeatable), e.g. CT2_FORCE_CPU_ISA=AVX512 or "
                        "CT2_USE_MKL=1; its defaults on this CPU are printed with its load line")
    p.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    # internal: the per-side processes and the model builder run this file too
    p.add_argument("--worker", choices=["ours", "ct2", "hf", "build"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtypes = sorted(set(args.dtypes), key=["float32", "int8"].index)  # float32 first: int8's reference
    for name in ("prompt_len", "gen_len", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.pause < 0:
        p.error("--warmup and --pause must be >= 0")
    for kv in args.ct2_env:
        if "=" not in kv:
            p.error(f"--ct2-env takes KEY=VALUE, got {kv!r}")
    return args


# ================================================================ the side processes
# They import nothing of the other side: the CTranslate2 one runs in the peer virtualenv, which has no
# opt_serving and no jax.

def _worker_main(args) -> None:
    # replies go to the original stdout only; stray prints from the libraries go to stderr (the log)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw):
        proto.write(json.dumps(kw) + "\n")
        proto.flush()

    try:
        t0 = time.perf_counter()
        side = {"ours": OursSide, "ct2": Ct2Side, "hf": HfSide}[args.worker](args.model_dir, args.dtype, args.threads)
        load_s = time.perf_counter() - t0
    except (TypeError, NotImplementedError) as e:
        reply(ok=False, unavailable=True, error=f"{type(e).__name__}: {e}")
        return
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which stops)
        reply(ok=False, error=f"{type(e).__name__}: {e}")
        raise
    import gc
    gc.collect()
    gc.freeze()  # the loaded model's objects out of the collector's way, as `opt-serving batch` does
    reply(ok=True, load_s=load_s, info=side.info)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            return
        try:
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            out = side.generate(msg["ids"], msg["new"])
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)  # all of its threads
            reply(ok=True, seconds=dt, cpu_s=cpu, new_ids=out)
        except BaseException as e:  # noqa: BLE001
            reply(ok=False, error=f"{type(e).__name__}: {e}")
            raise


def quantize_supported(get_model, source: str) -> bool:
    """Whether get_model knows quantize=: a parameter of its own, or a key its own source (`source`) reads
    from its **kwargs (a name it never reads would be swallowed by **kwargs: float32 figures labelled int8)."""
    import inspect
    params = inspect.signature(get_model).parameters
    if "quantize" in params:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return takes_kwargs and ('"quantize"' in source or "'quantize'" in source)


class OursSide:
    def __init__(self, folder: str, dtype: str, threads: int):
        import inspect

        from opt_serving.model import wrapper
        kwargs = {}
        if dtype == "int8":
            # get_model takes **kwargs, so an unknown quantize= would be silently ignored: ask for it only
            # where the code knows it, else say it is missing (the caller prints "not available")
            if not quantize_supported(wrapper.get_model, inspect.getsource(wrapper.get_model)):
                raise NotImplementedError("opt_serving's get_model has no quantize= option yet")
            kwargs["quantize"] = "int8"
        elif dtype != "float32":
            raise ValueError(f"ours: dtype {dtype}")
        self.model = wrapper.get_model("jax/opt-peers", path=folder, dtype="float32", **kwargs)
        self.cfg = self.model.config
        import jax
        self.info = {"jax": jax.__version__, "threads": threads, "quantize": kwargs.get("quantize"),
                     "opt_serving": str(Path(wrapper.__file__).parents[1])}

    def generate(self, ids, new: int):
        import numpy as np
        x = np.asarray(ids, np.int64)
        out = self.model.generate(input_ids=x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=self.cfg.pad_token_id)
        out = np.asarray(getattr(out, "sequences", out))  # waits for JAX's asynchronous dispatch
        return out[:, x.shape[1]:].tolist()


class Ct2Side:
    def __init__(self, folder: str, dtype: str, threads: int):
        import ctranslate2
        self.gen = ctranslate2.Generator(folder, device="cpu", compute_type=dtype, inter_threads=1,
                                         intra_threads=threads)
        vocab = Path(folder) / "vocabulary.json"
        if vocab.exists():
            self.vocab = json.loads(vocab.read_text())
        else:
            self.vocab = (Path(folder) / "vocabulary.txt").read_text().split("\n")
        self.info = {"ctranslate2": ctranslate2.__version__, "compute_type": self.gen.compute_type,
                     "intra_threads": threads, "inter_threads": 1}

    def generate(self, ids, new: int):
        tokens = [[self.vocab[i] for i in row] for row in ids]
        res = self.gen.generate_batch(tokens, max_length=new, min_length=new, sampling_topk=1, beam_size=1,
                                      include_prompt_in_result=False)
        return [r.sequences_ids[0] for r in res]


class HfSide:
    def __init__(self, folder: str, dtype: str, threads: int):
        import torch
        import transformers
        if dtype != "float32":
            raise NotImplementedError("HF PyTorch: float32 only here")
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.OPTForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.pad = self.model.config.pad_token_id
        self.info = {"torch": torch.__version__, "transformers": transformers.__version__,
                     "threads": torch.get_num_threads()}

    def generate(self, ids, new: int):
        torch = self.torch
        x = torch.tensor(ids, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=self.pad)
        return out[:, x.shape[1]:].tolist()


# ================================================================ building and converting

def _build_main(args) -> None:
    """--worker build: a random OPT as a save_pretrained folder (float32 safetensors) + a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from opt_serving.config import get_config
    cfg = get_config(args.size)
    hf_cfg = transformers.OPTConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                       if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(args.seed)
    model = transformers.OPTForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(args.weight_scale)
    out = Path(args.model_dir)
    model.to(torch.float32).save_pretrained(out)
    # ids 0-3 as OPT's tokenizer has them; the rest named by id (CTranslate2 takes tokens as strings)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"tok{i}": i for i in range(len(specials), cfg.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(out)


def _run(cmd: list[str], what: str, env=None) -> float:
    print(f"{what}: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return time.perf_counter() - t0


def _ours_env(args) -> dict:
    """This environment with --ours-src first on PYTHONPATH (ahead of the editable install's finder)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.ours_src, os.environ.get("PYTHONPATH")])))


def _stamp_ok(folder: Path, key: dict) -> bool:
    stamp = folder / ".peers-stamp.json"
    return stamp.exists() and json.loads(stamp.read_text()) == key


def _write_stamp(folder: Path, key: dict) -> None:
    (folder / ".peers-stamp.json").write_text(json.dumps(key))


def _source_key(hf_dir: Path) -> dict:
    files = sorted(p for p in hf_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    return {"source": str(hf_dir.resolve()),
            "files": [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]}


def prepare(args) -> dict:
    """-> {"hf": folder, "ours": numpy folder, "ct2": {dtype: folder}} (built / converted where missing)."""
    import shutil
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.hf_dir:
        hf = Path(args.hf_dir).resolve()
        if not (hf / "config.json").exists():
            raise SystemExit(f"--hf-dir {hf}: no config.json")
        tag = "from-" + hashlib.sha1(str(hf).encode()).hexdigest()[:10]
    else:
        tag = f"{args.size}-seed{args.seed}-x{args.weight_scale:g}"
        hf = work / tag / "hf"
        key = {"size": args.size, "seed": args.seed, "scale": args.weight_scale}
        if args.rebuild or not _stamp_ok(hf, key):
            shutil.rmtree(hf, ignore_errors=True)
            hf.mkdir(parents=True)
            dt = _run([args.ours_python, __file__, "--worker", "build", "--model-dir", str(hf), "--size", args.size,
                       "--seed", str(args.seed), "--weight-scale", str(args.weight_scale)],
                      "building random weights", env=_ours_env(args))
            _write_stamp(hf, key)
            print(f"  built in {dt:.1f} s", flush=True)
    base = work / tag
    src_key = _source_key(hf)
    paths = {"hf": str(hf), "ours": str(base / "numpy-float32"), "ct2": {}}
    ours = Path(paths["ours"])
    if args.rebuild or not _stamp_ok(ours, src_key):
        shutil.rmtree(ours, ignore_errors=True)
        dt = _run([args.ours_python, "-m", "opt_serving", "convert", "--input", str(hf), "--output", str(ours),
                   "--dtype", "float32", "--no-progress", "--overwrite"], "our converter", env=_ours_env(args))
        _write_stamp(ours, src_key)
        print(f"  converted in {dt:.1f} s", flush=True)
    need_ct2 = list(args.dtypes)
    for dtype in need_ct2:
        out = base / f"ct2-{dtype}"
        paths["ct2"][dtype] = str(out)
        if args.rebuild or not _stamp_ok(out, src_key):
            check_peer_python(args.peer_python)
            dt = _run([args.peer_python, "-m", "ctranslate2.converters.transformers", "--model", str(hf),
                       "--output_dir", str(out), "--quantization", dtype, "--force"],
                      f"CTranslate2's converter ({dtype})")
            _write_stamp(out, src_key)
            print(f"  converted in {dt:.1f} s", flush=True)
    return paths


def check_peer_python(peer: str) -> None:
    if not Path(peer).exists():
        raise SystemExit(f"no {peer}: make the CTranslate2 virtualenv first (from {REPO}):\n  {PEER_SETUP}\n"
                         "or give --peer-python an interpreter that has ctranslate2, transformers and torch")
    proc = subprocess.run([peer, "-c", "import ctranslate2"], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{peer} cannot import ctranslate2 ({proc.stderr.strip().splitlines()[-1:]}); "
                         f"install it:\n  {PEER_SETUP}")


# ================================================================ driving the sides

def machine_busy_s() -> float | None:
    """CPU seconds spent by every process on the machine so far (/proc/stat; None where there is none)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def ct2_backend_from_log(text: str) -> str:
    """'ISA AVX2, MKL false, SGEMM DNNL, GEMM_S8 DNNL' from CTranslate2's load log (CT2_VERBOSE=1)."""
    keys = {"Selected ISA": "ISA", "Use Intel MKL": "MKL", "SGEMM backend": "SGEMM", "GEMM_S8 backend": "GEMM_S8"}
    found = {}
    for line in text.splitlines():
        for key, short in keys.items():
            if f" - {key}: " in line:
                found[short] = line.split(f" - {key}: ", 1)[1].split(" (")[0].strip()
    return ", ".join(f"{k} {found[k]}" for k in keys.values() if k in found)


def wait_quiet(cores: float, most_s: float) -> None:
    """Sleep until everything on the machine (the sides are idle now) used less than `cores` over one second."""
    t0 = time.perf_counter()
    while True:
        b0 = machine_busy_s()
        if b0 is None:
            return
        time.sleep(1.0)
        busy = machine_busy_s() - b0
        if busy < cores:
            if time.perf_counter() - t0 > 1.5:
                print(f"  (waited {time.perf_counter() - t0:.0f} s for a quiet machine)", flush=True)
            return
        if time.perf_counter() - t0 > most_s:
            print(f"  (machine still busy after {most_s:g} s: other processes {busy:.2f} cores; going on)",
                  flush=True)
            return


class Unavailable(Exception):
    pass


class Side:
    """One side in its own process, loaded once; `call(ids, new)` -> (seconds, new ids)."""

    def __init__(self, kind: str, python: str, folder: str, dtype: str, args, log_dir: Path):
        self.kind, self.dtype = kind, dtype
        self.name = SIDES[kind]
        self.log_path = log_dir / f"{kind}-{dtype}.log"
        env = _ours_env(args) if kind == "ours" else dict(os.environ)
        if kind == "ours":
            env["OPT_SERVING_CPU_THREADS"] = str(args.threads)
        if kind == "ct2":
            env["CT2_VERBOSE"] = "1"  # it logs the ISA and GEMM backends it picked when it loads (nothing per call)
            env.update(kv.split("=", 1) for kv in args.ct2_env)
        self.log = open(self.log_path, "w")
        cmd = [python, __file__, "--worker", kind, "--model-dir", folder, "--dtype", dtype,
               "--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=args.ours_src if kind == "ours" else str(REPO))
        first = self._reply()
        if not first["ok"]:
            self.close()
            if first.get("unavailable"):
                raise Unavailable(first["error"])
            raise SystemExit(f"{self.name} ({dtype}) failed to load: {first['error']}\n{self._log_tail()}")
        self.load_s, self.info = first["load_s"], first["info"]
        if kind == "ct2":
            self.info["backend"] = self._ct2_backend()
            if args.ct2_env:
                self.info["env"] = list(args.ct2_env)

    def _ct2_backend(self) -> str:
        self.log.flush()
        return ct2_backend_from_log(self.log_path.read_text())

    def _log_tail(self) -> str:
        self.log.flush()
        try:
            return "".join(self.log_path.read_text().splitlines(keepends=True)[-30:])
        except OSError:
            return ""

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise SystemExit(f"{self.name} ({self.dtype}): its process died (exit {self.proc.returncode}); "
                             f"log {self.log_path}:\n{self._log_tail()}")
        return json.loads(line)

    def call(self, ids: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        """-> (seconds, new ids); self.last_cores = (cores this side used, cores everything else used) during it."""
        busy0 = machine_busy_s()
        self.proc.stdin.write(json.dumps({"cmd": "generate", "ids": ids, "new": new}) + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        busy1 = machine_busy_s()
        if not r["ok"]:
            raise SystemExit(f"{self.name} ({self.dtype}): {r['error']}\n{self._log_tail()}")
        out = r["new_ids"]
        if len(out) != len(ids) or any(len(row) != new for row in out):
            raise SystemExit(f"{self.name} ({self.dtype}): expected {len(ids)} rows of exactly {new} new "
                             f"tokens, got lengths {sorted({len(row) for row in out})} in {len(out)} rows")
        own = r.get("cpu_s", 0.0) / r["seconds"]
        others = None if busy0 is None else max(0.0, (busy1 - busy0 - r.get("cpu_s", 0.0)) / r["seconds"])
        self.last_cores = (own, others)
        return r["seconds"], out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


KEEP = ("runs", "seconds", "median", "cores", "others_cores", "disturbed", "bandwidth")


def make_prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed * 1_000_003 + batch * 7919 + length)
    hi = min(vocab_size, 50265)  # ids 4.. skip <s>, <pad>, </s>, <unk>; below OPT's real vocabulary
    return [[rng.randrange(4, hi) for _ in range(length)] for _ in range(batch)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def start_sides(kinds, paths, dtype, args, log_dir) -> dict:
    sides = {}
    for kind in kinds:
        python = args.ours_python if kind in ("ours", "hf") else args.peer_python
        folder = {"ours": paths["ours"], "ct2": paths["ct2"].get(dtype), "hf": paths["hf"]}[kind]
        try:
            sides[kind] = Side(kind, python, folder, dtype, args, log_dir)
            print(f"{SIDES[kind]} {dtype}: loaded in {sides[kind].load_s:.2f} s {sides[kind].info}", flush=True)
        except Unavailable as e:
            print(f"{kind} {dtype}: not available ({e})", flush=True)  # "ours int8: not available (...)"
    return sides


def measure(sides: dict, ids, new: int, args, label: str, unit_tokens: int, bandwidth: bool = False) -> dict:
    """Warm-up calls per side, then `reps` rounds ABAB...; -> {kind: {"runs": [tokens/s], "out": last output}}.
    `bandwidth`: the read bandwidth before each round as well ({kind: {"bandwidth": [GB/s]}}), for a batch-1 row's
    bound: it moves too much between minutes here for one reading to stand for a row's runs."""
    res = {k: {"runs": [], "seconds": [], "cores": [], "others_cores": [], "out": None} for k in sides}
    for kind, side in sides.items():
        for i in range(args.warmup):
            dt, res[kind]["out"] = side.call(ids, new)
            print(f"  {label} {side.name}: warm-up {i + 1}/{args.warmup}: {dt:.3f} s", flush=True)
    readings = []
    for rep in range(args.reps):
        if bandwidth:
            readings.append(read_bandwidth_gbs(args.threads, reps=3))
            print(f"  {label}: read bandwidth {readings[-1]:.1f} GB/s", flush=True)
        for kind, side in sides.items():
            time.sleep(args.pause)
            if args.wait_quiet is not None:
                wait_quiet(args.wait_quiet, args.wait_max)
            dt, res[kind]["out"] = side.call(ids, new)
            own, others = side.last_cores
            res[kind]["seconds"].append(dt)
            res[kind]["runs"].append(unit_tokens / dt)
            res[kind]["cores"].append(own)
            res[kind]["others_cores"].append(others)
            busy = "" if others is None else f" (it used {own:.2f} cores, all other processes {others:.2f})"
            print(f"  {label} {side.name}: run {rep + 1}/{args.reps}: {dt:.3f} s, {unit_tokens / dt:.1f} tokens/s"
                  f"{busy}", flush=True)
    for r in res.values():
        limit = args.disturbed
        r["disturbed"] = [x is not None and x > limit for x in r["others_cores"]]
        clean = [v for v, d in zip(r["runs"], r["disturbed"]) if not d]
        r["median"] = statistics.median(clean or r["runs"]) if r["runs"] else None
        r["bandwidth"] = readings
    return res


# ================================================================ reporting

def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        name = info.get("Model name", "").strip()
    except OSError:
        name = ""
    if not name:
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    name = name or platform.processor() or "unknown CPU"
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    shown = [label for flag, label in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512_BF16"),
                                       ("avx512_vnni", "AVX512_VNNI"), ("amx_tile", "AMX"))
             if flag in flags] or [label for flag, label in (("avx2", "AVX2"),) if flag in flags]
    return f"{name} ({', '.join(shown)})" if shown else name


def _git_rev(src: str) -> str:
    if not (Path(src) / ".git").exists():
        return f"the tree at {src}"
    try:
        rev = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+local changes" if dirty else "")
    except OSError:
        return "?"


def _fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"**{a / b:.2f}x**"


def header(args, infos: dict) -> str:
    ct2_info = next((i for i in infos.values() if "ctranslate2" in i), {})
    ct2 = ct2_info.get("ctranslate2", "?")
    ct2_extra = "; ".join(filter(None, [ct2_info.get("backend"), " ".join(ct2_info.get("env", []))]))
    hf_info = next((i for i in infos.values() if "transformers" in i), None)
    hf_text = (f"HF PyTorch: transformers {hf_info['transformers']}, torch {hf_info['torch']}, "
               f"{hf_info['threads']} threads. ") if hf_info else ""
    order = ", ".join(["ours", "CTranslate2"] + (["HF"] if hf_info else []))
    model = f"{args.size} shape, random weights (seed {args.seed}, 2-D weights x{args.weight_scale:g})" \
        if not args.hf_dir else f"weights from {args.hf_dir}"
    return (f"{cpu_model()}, {default_threads()} CPUs, {platform.system()} {platform.machine()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {model}. Ours: code {_git_rev(args.ours_src)}, "
            f"{args.threads} threads; CTranslate2 {ct2} ({ct2_extra + '; ' if ct2_extra else ''}inter_threads 1, "
            f"intra_threads {args.threads}). "
            f"{hf_text}Each side in its own process, {args.warmup} warm-up call(s), then {args.reps} timed calls "
            f"each, interleaved ({order}, ...), {args.pause:g} s rest before each"
            + (f", each started once other processes used < {args.wait_quiet:g} cores" if args.wait_quiet is not None
               else "") + ".")


def _runs(side: dict, digits: int) -> str:
    """'620.0, 75.1*, 640.0': a star on the calls other processes disturbed (left out of the median)."""
    marks = side.get("disturbed") or [False] * len(side["runs"])
    return ", ".join(f"{x:.{digits}f}{'*' if d else ''}" for x, d in zip(side["runs"], marks))


def generation_table(rows: list[dict]) -> str:
    lines = ["| dtype | batch | ours tokens/s (runs) | CT2 tokens/s (runs) | ours median | CT2 median | ours / CT2 "
             "| ours ms/token | CT2 ms/token | ours = CT2 tokens | vs own float32 (ours / CT2) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        o, c = r.get("ours"), r.get("ct2")
        runs = lambda s: _runs(s, 1) if s else "not available"  # noqa: E731
        ms = lambda s: _fmt(1e3 / s["median"] * r["batch"]) if s else "-"  # noqa: E731  (per step, whole batch)
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        vs = r.get("vs_float32", {})
        own = "-" if not vs else f"{pct(vs.get('ours'))} / {pct(vs.get('ct2'))}"
        lines.append(f"| {r['dtype']} | {r['batch']} | {runs(o)} | {runs(c)} | {_fmt(o and o['median'])} "
                     f"| {_fmt(c and c['median'])} | {_ratio(o and o['median'], c and c['median'])} "
                     f"| {ms(o)} | {ms(c)} | {pct(r.get('agree'))} | {own} |")
    return "\n".join(lines)


def prefill_table(rows: list[dict]) -> str:
    lines = ["| dtype | prompt | ours prompt tokens/s (runs) | CT2 (runs) | HF (runs) | ours median | CT2 median "
             "| HF median | ours / CT2 | ours / HF | ours TTFT ms |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        o, c, h = r.get("ours"), r.get("ct2"), r.get("hf")
        runs = lambda s, none="not available": _runs(s, 0) if s else none  # noqa: E731
        med = lambda s: s and s["median"]  # noqa: E731
        ttft = _fmt(1e3 * r["prompt"] / o["median"]) if o else "-"
        hf_none = "not available" if r["dtype"] == "float32" else "-"  # HF runs float32 only here
        lines.append(f"| {r['dtype']} | {r['prompt']} | {runs(o)} | {runs(c)} | {runs(h, hf_none)} | {_fmt(med(o), 0)} "
                     f"| {_fmt(med(c), 0)} | {_fmt(med(h), 0)} | {_ratio(med(o), med(c))} | {_ratio(med(o), med(h))} "
                     f"| {ttft} |")
    return "\n".join(lines)


def read_bandwidth_gbs(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """This machine's memory read bandwidth (GB/s), what a decode step at batch 1 is bound by: machine_bounds.py's
    reading (imported here, not at the top: the peers' runner processes never need it)."""
    from machine_bounds import read_bandwidth_gbs as read
    return read(threads, gib, reps)


def weight_bytes_per_token(cfg: dict, dtype: str) -> float:
    """Bytes of weights a batch-1 decode step must read once: every layer's four matrices and the output head
    (the tied embedding) at `dtype`'s width (int8: one byte, its per-channel scales left out)."""
    d, f, n = cfg["hidden_size"], cfg["ffn_dim"], cfg["num_hidden_layers"]
    width = {"int8": 1, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    return (n * (4 * d * d + 2 * d * f) + cfg["vocab_size"] * cfg.get("word_embed_proj_dim", d)) * width


def bandwidth_lines(rows: list[dict], cfg: dict, threads: int) -> list[str]:
    """The batch-1 rows against the limit set by reading the weights once per token at the measured bandwidth."""
    ones = [r for r in rows if r.get("batch") == 1]
    if not ones:
        return []
    out = [f"Batch 1 against reading the weights once a token at this machine's read bandwidth ({threads} threads; "
           "the median of the readings taken between the row's rounds of runs):"]
    for r in ones:
        readings = next((r[k]["bandwidth"] for k in SIDES if r.get(k) and r[k].get("bandwidth")), None)
        if not readings:  # no side ran this row
            continue
        bw = statistics.median(readings)
        out.append(f"  {r['dtype']}: read bandwidth {bw:.1f} GB/s (readings "
                   f"{', '.join(f'{x:.1f}' for x in readings)})")
        limit = bw * 1e9 / weight_bytes_per_token(cfg, r["dtype"])
        sides = ", ".join(f"{SIDES[k]} {r[k]['median']:.1f} ({r[k]['median'] / limit:.0%})"
                          for k in SIDES if r.get(k) and r[k]["median"])
        out.append(f"  {r['dtype']}: {weight_bytes_per_token(cfg, r['dtype']) / 1e9:.2f} GB a token -> at most "
                   f"{limit:.1f} tokens/s; {sides}")
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker == "build":
        _build_main(args)
        return {}
    if args.worker:
        _worker_main(args)
        return {}
    t_start = time.perf_counter()
    check_peer_python(args.peer_python)
    paths = prepare(args)
    cfg = json.loads((Path(paths["hf"]) / "config.json").read_text())
    vocab_size = cfg["vocab_size"]
    longest = max(args.prefill) + 1 if args.prefill else args.prompt_len + args.gen_len
    if longest > cfg.get("max_position_embeddings", longest):
        raise SystemExit(f"prompt + new tokens ({longest}) exceed the model's {cfg['max_position_embeddings']} "
                         "positions")
    log_dir = Path(args.work_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows, infos = [], {}
    float32_out = {}  # (side, batch) -> new ids at float32: int8's reference
    kinds = ["ours", "ct2", "hf"] if args.prefill else ["ours", "ct2"]
    for dtype in args.dtypes:
        sides = start_sides([k for k in kinds if not (k == "hf" and dtype != "float32")], paths, dtype, args,
                            log_dir)
        infos.update({f"{k}-{dtype}": s.info for k, s in sides.items()})
        try:
            if args.prefill:
                for n in args.prefill:
                    ids = make_prompts(1, n, vocab_size, args.seed)
                    res = measure(sides, ids, 1, args, f"{dtype} prefill {n}", unit_tokens=n)
                    rows.append({"dtype": dtype, "prompt": n, **{k: {kk: v[kk] for kk in KEEP}
                                                                 for k, v in res.items()}})
            else:
                for b in args.batch_sizes:
                    ids = make_prompts(b, args.prompt_len, vocab_size, args.seed)
                    res = measure(sides, ids, args.gen_len, args, f"{dtype} batch {b}", unit_tokens=b * args.gen_len,
                                  bandwidth=b == 1)
                    row = {"dtype": dtype, "batch": b,
                           **{k: {kk: v[kk] for kk in KEEP} for k, v in res.items()}}
                    if "ours" in res and "ct2" in res:
                        row["agree"] = agreement(res["ours"]["out"], res["ct2"]["out"])
                    for k, v in res.items():
                        if dtype == "float32":
                            float32_out[k, b] = v["out"]
                        elif (k, b) in float32_out:
                            row.setdefault("vs_float32", {})[k] = agreement(v["out"], float32_out[k, b])
                    rows.append(row)
                    o, c = row.get("ours"), row.get("ct2")
                    vs = row.get("vs_float32", {})
                    print(f"{dtype} batch {b}: ours {_fmt(o and o['median'])}, CT2 {_fmt(c and c['median'])} "
                          f"tokens/s (median), ours / CT2 {_ratio(o and o['median'], c and c['median'])}"
                          + (f", tokens agree {row['agree']:.0%}" if "agree" in row else "")
                          + "".join(f", {SIDES[k]} against its float32 {x:.0%}" for k, x in vs.items()),
                          flush=True)
        finally:
            for s in sides.values():
                s.close()
    total = time.perf_counter() - t_start
    print()
    print(header(args, infos))
    if args.prefill:
        print("Prefill: one prompt, 1 new token (time to first token); prompt tokens / latency.")
        print()
        print(prefill_table(rows))
    else:
        print(f"Greedy, prompt {args.prompt_len}, exactly {args.gen_len} new tokens per row; tokens/s = batch x "
              f"{args.gen_len} / latency; ms/token = latency / {args.gen_len} steps.")
        print()
        print(generation_table(rows))
        for line in bandwidth_lines(rows, cfg, args.threads):
            print(line)
    others = [x for r in rows for k in SIDES if r.get(k) for x in r[k]["others_cores"] if x is not None]
    if others:
        starred = sum(x > args.disturbed for x in others)
        print(f"\nOther processes' CPU during the timed calls: median {statistics.median(others):.2f} cores, "
              f"max {max(others):.2f} (of {default_threads()}; per call in the log above)."
              + (f" * {starred} call(s) during which they used more than {args.disturbed:g} cores: left out of "
                 "the medians." if starred else ""))
    print(f"(whole run {total:.0f} s)")
    summary = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_model(), "args": {
        k: v for k, v in vars(args).items() if k not in ("worker", "model_dir", "dtype")}, "paths": paths,
        "sides": infos, "mode": "prefill" if args.prefill else "generation", "rows": rows, "total_s": total}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()

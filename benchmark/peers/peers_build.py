"""benchmark_peers.py's weights: one Hugging Face folder of random weights (or --hf-dir's), converted by our
converter and by CTranslate2's; everything kept in --work-dir and reused while its stamp matches."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("peers_worker.py")  # the side processes and the builder
PEER_SETUP = ("bash benchmark/peers/setup_peers.sh   (that is: python3.11 -m venv .venv-peers && "
              ".venv-peers/bin/pip install torch==2.13.0 && .venv-peers/bin/pip install -r requirements-peers.txt)")


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
            dt = _run([args.ours_python, str(WORKER), "build", "--model-dir", str(hf), "--size", args.size,
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

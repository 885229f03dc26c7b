"""benchmark/'s layout (issue 53): scripts in folders by what they measure, each run by its path. Every script with
an argparse main prints its --help from where it lies (all of them in one interpreter, so JAX and the rest load
once), none imports a helper by a bare name from its own folder, and no file there is over 450 lines."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmark"
MAX_LINES = 450

# runs each script as `python benchmark/FOLDER/SCRIPT.py --help` would, one after another in this interpreter
HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [path, "--help"]
    code = "returned"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # noqa: BLE001 - reported per script
            code = f"{type(e).__name__}: {e}"
    results[path] = {"code": code, "usage": "usage:" in out.getvalue(), "err": err.getvalue()[-1500:]}
print("RESULTS " + json.dumps(results))
"""


def python_files() -> list[Path]:
    return sorted(BENCH.rglob("*.py"))


def argparse_scripts() -> list[Path]:
    return [p for p in python_files()
            if "ArgumentParser(" in (t := p.read_text()) and re.search(r"^if __name__ == .__main__.:", t, re.M)]


def test_every_argparse_script_prints_its_help_from_its_folder():
    scripts = argparse_scripts()
    assert len(scripts) >= 25, scripts  # the folders hold them: the glob found them all
    r = subprocess.run([sys.executable, "-c", HELP_RUNNER, *map(str, scripts)], capture_output=True, text=True,
                       cwd=ROOT / "docs", timeout=600)  # not the checkout's root: each script finds it itself
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line, r.stdout[-2000:] + r.stderr[-3000:]
    results = json.loads(line[len("RESULTS "):])
    bad = {Path(k).relative_to(ROOT).as_posix(): v for k, v in results.items()
           if v["code"] not in (0, None) or not v["usage"]}
    assert not bad, json.dumps(bad, indent=1)


def test_no_file_in_benchmark_is_over_450_lines_and_each_compiles():
    long = {p.relative_to(ROOT).as_posix(): n for p in python_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
    for p in python_files():  # the few without an argparse main (they measure as they start) at least compile
        compile(p.read_text(), str(p), "exec")


def test_helpers_are_imported_through_the_benchmark_package():
    """`from benchmark.common import ...`, never `import common` from a script's own folder (which works only for
    the scripts beside it)."""
    bare = re.compile(r"^\s*(import|from)\s+(common|harness|machine_bounds|plots|benchmark_\w+|bench_\w+|gpu_check\w*"
                      r"|peers_\w+)\b", re.M)
    found = {p.relative_to(ROOT).as_posix(): m.group(0).strip() for p in python_files()
             if (m := bare.search(p.read_text()))}
    assert not found, found


def test_the_gpu_check_script_calls_files_that_exist():
    text = (BENCH / "gpu_check.sh").read_text()
    called = set(re.findall(r"benchmark/[\w/]+\.py", text))
    assert called and all((ROOT / c).exists() for c in called), called

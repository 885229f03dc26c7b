"""settings.Settings: every OPT_SERVING_* switch read in one place, with docs/operating.md's names and defaults."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opt_serving.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_settings_come_from_the_environment(monkeypatch):
    assert Settings.from_env({}) == Settings()
    env = {"OPT_SERVING_ONEDNN": "0", "OPT_SERVING_BF16_SCREEN": "0", "OPT_SERVING_CPU_THREADS": "3",
           "OPT_SERVING_NO_CEXT": "1", "OPT_SERVING_BF16_FMA_ROWS": "16"}
    assert Settings.from_env(env) == Settings(kernels=False, bf16_screen=False, cpu_threads=3,
                                              cext=False, bf16_fma_rows=16)
    assert Settings.from_env({"OPT_SERVING_BF16_FMA_ROWS": "0"}).bf16_fma_rows == 0  # never
    assert Settings.from_env({"OPT_SERVING_S8_VNNI_ROWS": "0"}).s8_vnni_rows == 0  # oneDNN's kernel always
    assert Settings.from_env({"OPT_SERVING_S8_VNNI_ROWS": "4"}).s8_vnni_rows == 4
    assert Settings.from_env({"OPT_SERVING_F32_TILE_ROWS": "0"}).f32_tile_rows == 0  # oneDNN's kernel always
    assert Settings.from_env({}).f32_tile_rows is None
    monkeypatch.setenv("OPT_SERVING_BF16_SCREEN", "0")
    assert not Settings.from_env().bf16_screen


def test_the_switches_read_outside_the_backend():
    defaults = Settings.from_env({})
    assert (defaults.keep_heap, defaults.compile_cache, defaults.cache_dir, defaults.api_keys) == (True, "", None, ())
    assert (defaults.pin_threads, defaults.avx512, defaults.amx) == (True, True, True)
    s = Settings.from_env({"OPT_SERVING_KEEP_HEAP": "0", "OPT_SERVING_COMPILE_CACHE": " /tmp/xla ",
                           "OPT_SERVING_CACHE": "/tmp/c", "OPT_SERVING_API_KEYS": "a,,b",
                           "OPT_SERVING_PIN_THREADS": "0", "OPT_SERVING_NO_AVX512": "",
                           "OPT_SERVING_NO_AMX": ""})
    assert (s.keep_heap, s.compile_cache, s.cache_dir, s.api_keys) == (False, "/tmp/xla", Path("/tmp/c"), ("a", "b"))
    assert (s.pin_threads, s.avx512, s.amx) == (False, False, False)  # NO_AVX512, NO_AMX: any value (the C++)
    for off in ("0", "off", "OFF", "false", "none"):
        assert Settings.from_env({"OPT_SERVING_COMPILE_CACHE": off}).compile_cache is None


def test_the_readers_follow_the_settings(monkeypatch, tmp_path):
    from opt_serving.model import embedded
    from opt_serving.backend.cpu import heap
    monkeypatch.setenv("OPT_SERVING_CACHE", str(tmp_path))
    assert embedded.default_cache_dir() == tmp_path
    assert not heap.wanted({"OPT_SERVING_KEEP_HEAP": "0"}) and heap.wanted({})


def _variables() -> set[str]:
    doc = Settings.__doc__
    return set(re.findall(r"OPT_SERVING_[A-Z0-9_]+", doc))


def test_every_switch_is_a_field_and_in_the_docs():
    variables = _variables()
    assert len(variables) == len(Settings.__dataclass_fields__) == 14
    page = (ROOT / "docs" / "operating.md").read_text()
    table = page[page.index("## Environment switches"):]
    table = table[:table.index("\n## ")] if "\n## " in table else table
    assert {v for v in variables if f"`{v}" not in table} == set()


def _reads(tree: ast.AST):
    """`OPT_SERVING_*` names a module reads from the environment: env.get("X"), os.getenv("X"), env["X"],
    "X" in env."""
    def named(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("OPT_SERVING_")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in ("get", "getenv", "pop", "setdefault") and named(node.args[0]):
                yield node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and named(node.slice):
            yield node.slice.value
        elif isinstance(node, ast.Compare) and named(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            yield node.left.value


def test_no_module_reads_a_switch_but_settings():
    readers = {}
    for path in sorted((ROOT / "opt_serving").rglob("*.py")):
        if path.name == "settings.py" and path.parent.name == "opt_serving" or "testing" in path.parts:
            continue
        found = sorted(set(_reads(ast.parse(path.read_text()))))
        if found:
            readers[str(path.relative_to(ROOT))] = found
    assert readers == {}


_SPIN_CHILD = """
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
if sys.argv[1] == "torch first":
    import torch
import opt_serving
import torch
from opt_serving.backend.cpu import _lib
from opt_serving.settings import libgomp_loaded, spin_in_time
print("spin", os.environ.get("GOMP_SPINCOUNT"), spin_in_time, libgomp_loaded())
_lib.load()
"""


def _spin_child(order: str, **env: str) -> str:
    child_env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | env
    out = subprocess.run([sys.executable, "-c", _SPIN_CHILD, order], env=child_env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_kernels_spin_is_set_before_torch_loads_its_libgomp():
    pytest.importorskip("torch")
    # opt_serving first: the setting is in the environment before torch's libgomp reads it
    out = _spin_child("opt_serving first")
    assert "spin 30000 True True" in out and "start Python with" not in out
    # torch first: its libgomp read no setting; loading the kernels says so, naming the variable
    out = _spin_child("torch first")
    assert "spin 30000 False True" in out and "start Python with GOMP_SPINCOUNT=30000" in out
    # the user's own setting is kept, whatever loaded first
    out = _spin_child("torch first", GOMP_SPINCOUNT="5000")
    assert "spin 5000 True True" in out and "start Python with" not in out

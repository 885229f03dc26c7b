"""spec.ModelSpec: a model's name and options parsed once, at the edge; nothing else reads a name's prefix."""
import ast
from pathlib import Path

import pytest

from opt_serving.spec import EMBEDDED_NAMES, JAX, PARALLEL, PREFIXES, TORCH, ModelSpec, Weights, is_parallel

ROOT = Path(__file__).resolve().parents[1]


def test_each_prefix_names_its_backend():
    assert ModelSpec.parse("jax/opt-125m", "/w").backend == JAX
    assert ModelSpec.parse("facebook/opt-iml-max-30b", dummy=True).backend == TORCH
    spec = ModelSpec.parse("alpa/opt-2.7b", "/data", tensor_parallel=2, quantize="int8")
    assert (spec.backend, spec.parallel, spec.size, spec.label) == (PARALLEL, True, "2.7b", "opt-2.7b")
    assert spec.plan() == {"tensor_parallel": 2, "pipeline_parallel": None} and spec.quantize == "int8"
    assert spec.weights == Weights(folder=Path("/data")) and not spec.weights.random


def test_random_weights_carry_their_seed():
    spec = ModelSpec.parse("jax/opt-tiny", dummy=True, seed=7)
    assert spec.weights == Weights(seed=7) and spec.weights.random and spec.family == "opt"
    assert ModelSpec.parse("jax/opt-tiny", dummy=True).weights.seed == 0  # dummy with the default seed is random


def test_the_engine_runs_facebook_weights_on_the_flax_model():
    spec = ModelSpec.parse("facebook/opt-125m", "/w")
    assert spec.for_engine().backend == JAX and spec.for_engine().name == spec.name
    jax_spec = ModelSpec.parse("jax/opt-125m", "/w")
    assert jax_spec.for_engine() is jax_spec


def test_bad_names_and_options_are_refused_naming_the_problem(tmp_path):
    with pytest.raises(ValueError, match="must start with one of jax/, facebook/, alpa/"):
        ModelSpec.parse("opt-125m", "/w")
    with pytest.raises(ValueError, match="known sizes"):
        ModelSpec.parse("jax/opt-7b", dummy=True)
    with pytest.raises(ValueError, match=f"{tmp_path} has none"):
        ModelSpec.parse("jax/my-finetune", tmp_path)
    with pytest.raises(ValueError, match="runs on one device; use alpa/"):
        ModelSpec.parse("jax/opt-125m", "/w", tensor_parallel=2)
    (tmp_path / "config.json").write_text("{}")
    assert ModelSpec.parse("jax/my-finetune", tmp_path).size is None  # a label for the folder's own config


def test_the_edge_checks_and_the_names_of_the_embedded_model():
    assert is_parallel("alpa/opt-30b") and not is_parallel("jax/opt-30b") and not is_parallel(None)
    assert "jax/opt-tiny" in EMBEDDED_NAMES and "tiny" in EMBEDDED_NAMES


def test_get_model_refuses_what_the_reference_cannot_do():
    from opt_serving.model.wrapper import get_model  # Alpa's import path still finds it
    from opt_serving import models
    assert get_model is models.get_model
    with pytest.raises(ValueError, match="facebook/ is Hugging Face's PyTorch model"):
        get_model("facebook/opt-tiny", dummy=True, quantize="int8")


def _prefix_constants(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in PREFIXES]


def test_only_the_spec_reads_a_name_prefix():
    """No module but spec.py holds "jax/", "facebook/" or "alpa/" as a value (to compare a name with)."""
    found = {}
    for path in sorted((ROOT / "opt_serving").rglob("*.py")):
        if path == ROOT / "opt_serving" / "spec.py":
            continue
        hits = _prefix_constants(ast.parse(path.read_text()))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}
    assert _prefix_constants(ast.parse((ROOT / "opt_serving" / "spec.py").read_text()))  # the check sees them

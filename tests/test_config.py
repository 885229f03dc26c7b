"""Model names -> configs: the presets (OPT and OPT-IML), and a folder's own config.json for any name."""
from pathlib import Path

import numpy as np
import pytest

from opt_serving.config import OPT_CONFIGS, OPTConfig, config_for, get_config, size_from_name


@pytest.mark.parametrize("name, base", [
    ("facebook/opt-iml-1.3b", "1.3b"), ("jax/opt-iml-max-1.3b", "1.3b"),
    ("alpa/opt-iml-30b", "30b"), ("facebook/opt-iml-max-30b", "30b"),
])
def test_opt_iml_presets_are_the_architectures_they_were_tuned_from(name, base):
    assert size_from_name(name) == name.split("opt-", 1)[1]
    assert get_config(name) == OPT_CONFIGS[base]


def test_any_name_works_with_a_folder_that_has_config_json(tmp_path):
    own = OPT_CONFIGS["tiny"].replace(num_hidden_layers=3)
    own.save_hf_json(tmp_path)
    assert config_for("jax/my-finetune", tmp_path) == own
    assert config_for("jax/opt-125m", tmp_path) == own  # the folder's config wins; the name is a label
    assert config_for("jax/opt-125m", tmp_path / "elsewhere") == OPT_CONFIGS["125m"]
    with pytest.raises(ValueError, match="unknown OPT model 'jax/my-finetune'.*opt-iml-max-30b"):
        config_for("jax/my-finetune", tmp_path / "elsewhere")
    assert isinstance(own, OPTConfig)


@pytest.mark.parametrize("cfg", list(OPT_CONFIGS.values()) + [
    OPT_CONFIGS["tiny"].replace(word_embed_proj_dim=64, do_layer_norm_before=False),
], ids=list(OPT_CONFIGS) + ["tiny-post-ln-projected"])
def test_num_params_counts_the_numpy_folder_tensors(cfg):
    from opt_serving.model.weights import param_shapes
    assert cfg.num_params() == sum(int(np.prod(s)) for s in param_shapes(cfg).values())


def test_config_imports_nothing_of_ours():
    """config is the bottom layer (issue 20): every other module may import it, it imports none."""
    import ast
    import opt_serving.config as config
    tree = ast.parse(Path(config.__file__).read_text())
    ours = [n for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("opt_serving"))
            or isinstance(n, ast.Import) and any(a.name.startswith("opt_serving") for a in n.names)]
    assert not ours, [ast.unparse(n) for n in ours]

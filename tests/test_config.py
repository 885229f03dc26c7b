"""Model names -> configs: the presets (OPT and OPT-IML), and a folder's own config.json for any name."""
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

"""The shipped deployment configs agree: deploy/kuberay-rayservice.yaml's serveConfigV2 runs serve_config.yaml's
applications (on 0.0.0.0:8000, where KubeRay's serve Service sends traffic) with the Ray version requirements.txt
pins, and both are configs Ray Serve accepts with builder arguments the application builder knows; the builder's
speculative_config is checked when its arguments are made, as serve_config.yaml's example gives it."""
import json
import re
from pathlib import Path

import pytest
import yaml

from opt_serving.config import SpeculativeConfig
from opt_serving.service.deployment import ServeArgs, check_model_args

from conftest import BAD_SPECULATIVE_CONFIGS, NGRAM

REPO = Path(__file__).resolve().parents[1]


def _configs() -> tuple[dict, dict, dict]:
    """(serve_config.yaml, the RayService, its serveConfigV2)."""
    serve_config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    service = yaml.safe_load((REPO / "deploy" / "kuberay-rayservice.yaml").read_text())
    return serve_config, service, yaml.safe_load(service["spec"]["serveConfigV2"])


def test_the_rayservice_runs_serve_configs_applications_on_every_node():
    serve_config, service, v2 = _configs()
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    assert v2["applications"] == serve_config["applications"]
    assert v2["http_options"] == {**serve_config["http_options"], "host": "0.0.0.0", "port": 8000}
    assert v2["proxy_location"] == "EveryNode"


def test_the_rayservice_uses_the_pinned_ray():
    _, service, _ = _configs()
    pinned = re.search(r"^ray\[serve\]==([\d.]+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == pinned
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    images = [c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]]
    assert images and all(image.endswith(":" + pinned) for image in images)
    assert all(any(p["containerPort"] == 8000 for p in c.get("ports", []))
               for pod in pods for c in pod["template"]["spec"]["containers"])


@pytest.mark.parametrize("which", ["serve_config.yaml", "serveConfigV2"])
def test_ray_serve_and_the_builder_accept_the_config(which):
    schema = pytest.importorskip("ray.serve.schema")
    serve_config, _, v2 = _configs()
    config = serve_config if which == "serve_config.yaml" else v2
    schema.ServeDeploySchema.parse_obj(config)  # what `serve deploy` and KubeRay submit
    for app in config["applications"]:
        ServeArgs(**app["args"])  # an argument the builder does not know would fail the deployment


def test_the_speculative_config_example_in_serve_config_is_accepted():
    """serve_config.yaml's commented `speculative_config` line, uncommented, is YAML the builder takes: the
    config it names is served prompt lookup."""
    lines = [line for line in (REPO / "serve_config.yaml").read_text().splitlines()
             if line.strip().startswith("# speculative_config:")]
    assert len(lines) == 1, lines
    example = yaml.safe_load(lines[0].replace("# ", "", 1).strip())
    args = ServeArgs(**example)
    assert args.speculative() == SpeculativeConfig(**example["speculative_config"])


@pytest.mark.parametrize("given", [NGRAM, json.dumps(NGRAM)], ids=["yaml-mapping", "json-string"])
def test_speculative_config_as_a_mapping_or_json(given):
    """A mapping (serve_config.yaml) or its JSON (`serve run ... speculative_config='{...}'`) becomes the config's
    dict, every key spelt out, which the replica's own ServeArgs (made from model_dump()) takes again."""
    args = ServeArgs(speculative_config=given)
    want = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                       "prompt_lookup_min": 1}
    assert args.speculative() == want and ServeArgs(**args.model_dump()).speculative() == want
    check_model_args(args)  # (the embedded model speculates)


def test_a_draft_model_s_speculative_config_goes_to_the_replica_as_its_own_keys():
    """A draft model's config spells out the keys its method reads (not prompt lookup's), and the replica's
    ServeArgs takes it back as the same config."""
    given = {"model": "jax/opt-125m", "path": "/data/opt-125m-np", "num_speculative_tokens": 3}
    args = ServeArgs(speculative_config=json.dumps(given))
    assert args.speculative_config == {"method": "draft_model", **given}
    want = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="jax/opt-125m",
                             path="/data/opt-125m-np")
    assert args.speculative() == want and ServeArgs(**args.model_dump()).speculative() == want


@pytest.mark.parametrize("off", [None, "", "  ", {}, "{}"])
def test_speculative_config_left_out_or_empty_is_off(off):
    args = ServeArgs(speculative_config=off)
    assert args.speculative_config is None and args.speculative() is None
    assert ServeArgs().speculative() is None


@pytest.mark.parametrize("value, message", BAD_SPECULATIVE_CONFIGS.values(), ids=BAD_SPECULATIVE_CONFIGS.keys())
def test_a_bad_speculative_config_is_refused_naming_the_argument(value, message):
    """The JSON the flag takes, and where it is an object the mapping serve_config.yaml would give, are refused
    when the builder's arguments are made (before anything loads), the error naming speculative_config and the
    problem."""
    givens = [value]
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, (dict, list)):
        givens.append(parsed)
    for given in givens:
        with pytest.raises(ValueError, match="speculative_config") as refused:
            ServeArgs(speculative_config=given)
        assert message in str(refused.value), (given, str(refused.value))


def test_the_fake_engine_takes_no_speculative_config():
    with pytest.raises(ValueError, match="does not speculate"):
        check_model_args(ServeArgs(engine="fake", speculative_config=NGRAM))
    check_model_args(ServeArgs(engine="fake", speculative_config={}))  # empty: off

"""The shipped deployment configs agree: deploy/kuberay-rayservice.yaml's serveConfigV2 runs serve_config.yaml's
applications (on 0.0.0.0:8000, where KubeRay's serve Service sends traffic) with the Ray version requirements.txt
pins, and both are configs Ray Serve accepts with builder arguments the application builder knows."""
import re
from pathlib import Path

import pytest
import yaml

from opt_serving.service.deployment import ServeArgs

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

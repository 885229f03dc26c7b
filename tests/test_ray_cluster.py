"""Tests never join a Ray cluster they did not start: under the suite's guard (conftest.py,
testing/ray_cluster.no_foreign_clusters) Ray's discovery finds none, whatever else runs on the machine, so
ray.init() starts a Ray of its own and the alpa/ backend's ray.init(address="auto") finds nothing to join."""
import pytest

services = pytest.importorskip("ray._private.services")


def test_ray_finds_no_cluster_to_join(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a foreign setting is dropped too
    from opt_serving.testing.ray_cluster import no_foreign_clusters
    assert no_foreign_clusters()
    assert services.get_ray_address_from_environment(None, None) is None  # ray.init(): start our own
    with pytest.raises(ConnectionError):
        services.get_ray_address_from_environment("auto", None)  # "auto": nothing to join


def test_the_alpa_backend_joins_no_running_cluster():
    from opt_serving.parallel.backend import connect_ray
    assert connect_ray(start=False) is None  # plans for this process's devices, not another's Ray

"""Cluster descriptions: the text syntax, local JAX devices, a Ray cluster, calibration."""
import sys
import types

import pytest

from opt_serving.parallel.cluster import (DEVICE_SPECS, GB, GiB, calibrate, cluster_from_jax,
                                          cluster_from_ray, parse_bandwidth, parse_bytes,
                                          parse_cluster)


def test_parse_plain():
    c = parse_cluster("4x8x16GB")
    assert (c.num_nodes, c.devices_per_node, c.num_devices) == (4, 8, 32)
    assert c.device_memory == 16 * GB
    assert c.total_memory == 32 * 16 * GB
    assert c.spec.kind == "v100"          # guessed from 16 GB
    assert [c.node_of(d) for d in (0, 7, 8, 31)] == [0, 0, 1, 3]


def test_parse_options_and_units():
    c = parse_cluster(" 2 x 4 x 40GiB : a100 @ ib=200Gbps, nvlink=300GBps, flops=100TFLOPS, hbm=1.5TB/s")
    assert c.device_memory == 40 * GiB
    assert c.spec.kind == "a100"
    assert c.inter_bw == pytest.approx(200e9 / 8)       # bits
    assert c.spec.intra_bw == pytest.approx(300e9)      # bytes
    assert c.spec.flops == pytest.approx(100e12)
    assert c.spec.mem_bw == pytest.approx(1.5e12)


def test_units():
    assert parse_bytes("512MiB") == 512 * 2 ** 20
    assert parse_bandwidth("10Gb/s") == pytest.approx(10e9 / 8)
    assert parse_bandwidth("10GB/s") == pytest.approx(10e9)


@pytest.mark.parametrize("text, words", [
    ("4x8", "NODESxDEVICESxMEMORY"),
    ("4x8x16", "memory size"),
    ("0x8x16GB", "at least one node"),
    ("4x8x16GB@warp=9", "unknown cluster option 'warp'"),
    ("4x8x16GB@ib", "not key=value"),
    ("4x8x16GB@ib=fast", "bandwidth"),
    ("4x8x16GB:tpu9", "unknown device kind 'tpu9'"),
])
def test_bad_text_names_the_problem(text, words):
    with pytest.raises(ValueError, match=words):
        parse_cluster(text)


def test_from_jax_cpu():
    import jax
    c = cluster_from_jax()
    assert c.num_devices == len(jax.devices())
    assert c.spec.kind == "cpu" and c.spec.shared_compute
    assert c.device_memory > 0


def test_from_ray_reads_nodes(monkeypatch):
    # a stand-in for ray.nodes(): starting Ray costs seconds, this tests only the reading
    nodes = [{"Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:V100": 1.0}},
             {"Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:V100": 1.0}},
             {"Alive": False, "Resources": {"GPU": 8.0}}]
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(nodes=lambda: nodes))
    c = cluster_from_ray()
    assert (c.num_nodes, c.devices_per_node, c.spec.kind) == (2, 8, "v100")
    assert c.device_memory == 16 * GB
    nodes[0]["Resources"] = nodes[1]["Resources"] = {"GPU": 4.0}
    with pytest.raises(ValueError, match="device_memory"):
        cluster_from_ray()
    assert cluster_from_ray(device_memory=24 * GB).devices_per_node == 4


def test_calibrate_measures_positive_rates():
    spec = calibrate(size=256)
    assert spec.flops > 1e8 and spec.mem_bw > 1e8
    assert 0 < spec.launch_overhead_s < 0.1
    assert spec.flops_eff == 1.0
    assert spec.kind == DEVICE_SPECS["cpu"].kind

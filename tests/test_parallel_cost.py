"""The cost model counts the real parameters of every OPT size, and splits them like Megatron."""
import numpy as np
import pytest

from opt_serving.config import OPT_CONFIGS
from opt_serving.model.weights import layer_param_shapes, param_shapes
from opt_serving.parallel import cost
from opt_serving.parallel.cluster import DEVICE_SPECS, parse_cluster

SIZES = [k for k in OPT_CONFIGS if k != "tiny"]


def _hf_param_count(cfg) -> int:
    """Parameters of Hugging Face's OPTForCausalLM for this config (meta device: no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(transformers.OPTConfig(**d))
    return sum(p.numel() for p in model.parameters())   # lm_head is tied: counted once


@pytest.mark.parametrize("size", SIZES)
def test_param_count_matches_hugging_face(size):
    cfg = OPT_CONFIGS[size]
    n = cost.total_params(cfg)
    assert n == cfg.num_params() == _hf_param_count(cfg)
    assert cost.weight_bytes(cfg, "float16") == 2 * n
    assert cost.weight_bytes(cfg, "float32") == 4 * n


@pytest.mark.parametrize("cfg", [OPT_CONFIGS["tiny"], OPT_CONFIGS["tiny"].replace(word_embed_proj_dim=16,
                                                                                 do_layer_norm_before=False)])
def test_int8_weight_bytes_are_what_the_quantized_model_holds(cfg):
    """The planner's int8 bytes are the bytes of model/quantize.py's params (int8 matrices, a float32 scale per
    output channel, the float embedding for the lookup beside the head's int8 copy), tp 1 and split."""
    from opt_serving.model import param_tree, quantize
    import jax
    tree = quantize.quantize_params(param_tree.init_params(cfg))
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    assert cost.weight_bytes(cfg, "float32", "int8") == held
    assert held < 0.6 * cost.weight_bytes(cfg, "float32")
    # a stage's share: its layers' leaves (layers_0 of the tree), and split 2 ways the split tensors halve
    layer = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree["layers_0"]))
    assert cost.layer_bytes(cfg, 1, "float32", "int8") == layer
    assert cost.layer_bytes(cfg, 1, "float32", "int8") / 2 < cost.layer_bytes(cfg, 2, "float32", "int8") < layer
    with pytest.raises(ValueError, match="int4"):
        cost.weight_bytes(cfg, "float32", "int4")


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_a_pipeline_stages_bytes_are_what_its_cut_of_the_params_holds(weights):
    """First, middle and last stage of three: the cost model's bytes are those of param_tree.stage_params's cut
    (an int8 last stage holds the head's int8 copy, not the float embedding the first stage looks up)."""
    import jax
    from opt_serving.model import param_tree, quantize
    from opt_serving.parallel.stage_weights import stage_specs
    cfg = OPT_CONFIGS["tiny"].replace(num_hidden_layers=3)
    tree = param_tree.init_params(cfg)
    tree = quantize.quantize_params(tree) if weights == "int8" else tree
    for spec in stage_specs(cfg, 3):
        cut = param_tree.stage_params(tree, spec)
        held = sum(x.nbytes for x in jax.tree_util.tree_leaves(cut))
        assert cost.stage_param_bytes(cfg, spec.num_layers, spec.first, spec.last, 1, "float32", weights) == held
        assert ("embed_tokens" in cut) == (spec.first or (spec.last and weights == "float32"))
        assert ("lm_head" in cut) == (spec.last and weights == "int8")


def test_param_counts_near_published_sizes():
    published = {"125m": 125.2e6, "350m": 331e6, "1.3b": 1.316e9, "2.7b": 2.65e9, "6.7b": 6.66e9,
                 "13b": 12.85e9, "30b": 29.97e9, "66b": 65.7e9, "175b": 174.6e9}
    for size, n in published.items():
        assert cost.total_params(OPT_CONFIGS[size]) == pytest.approx(n, rel=2e-3), size


@pytest.mark.parametrize("size", ["125m", "350m", "30b"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_shards(size, tp):
    cfg = OPT_CONFIGS[size]
    h = cfg.hidden_size
    full = cost.layer_params(cfg)
    assert full == sum(int(np.prod(s)) for s in layer_param_shapes(cfg, 0).values())
    # everything is split except out_proj/fc2 biases and the two layer norms (6 x hidden)
    replicated = 6 * h
    assert cost.layer_params(cfg, tp) * tp - full == (tp - 1) * replicated
    assert cost.kv_cache_bytes(cfg, 3, 100, "float16", tp) * tp == cost.kv_cache_bytes(cfg, 3, 100)
    # every parameter has a tensor-parallel rule
    for name in param_shapes(cfg):
        cost.tp_dim(name)


def test_kv_cache_of_175b():
    cfg = OPT_CONFIGS["175b"]
    # keys + values, 96 layers, 12288 wide, float16: 48 KiB per token per layer
    per_token = cfg.num_hidden_layers * cost.kv_cache_bytes(cfg, 1, 1)
    assert per_token == 96 * 2 * 12288 * 2
    assert cost.kv_cache_bytes(cfg, 4, 2048) == 4 * 2048 * cost.kv_cache_bytes(cfg, 1, 1)


def test_flops_per_token_is_twice_the_matmul_weights():
    cfg = OPT_CONFIGS["1.3b"]
    assert cost.layer_flops(cfg, 1, 0) == 2 * cost.matmul_params(cfg)
    # attention adds 4 * context * hidden per token (scores and weighted sum)
    assert cost.layer_flops(cfg, 1, 100) - cost.layer_flops(cfg, 1, 0) == 4 * 100 * cfg.hidden_size


def test_decode_is_memory_bound_and_tp_splits_it():
    cfg, spec = OPT_CONFIGS["6.7b"], DEVICE_SPECS["a100"]
    n = cfg.num_hidden_layers
    t1 = cost.stage_time(cfg, spec, n, False, False, 1, 1, 1, 16)
    t4 = cost.stage_time(cfg, spec, n, False, False, 4, 1, 1, 16)
    weights = n * cost.layer_params(cfg) * 2
    assert t1.compute_s >= weights / spec.mem_bw_achieved
    assert t1.compute_s == pytest.approx(weights / spec.mem_bw_achieved, rel=0.05)
    assert t4.compute_s < t1.compute_s / 3
    assert t1.comm_s == 0 < t4.comm_s
    # host devices share their cores: splitting saves nothing
    cpu = DEVICE_SPECS["cpu"]
    c1 = cost.stage_time(cfg, cpu, n, False, False, 1, 1, 1, 16)
    c4 = cost.stage_time(cfg, cpu, n, False, False, 4, 1, 1, 16)
    assert c4.compute_s >= c1.compute_s   # pool 1: the default until calibrated


def test_handoff_across_nodes_is_slower():
    cfg, cluster = OPT_CONFIGS["30b"], parse_cluster("2x4x16GB@ib=10Gbps")
    inside = cost.handoff_time(cfg, cluster, 8, 512, False)
    across = cost.handoff_time(cfg, cluster, 8, 512, True)
    assert across > inside > cluster.spec.handoff_latency_s


def test_bad_dtype():
    with pytest.raises(ValueError, match="unsupported dtype 'int3'"):
        cost.dtype_bytes("int3")


def test_host_device_pool_caps_the_split():
    import dataclasses
    cfg = OPT_CONFIGS["125m"]
    cpu = dataclasses.replace(DEVICE_SPECS["cpu"], pool=2.0)
    t = {tp: cost.stage_time(cfg, cpu, 12, False, False, tp, 1, 1, 16).compute_s for tp in (1, 2, 4)}
    # two devices' worth of cores: a 2-way split halves the time, a 4-way split does no better
    assert t[2] < t[1] * 0.55
    assert t[4] >= t[2] * 0.99

"""The plan search: dry-run clusters from the issue, the stage DP, objectives, `opt-serving plan`."""
import itertools
import json

import numpy as np
import pytest

from opt_serving.cli import main
from opt_serving.config import OPT_CONFIGS
from opt_serving.parallel import cost
from opt_serving.parallel.cluster import GB, parse_cluster
from opt_serving.parallel.planner import NoFeasiblePlan, search, slice_layers
from opt_serving.parallel.stage_memory import peak_bytes, stage_memory


def _check_plan(plan, cfg, cluster):
    """All layers placed once, in order; tp inside a node; every device under its memory."""
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == cfg.num_hidden_layers
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert a.layers[1] == b.layers[0] and b.num_layers >= 1
    assert plan.stages[0].has_embed and plan.stages[-1].has_head
    assert plan.dp * plan.pp * plan.tp <= cluster.num_devices
    for s in plan.stages:
        assert len({cluster.node_of(d) for d in s.devices}) == 1, "tp group straddles nodes"
        assert s.memory_bytes <= plan.memory_limit < cluster.device_memory
    # the stages together hold every weight (tp shards times tp covers the whole model)
    held = sum(s.param_bytes for s in plan.stages) * plan.tp
    assert held >= cost.weight_bytes(cfg, plan.dtype)


def test_175b_fits_on_4x8x16gb():
    cfg, cluster = OPT_CONFIGS["175b"], parse_cluster("4x8x16GB")
    result = search(cfg, cluster, model="opt-175b")
    plan = result.best
    _check_plan(plan, cfg, cluster)
    assert sum(plan.layer_split) == 96
    assert plan.objective == "latency"
    # the weights alone need more than a node's 8 x 16 GB, so the plan spans nodes
    assert plan.pp * plan.tp > 8
    for p in result.plans:
        _check_plan(p, cfg, cluster)
        assert p.step_s >= plan.step_s


def test_175b_on_one_node_is_refused_with_numbers():
    cfg, cluster = OPT_CONFIGS["175b"], parse_cluster("1x8x16GB")
    with pytest.raises(NoFeasiblePlan) as e:
        search(cfg, cluster, model="opt-175b")
    need = cost.weight_bytes(cfg, "float16") / GB
    assert f"needs {need:.1f} GB of float16 weights" in str(e.value)
    assert f"has {8 * 16:.1f} GB" in str(e.value)


def test_fits_in_total_but_not_per_device_says_by_how_much():
    # 30b at float16 is 60 GB < 4 x 16 GB, but with headroom and activations no split fits
    with pytest.raises(NoFeasiblePlan, match=r"closest.*needs [\d.]+ GB per device.*usable 14.4 GB"):
        search(OPT_CONFIGS["30b"], parse_cluster("1x4x16GB"), model="opt-30b")


def test_int8_weights_fit_where_float16_ones_do_not():
    cfg = OPT_CONFIGS["175b"]
    cluster = parse_cluster("1x8x32GB")
    with pytest.raises(NoFeasiblePlan, match="needs 349.2 GB of float16 weights"):
        search(cfg, cluster, dtype="float16")
    plan = search(cfg, cluster, dtype="float16", weights="int8").best
    assert plan.weights == "int8" and plan.tp == 8
    assert plan.max_memory_bytes <= plan.memory_limit
    # the weights a device holds: about half of float16's (int8 matrices, float16 embedding)
    half = cost.weight_bytes(cfg, "float16") / plan.tp / 2
    assert 0.95 * half < plan.stages[0].param_bytes < 1.05 * half


def test_cli_quantize_plans_int8_weights(capsys):
    assert main(["plan", "--model", "opt-175b", "--cluster", "1x8x32GB"]) == 1
    assert main(["plan", "--model", "opt-175b", "--cluster", "1x8x32GB", "--quantize", "int8"]) == 0
    assert "int8 weights" in capsys.readouterr().out


def test_30b_on_2x4x16gb():
    cfg, cluster = OPT_CONFIGS["30b"], parse_cluster("2x4x16GB")
    plan = search(cfg, cluster, model="opt-30b").best
    _check_plan(plan, cfg, cluster)
    assert plan.tp <= 4 and sum(plan.layer_split) == 48
    assert plan.tp * plan.pp == 8            # 60 GB of weights need all 8 devices


def test_2_7b_on_one_80gb_device():
    cfg, cluster = OPT_CONFIGS["2.7b"], parse_cluster("1x1x80GB")
    plan = search(cfg, cluster).best
    assert plan.degrees == (1, 1, 1)
    assert plan.layer_split == [32]
    _check_plan(plan, cfg, cluster)


def test_throughput_objective_uses_micro_batches():
    cfg, cluster = OPT_CONFIGS["30b"], parse_cluster("2x4x16GB")
    result = search(cfg, cluster, batch_size=8, max_seq_len=512)
    assert result.best.objective == "throughput"
    assert all(p.micro_batches == min(p.pp, 8 // p.dp) for p in result.plans)
    tput = [p.throughput for p in result.plans]
    assert tput == sorted(tput, reverse=True)


def test_explicit_degrees_are_kept_and_bad_ones_explained():
    cfg, cluster = OPT_CONFIGS["125m"], parse_cluster("1x8x16GB")
    result = search(cfg, cluster, tensor_parallel=2, pipeline_parallel=2)
    assert {p.degrees[1:] for p in result.plans} == {(2, 2)}
    assert result.best.dp == 2
    # 12 heads do not split 8 ways
    with pytest.raises(NoFeasiblePlan, match="tp=8 does not divide 12 heads"):
        search(cfg, cluster, tensor_parallel=8)
    with pytest.raises(NoFeasiblePlan, match="tp=3 must divide the 8 devices of a node"):
        search(cfg, cluster, tensor_parallel=3)
    with pytest.raises(ValueError, match="max_seq_len 9999"):
        search(cfg, cluster, max_seq_len=9999)


def test_runner_up_reasons():
    result = search(OPT_CONFIGS["175b"], parse_cluster("4x8x16GB"))
    assert result.why_lost(result.best) == "chosen"
    for p in result.plans[1:]:
        assert f"{p.step_s / result.best.step_s:.2f}x the time per token" in result.why_lost(p)


def _brute_force(cost_of, mem_of, limit):
    S, L = cost_of.shape[0], cost_of.shape[1] - 1
    best = None
    for cuts in itertools.combinations(range(1, L), S - 1):
        split = np.diff((0, *cuts, L))
        if any(mem_of[s, n] > limit for s, n in enumerate(split)):
            continue
        c = max(cost_of[s, n] for s, n in enumerate(split))
        if best is None or c < best:
            best = c
    return best


@pytest.mark.parametrize("seed", range(6))
def test_slice_layers_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    S, L = int(rng.integers(1, 5)), int(rng.integers(4, 10))
    per_layer = rng.uniform(1, 3, size=(S, 1))
    cost_of = np.arange(L + 1) * per_layer + rng.uniform(0, 4, size=(S, 1))
    cost_of = cost_of * rng.uniform(0.8, 1.2, size=cost_of.shape)   # not even additive
    mem_of = np.arange(L + 1) * rng.uniform(1, 2, size=(S, 1))
    limit = float(rng.uniform(L / S, L))
    found = slice_layers(cost_of, mem_of, limit)
    expected = _brute_force(cost_of, mem_of, limit)
    if expected is None:
        assert found is None
    else:
        value, split = found
        assert value == pytest.approx(expected)
        assert sum(split) == L and min(split) >= 1
        assert max(cost_of[s, n] for s, n in enumerate(split)) == pytest.approx(value)
        assert all(mem_of[s, n] <= limit for s, n in enumerate(split))


# ---- the command line ----

def test_cli_table(capsys):
    assert main(["plan", "--model", "opt-175b", "--cluster", "4x8x16GB"]) == 0
    out = capsys.readouterr().out
    best = search(OPT_CONFIGS["175b"], parse_cluster("4x8x16GB")).best
    assert f"chosen: {best.name}" in out
    assert "runners-up:" in out and "not feasible" in out
    assert out.count("+embed") == 1 and out.count("+head") == 1


def test_cli_json(capsys):
    assert main(["plan", "--model", "alpa/opt-30b", "--cluster", "2x4x16GB",
                 "--batch-size", "4", "--max-seq-len", "256", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    chosen = d["chosen"]
    assert sum(chosen["layer_split"]) == 48
    assert chosen["objective"] == "throughput"
    assert all(s["memory_bytes"] <= chosen["memory_limit"] for s in chosen["stages"])
    assert all("why_lost" in p for p in d["runners_up"])


def test_cli_refuses_with_numbers(capsys):
    assert main(["plan", "--model", "opt-175b", "--cluster", "1x8x16GB"]) == 1
    err = capsys.readouterr().err
    need = cost.weight_bytes(OPT_CONFIGS["175b"], "float16") / GB
    assert f"needs {need:.1f} GB of float16 weights, the cluster has 128.0 GB" in err


@pytest.mark.parametrize("args, words", [
    (["--model", "opt-7b", "--cluster", "1x1x80GB"], "unknown OPT model"),
    (["--model", "opt-125m", "--cluster", "1x1x80"], "memory size"),
    (["--model", "/nonexistent/folder/opt", "--cluster", "1x1x80GB"], "unknown OPT model"),
])
def test_cli_bad_arguments(capsys, args, words):
    assert main(["plan", *args]) == 2
    assert words in capsys.readouterr().err


def test_cli_holds_a_draft_model_beside_the_first_stage(capsys):
    draft = '{"model": "jax/opt-350m", "num_speculative_tokens": 4}'
    args = ["plan", "--model", "opt-2.7b", "--cluster", "2x1x12GB:cpu", "--batch-size", "16", "--max-seq-len", "512",
            "--dtype", "float32"]
    assert main(args) == 0
    alone = capsys.readouterr().out
    assert main(args + ["--speculative-config", draft]) == 0
    beside = capsys.readouterr().out
    assert "draft model" not in alone and "stage 0's with the draft model's 3.28 GB beside it" in beside
    assert main(args[:4] + ["1x1x22GB:cpu"] + args[5:] + ["--speculative-config", draft]) == 1
    assert "+ the draft model 3.3), usable 19.8 GB" in capsys.readouterr().err


def test_cli_model_folder(tmp_path, capsys):
    OPT_CONFIGS["tiny"].save_hf_json(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--cluster", "1x2x1GB:cpu", "--json"]) == 0
    assert sum(json.loads(capsys.readouterr().out)["chosen"]["layer_split"]) == 4


def test_a_cpu_stage_counts_its_packed_head_and_its_loading():
    """OPT-1.3b on one CPU device counts the CPU's packed LM head and the screen's copy beside its embedding;
    over two 4.5 GB CPU nodes the last stage holds the packed head in the embedding's place (nothing more), and
    every stage the larger of its KV cache + activations and what loading a layer at a time passes through;
    3.5 GB nodes cannot hold that (the error names it)."""
    from opt_serving.config import get_config
    cfg = get_config("opt-1.3b")
    plan = search(cfg, parse_cluster("2x1x4.5GB:cpu"), model="opt-1.3b", batch_size=8, max_seq_len=256,
                  dtype="float32").best
    first, last = plan.stages
    v, d = cfg.vocab_size, cfg.word_embed_proj_dim
    assert (plan.pp, first.runtime_bytes, last.runtime_bytes) == (2, 0, 0)
    whole = search(cfg, parse_cluster("1x1x16GB:cpu"), model="opt-1.3b", batch_size=8, max_seq_len=256,
                   dtype="float32").best
    assert whole.pp == 1 and whole.stages[0].runtime_bytes == v * d * 4 + v * d + 12 * v
    for st in plan.stages:
        assert st.load_bytes == cost.load_bytes(cfg, st.num_layers, st.has_embed, st.has_head, 1, "float32")
        assert st.memory_bytes == st.param_bytes + st.runtime_bytes + max(st.load_bytes, st.kv_bytes + st.act_bytes)
    with pytest.raises(NoFeasiblePlan, match=r"loading 0\.4 GB"):
        search(cfg, parse_cluster("2x1x3.5GB:cpu"), model="opt-1.3b", batch_size=8, max_seq_len=256, dtype="float32")
    gpu = search(cfg, parse_cluster("2x1x4.5GB:a100"), model="opt-1.3b", batch_size=8, max_seq_len=256,
                 dtype="float32", pipeline_parallel=2).best
    assert [st.runtime_bytes for st in gpu.stages] == [0, 0]


def test_a_plan_without_room_for_the_prefix_pool_serves_without_it():
    """OPT-175B on Alpa's 4 x 8 x 16 GB at 8 slots of 2048 tokens: the slots' cache fits beside the weights, the
    prefix cache's pool as well does not; the plan found is the one without it (prefix_pool False), where with
    room (1 slot) the pool is counted. No room even without it: NoFeasiblePlan as before."""
    cfg, cluster = OPT_CONFIGS["175b"], parse_cluster("4x8x16GB")
    roomy = search(cfg, cluster, model="opt-175b", batch_size=1, max_seq_len=2048).best
    assert roomy.prefix_pool
    tight = search(cfg, cluster, model="opt-175b", batch_size=8, max_seq_len=2048).best
    assert not tight.prefix_pool and tight.max_memory_bytes <= tight.memory_limit
    with_pool = stage_memory(cfg, tight.stages[0].num_layers, True, False, tight.tp, 8, tight.micro_batch_size,
                             2048, 1, "float16")
    assert peak_bytes(*with_pool) > tight.memory_limit  # the pool would not have fitted this plan's first stage
    with pytest.raises(NoFeasiblePlan):
        search(cfg, cluster, model="opt-175b", batch_size=64, max_seq_len=2048)


def test_a_plan_for_generate_counts_its_whole_sequence_caches():
    """get_model's plan (use="generate") of OPT-1.3b over two 4.5 GB CPU nodes at 8 rows of 256 tokens: each stage
    the whole-sequence caches of the 8 rows and its one idle decode slot, no prefix pool, and a micro-batch of 4
    prompts prefilled together (the last stage with their logits); on one device no decode slot. The served plan
    of the same size counts its 8 slots, the pool, and one prompt prefilled at a time. Other uses are refused."""
    from opt_serving.config import get_config
    from opt_serving.runner import prefix
    cfg, cluster = get_config("opt-1.3b"), parse_cluster("2x1x4.5GB:cpu")
    args = dict(model="opt-1.3b", batch_size=8, max_seq_len=256, dtype="float32")
    gen = search(cfg, cluster, use="generate", **args).best
    served = search(cfg, cluster, **args).best
    assert (gen.use, gen.prefix_pool, gen.pp, gen.micro_batch_size) == ("generate", False, 2, 4)
    assert (served.use, served.prefix_pool) == ("serve", True)
    pool = prefix.default_blocks(8, 256) * prefix.BLOCK_SIZE
    for st, s in zip(gen.stages, served.stages):
        n = st.num_layers
        assert st.kv_bytes == n * cost.kv_cache_bytes(cfg, 8 + 1, 256, "float32")
        assert s.kv_bytes == n * (cost.kv_cache_bytes(cfg, 8, 256, "float32")
                                  + cost.kv_cache_bytes(cfg, 1, pool, "float32"))
        logits = cost.logits_bytes(cfg, 4) if st.has_head else 0
        assert st.act_bytes == cost.activation_bytes(cfg, 4, 256, "float32") + logits
        assert s.act_bytes == cost.activation_bytes(cfg, 1, 256, "float32") + logits
        assert st.memory_bytes == st.param_bytes + max(st.load_bytes, st.kv_bytes + st.act_bytes)
    one = search(cfg, parse_cluster("1x1x16GB:cpu"), use="generate", **args).best
    assert one.pp == 1 and one.stages[0].kv_bytes == 24 * cost.kv_cache_bytes(cfg, 8, 256, "float32")
    with pytest.raises(ValueError, match="use must be one of serve, generate"):
        search(cfg, cluster, use="beam", **args)


def test_a_served_draft_model_is_held_beside_the_first_stage():
    """OPT-2.7b served at 16 slots of 512 tokens with an OPT-350m draft model (runner/draft.py: its weights and a
    cache of 512 + 68 entries for each of the 16 rows, in the serving process): where the target alone fits one
    22 GB node, the two do not, and the refusal names the draft; on two 12 GB nodes the first stage gives layers to
    the second to make room. A draft bigger than what the cluster has left is refused before the search."""
    from opt_serving.config import get_config
    from opt_serving.parallel.stage_memory import DraftModel
    cfg, draft = get_config("opt-2.7b"), DraftModel(get_config("opt-350m"), 68)
    args = dict(model="opt-2.7b", batch_size=16, max_seq_len=512, dtype="float32")
    need = draft.peak_bytes(16, 512, "float32", cpu=True)
    kv = 16 * 580 * 24 * cost.kv_cache_bytes(draft.cfg, 1, 1, "float32")  # 16 rows of 580 entries, 24 layers
    assert need > kv + cost.weight_bytes(draft.cfg, "float32")
    assert search(cfg, parse_cluster("1x1x22GB:cpu"), **args).best.pp == 1
    with pytest.raises(NoFeasiblePlan, match=rf"\+ the draft model {need / GB:.1f}\), usable 19.8 GB"):
        search(cfg, parse_cluster("1x1x22GB:cpu"), draft=draft, **args)
    alone = search(cfg, parse_cluster("2x1x12GB:cpu"), **args).best
    beside = search(cfg, parse_cluster("2x1x12GB:cpu"), draft=draft, **args).best
    assert alone.pp == beside.pp == 2 and beside.layer_split[0] < alone.layer_split[0]
    assert [s.draft_bytes for s in beside.stages] == [need, 0]
    first = beside.stages[0]
    assert first.memory_bytes == need + peak_bytes(first.param_bytes, first.kv_bytes, first.act_bytes,
                                                   first.runtime_bytes, first.load_bytes) <= beside.memory_limit
    with pytest.raises(NoFeasiblePlan, match="needs 10.6 GB of float32 weights and its draft model 5.3 GB"):
        search(cfg, parse_cluster("1x1x15GB:cpu"), draft=DraftModel(get_config("opt-1.3b"), 68), **args)
    with pytest.raises(ValueError, match="a draft model is planned for serving"):
        search(cfg, parse_cluster("2x1x12GB:cpu"), draft=draft, use="generate", **args)


def test_load_engine_plans_room_for_its_draft_model(monkeypatch):
    """load_engine hands the planner the draft model its speculative_config names: its config, k drafts and the
    widest chunk past each row's tokens, in the target's weight format."""
    from opt_serving.config import config_for
    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.runner import load
    from opt_serving.text import loading
    seen = {}

    def load_slots(spec, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("planned")
    monkeypatch.setattr(load, "load_slots", load_slots)
    with pytest.raises(RuntimeError, match="planned"):
        loading.load_engine("alpa/opt-125m", dummy=True, quantize="int8",
                            speculative={"model": "opt-tiny", "num_speculative_tokens": 3})
    draft = seen["draft"]
    assert (draft.cfg, draft.extra, draft.weights) == (config_for("opt-tiny", ensure_embedded_model()), 64 + 3, "int8")

"""alpa/ models pipelined over a two-node Ray cluster simulated on this machine, served by Ray Serve.

The served answers of pp = 2 (chosen by the planner itself from a small `device_memory`) and of
pp = 2 x tp = 2 equal the single-device jax/ engine's on the same weights: greedy, seeded sampling,
and eight requests at once against each alone. The two stages run on the two nodes, inside the
replica's placement group. A killed stage fails requests with a 503 naming it, and Serve rebuilds the
replica with its stages. int8 weights pipelined over the two nodes serve the jax/ int8 engine's answers, and
the planner gives them one device where float32 needs two. Ray starts are slow on 2 cores: one cluster
serves the whole module. The first deployment warms up as a server does (its stage actors compile every shape);
the later plans compile each step at its first use (warmup=False), what those tests check being their tokens.
"""
import concurrent.futures
import os
import re
import signal
import time

import pytest
import requests

from opt_serving.text.generator import SamplingParams

pytestmark = pytest.mark.skipif(os.environ.get("OPT_SERVING_SKIP_RAY") == "1", reason="OPT_SERVING_SKIP_RAY=1")

# the last two share a prefix of several blocks: the pipelined server's stages reuse the first one's (prefix caching
# is on by default; the reference has it off)
HEAD = "Every pipeline stage keeps the cached blocks of its own layers, under the same block numbers as the others:"
PROMPTS = ["Hello world", "Paris is the capital of", "a", "The quick brown fox jumps over",
           "OPT serving", "Once upon a time", "1 2 3 4", "the end", HEAD + " one", HEAD + " two"]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = dict(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def folder():
    from opt_serving.model.embedded import ensure_embedded_model
    return ensure_embedded_model()


@pytest.fixture(scope="module")
def reference(folder):
    return engine_reference(folder, prefix_caching=False)


def engine_reference(folder, **kw):
    """The jax/ engine's completions (one device, this process). Not warmed up: the reference compiles only the
    steps these requests run (warm-up compiles every shape serving may run, the same programs)."""
    from opt_serving.text.loading import load_generator
    import asyncio
    gen = load_generator("jax/opt-tiny", folder, max_batch_size=8, max_seq_len=64, warmup=False, **kw)

    async def beams():
        return await gen.beam(PROMPTS[1], SamplingParams(max_tokens=8, min_tokens=8), 3)
    try:
        out = {name: [c[0].text for c in gen.complete_many(PROMPTS, SamplingParams(**kw))]
               for name, kw in (("greedy", GREEDY), ("sampled", SAMPLED))}
        out["beams"] = PROMPTS[1] + asyncio.run(beams()).text
        return out
    finally:
        gen.close()


@pytest.fixture(scope="module")
def cluster():
    from ray import serve
    from opt_serving.service.testserver import free_port
    from opt_serving.testing.ray_cluster import simulated_cluster
    RUNNING.clear()
    with simulated_cluster(nodes=2, cpus_per_node=2):
        port = free_port()
        # one proxy, on the head: both simulated nodes are this host, and with a proxy on each Serve drained and
        # removed the one on the node a redeploy left without a replica while it still held a request of ours
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    RUNNING.clear()


RUNNING = {}  # "plan": the arguments of the app the module's cluster runs now


def deploy(folder, **plan):
    """The app for alpa/opt-tiny with `plan` (ServeArgs' arguments, warmup=False among them), replacing whatever ran
    before; returns its plan. The app already running with these very arguments is kept (a pipelined deployment
    takes tens of seconds to start)."""
    from ray import serve
    from opt_serving.service.deployment import ServeArgs, build_app
    args = ServeArgs(model="alpa/opt-tiny", path=str(folder), max_batch_size=8, max_seq_len=64, **plan)
    app = build_app(args)  # (plans the model: fills in the degrees left out)
    if RUNNING.get("plan") != (str(folder), plan):
        RUNNING.clear()
        serve.run(app, name="opt", route_prefix="/")
        RUNNING["plan"] = (str(folder), plan)
    return args


def complete(url, prompt, **kw):
    r = requests.post(url + "/v1/completions", json={"prompt": prompt, **kw}, timeout=120)
    return r


def texts(url, kw, concurrent=False):
    if not concurrent:
        return [complete(url, p, **kw).json()["choices"][0]["text"] for p in PROMPTS]
    with concurrent_pool() as pool:
        return [r.json()["choices"][0]["text"] for r in pool.map(lambda p: complete(url, p, **kw), PROMPTS)]


def concurrent_pool():
    return concurrent.futures.ThreadPoolExecutor(len(PROMPTS))


def stages_by_node():
    from opt_serving.testing.ray_cluster import node_names, stage_actors
    names = node_names()
    return sorted((names[a["node"]], a["pid"], a["stage"]) for a in stage_actors())


def test_a_small_device_memory_pipelines_the_model_over_both_nodes(cluster, folder, reference):
    args = deploy(folder, device_memory="5MB")  # 4 MB of weights: no device holds them all
    assert (args.pipeline_parallel, args.tensor_parallel) == (2, 1)  # the planner's own choice
    assert [node for node, _, _ in stages_by_node()] == ["node0", "node1"]
    assert texts(cluster, GREEDY) == reference["greedy"]
    assert texts(cluster, SAMPLED) == reference["sampled"]
    usage = complete(cluster, PROMPTS[-1], **GREEDY).json()["usage"]  # its head was cached by the runs above
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32, usage
    # ten at once (two micro-batch groups of four slots, in the stages together) = each alone
    assert texts(cluster, GREEDY, concurrent=True) == reference["greedy"]
    assert texts(cluster, SAMPLED, concurrent=True) == reference["sampled"]
    # structured output: the last stage's actor keeps the matchers of its groups' rows
    rx = r"[a-z]{2,6}\."
    with concurrent_pool() as pool:
        outs = list(pool.map(lambda p: complete(cluster, p, max_tokens=12, temperature=0, guided_regex=rx), PROMPTS))
    assert all(r.status_code == 200 for r in outs), outs[0].text
    assert all(re.fullmatch(rx, r.json()["choices"][0]["text"]) for r in outs), [r.json() for r in outs]
    # beam search (GPT-J's route) runs generate() over the same stage actors
    r = requests.post(cluster + "/generate", json={"prompt": [PROMPTS[1]], "max_length": 8, "min_length": 8,
                                                   "do_sample": False, "num_beams": 3}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["gen_text"] == [reference["beams"]]


def test_nothing_fits_says_what_opt_serving_plan_says(cluster, folder, capsys):
    from opt_serving.parallel import backend, cli as plan_cli
    from opt_serving.parallel.planner import NoFeasiblePlan
    with pytest.raises(NoFeasiblePlan) as served:
        deploy(folder, device_memory="3MB")
    parser = __import__("argparse").ArgumentParser()
    plan_cli.add_arguments(parser)
    assert plan_cli.run(parser.parse_args(["--model", "alpa/opt-tiny", "--cluster", "2x1x3MB:cpu",
                                           "--batch-size", "8", "--max-seq-len", "64",
                                           "--dtype", "float32"])) != 0
    out = capsys.readouterr()
    assert str(served.value) in out.out + out.err
    assert backend  # the same planner both ways


def test_a_killed_stage_gives_503s_and_serve_rebuilds_the_replica(cluster, folder, reference):
    # the planner's pp 2 of the first test, compiling at first use: Serve rebuilds it the same way after the kill
    args = deploy(folder, device_memory="5MB", warmup=False)
    assert (args.pipeline_parallel, args.tensor_parallel) == (2, 1)
    assert texts(cluster, GREEDY)[:2] == reference["greedy"][:2]
    _, pid, stage = stages_by_node()[1]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    r = complete(cluster, PROMPTS[0], **GREEDY)
    failed_after = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert f"{stage} died" in r.json()["error"]["message"]
    deadline, served_again = time.monotonic() + 240, None
    while time.monotonic() < deadline:  # Serve's health check fails, it rebuilds the replica and its stages
        r = complete(cluster, PROMPTS[0], **GREEDY)
        if r.status_code == 200:
            served_again = time.monotonic() - t0
            break
        assert r.status_code == 503, r.text
        time.sleep(0.5)
    print(f"killed stage: first request failed after {failed_after:.2f} s; served again after {served_again} s")
    assert served_again is not None, "the deployment did not come back"
    assert r.json()["choices"][0]["text"] == reference["greedy"][0]
    assert len(stages_by_node()) == 2 and pid not in [p for _, p, _ in stages_by_node()]


def test_pp2_by_tp2_serves_the_same_tokens(cluster, folder, reference):
    args = deploy(folder, pipeline_parallel=2, tensor_parallel=2, warmup=False)
    assert (args.pipeline_parallel, args.tensor_parallel) == (2, 2)
    assert len(stages_by_node()) == 2
    assert texts(cluster, GREEDY, concurrent=True) == reference["greedy"]
    assert texts(cluster, SAMPLED) == reference["sampled"]


def test_int8_weights_pipelined_over_both_nodes_serve_the_jax_int8_engines_tokens(cluster, folder, reference):
    from opt_serving.service.deployment import ServeArgs, placement
    small = dict(model="alpa/opt-tiny", path=str(folder), max_batch_size=8, max_seq_len=64, device_memory="5MB")
    planned = [ServeArgs(**small), ServeArgs(**small, quantize="int8")]
    for args in planned:
        placement(args)
    # the planner counts int8 bytes: the weights that needed two stages fit one device
    assert [(a.pipeline_parallel, a.tensor_parallel) for a in planned] == [(2, 1), (1, 1)]
    want = engine_reference(folder, quantize="int8")
    assert want["greedy"] != reference["greedy"]  # int8's tokens are not float32's on this model
    deploy(folder, pipeline_parallel=2, quantize="int8", warmup=False)
    assert [node for node, _, _ in stages_by_node()] == ["node0", "node1"]
    assert texts(cluster, GREEDY, concurrent=True) == want["greedy"]
    assert texts(cluster, SAMPLED) == want["sampled"]


def test_an_unknown_builder_argument_is_an_error_naming_it():
    from pydantic import ValidationError
    from opt_serving.service.deployment import build_app
    with pytest.raises(ValidationError, match="pipeline_paralel"):
        build_app({"model": "alpa/opt-tiny", "pipeline_paralel": 2})

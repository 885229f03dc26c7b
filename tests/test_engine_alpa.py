"""The continuous-batching engine serves an alpa/ tensor-parallel model: the same tokens as jax/, with
several decode steps a call (the default) on the sharded params, structured output's masks, and prefix caching (the
default).

The engine's jitted steps take the plan's sharded params as they are (GSPMD places the
KV cache by heads). jax must see several CPU devices before it is imported, so the check runs
in a child process. Pipelined plans (Ray stage actors) are served in tests/test_service_pipeline.py.
"""
import os
import re
import subprocess
import sys
import textwrap

from opt_serving import jax_env

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, jax
    from opt_serving.testing.ray_cluster import no_foreign_clusters
    no_foreign_clusters()  # alpa/ plans for this process's devices, never for a Ray running on the machine
    from opt_serving.text.loading import load_engine
    from opt_serving.text.generator import Generator, SamplingParams
    from opt_serving.model.wrapper import get_model
    from opt_serving.text.tokenizer import load_tokenizer

    path = sys.argv[1]
    engine = load_engine("alpa/opt-tiny", path, num_slots=3, max_seq_len=64, tensor_parallel=2)
    # four steps a call whatever the machine's load (by default a call is held to admission.DECODE_CALL_S of
    # wall time, and a loaded CI machine would then take one step at a time)
    engine.decode_call_s = float("inf")
    stage = engine.model.stages.stages[0]
    cache_spec = str(jax.tree_util.tree_leaves(stage.caches[0])[0].sharding.spec)
    calls = []  # several decode steps a call (the default), on the sharded params too
    real = stage.send_steps  # (a call of several steps is sent, then read back)
    stage.send_steps = lambda x, step: (calls.append(step.steps), real(x, step))[1]
    tok = load_tokenizer(path)
    gen = Generator(engine, tok, max_seq_len=64, model_name="alpa/opt-tiny")
    head = "A tensor-parallel stage keeps its share of the heads of every cached block of a prompt, so that"
    prompts = ["Hello world", "Paris is the capital of", "a", "The quick brown fox jumps", head + " one", head + " two"]
    served = [c[0].token_ids for c in gen.complete_many(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    # structured output on the sharded params: greedy (the screened head's masks) and sampled
    from opt_serving.text.structured import StructuredOutput
    rx = StructuredOutput.of("regex", "[a-z]{2,6}[.]", "guided_regex")
    constrained = [c[0].text for t in (0, 1.0) for c in gen.complete_many(
        prompts, SamplingParams(max_tokens=12, temperature=t, seed=2, structured=rx))]
    cached = engine.stats().cached_tokens  # the second long prompt reuses the first one's blocks
    pool_spec = str(stage.pool["k"][0].sharding.spec)
    gen.close()
    ref = get_model("jax/opt-tiny", path)
    offline = []
    for p in prompts:
        ids = np.array([tok(p).input_ids])
        out = ref.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8)
        offline.append(np.asarray(out)[0, ids.shape[1]:].tolist())
    print(json.dumps({"served": served, "offline": offline, "cache_spec": cache_spec,
                      "devices": len(jax.devices()), "calls": calls, "constrained": constrained,
                      "cached": cached, "pool_spec": pool_spec}))
""")


def test_engine_serves_a_tensor_parallel_alpa_model(tmp_path):
    from opt_serving.model.embedded import ensure_embedded_model
    path = ensure_embedded_model()
    env = {**os.environ, **jax_env.host_devices(4), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert result["served"] == result["offline"]
    assert result["calls"] and set(result["calls"]) == {4}  # some steps ran four a call
    assert "tp" in result["cache_spec"], result["cache_spec"]   # the cache really is sharded
    assert len(result["constrained"]) == 12  # six prompts, greedy and sampled
    assert all(re.fullmatch(r"[a-z]{2,6}[.]", t) for t in result["constrained"]), result["constrained"]
    assert result["cached"] >= 32  # prefix caching (on by default) reused a prompt's blocks on the sharded stage

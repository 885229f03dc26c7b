"""Fixtures and model configs shared by several test files (`from conftest import TINY`:
pytest puts tests/ on sys.path)."""
import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from opt_serving.config import OPTConfig

ASSETS = Path(__file__).resolve().parents[1] / ".." / "shared" / "opt-assets"

@pytest.fixture(autouse=True, scope="session")
def _no_foreign_ray_clusters():
    """No test joins a Ray cluster it did not start (another program's, on a shared machine): Ray's address
    discovery finds nothing in this process (testing/ray_cluster.py). Servers tests start run their own Ray
    (--ray-address local); child processes that may plan alpa/ models call no_foreign_clusters() too."""
    from opt_serving.testing.ray_cluster import no_foreign_clusters
    no_foreign_clusters()
    yield


# The files whose tests start clusters, servers or 8-device children, the longest first (their totals in the
# durations `make test` prints): the Makefile hands files to its two workers in collection order
# (--no-loadscope-reorder, where pytest-xdist would order them by their number of tests), so the long ones start
# first and the short ones fill in around them instead of one worker finishing a long file alone at the end.
LONG_FILES = ["test_service_pipeline.py", "test_parallel_backend.py", "test_engine.py", "test_prefix.py",
              "test_service_replica_kill.py", "test_runner.py", "test_gpu_check.py", "test_parallel_handoff.py",
              "test_lora_parallel.py", "test_chaos.py", "test_engine_alpa.py", "test_service_cli_cluster.py",
              "test_serve_deploy.py", "test_service_signals.py"]


def pytest_collection_modifyitems(config, items):
    from opt_serving.testing.multidevice import IN_CHILD, MARKER
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    if not IN_CHILD:  # (their file's test_in_8_device_subprocess runs them in a child that sees 8 devices)
        for item in items:
            if item.get_closest_marker(MARKER):
                item.add_marker(pytest.mark.skip(reason="runs in the 8-device child process"))


# Ray's temp folder of this test process's own (short: Ray's socket paths must be), for every Ray the tests
# start and the servers, workers and children those start: the address file a simulated cluster writes there
# (ray.cluster_utils.Cluster, `ray start`) is never found by another program or another xdist worker, nor
# theirs here (connect_ray joins the cluster such a file names when its head answers).
_RAY_TMP = tempfile.mkdtemp(prefix="rt", dir="/tmp")
os.environ["RAY_TMPDIR"] = _RAY_TMP
atexit.register(shutil.rmtree, _RAY_TMP, ignore_errors=True)

# The suite's XLA programs compiled by XLA's CPU emitters of the cheapest kind and LLVM's cheapest passes: the
# suite's time is mostly XLA compiling thousands of small programs (a file of them compiled in a third of the
# time: docs/development.md), and the tests check tokens and numbers, not speed (the benchmarks time the programs
# users get). Inherited by the workers, servers, stage actors and children the tests start (jax_env.host_devices
# keeps them); OPT_SERVING_TEST_XLA_OPT=1 compiles as users do.
_CHEAP_COMPILE = ["--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0",
                  "--xla_llvm_disable_expensive_passes=true"]
if os.environ.get("OPT_SERVING_TEST_XLA_OPT") != "1":
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _CHEAP_COMPILE if f not in _flags])

# The compile cache on, as a user has it (xla_cache.py), in a folder of this test run's own, never under the
# user's home: made by the first process that loads this file (pytest-xdist's controller, before it starts
# its workers, which inherit it, as do the servers, Ray workers and children the tests start) and removed when
# that process exits. The same steps compiled by many servers, stages and children of the run (the embedded
# model's warm-up, a replica replaced after a kill) are then compiled once. A given OPT_SERVING_COMPILE_CACHE
# ("0": off) is followed; test_xla_cache.py sets its own in processes of its own.
if "OPT_SERVING_COMPILE_CACHE" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="xla", dir="/tmp")
    os.environ["OPT_SERVING_COMPILE_CACHE"] = _XLA_CACHE
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)


def pytest_sessionstart(session):
    """The compile cache on in each process that runs tests, from its first test: models built directly (not by
    load_engine, which turns it on) then load the programs another test or worker compiled (the same config and
    shapes make the same program) instead of compiling them again (docs/development.md)."""
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test
    from opt_serving import xla_cache
    if xla_cache.enable() is not None:  # (programs compiled in under 0.3 s are not written: their writes cost more)
        import jax
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


# The tiny pre-LN model most unit tests build: two layers of four heads, milliseconds to run.
TINY = OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=64, max_position_embeddings=64)
# OPT-350m's shape at TINY's size: 16-wide embeddings projected in/out, post-LN, no final layer norm
TINY_POST_LN = TINY.replace(word_embed_proj_dim=16, do_layer_norm_before=False)
# Four layers to slice into pipeline stages, 64 wide to split over tensor-parallel devices.
SMALL = OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  ffn_dim=256, max_position_embeddings=64, word_embed_proj_dim=64)


def hf_model(cfg, seed=0):
    """Hugging Face's OPTForCausalLM for `cfg`, randomly initialised from `seed`, with the 1-D
    parameters (biases, norms) moved off their 0 / 1 init so a wrong bias or norm path shows."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**cfg.to_hf_dict())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@contextlib.contextmanager
def xla_compiles():
    """The executables XLA builds, or loads from the compile cache, in this process while the block runs (one entry
    each, its function's name, from any thread: an engine's too): a warmed model's requests must ask for none."""
    import jax
    asked = []

    def on(event, _secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            asked.append(kw.get("fun_name", "?"))
    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        yield asked
    finally:
        jax.monitoring.unregister_event_duration_listener(on)


def xla_slots(cfg, params, **kwargs):
    """The engine's slot model over `params` on plain XLA, as on a GPU or a tensor-parallel mesh: no ragged steps
    (short prompts join steps whole, longer ones are prefilled in chunks of their own); `kwargs`: local_slots'."""
    from opt_serving.backend import Backend
    from opt_serving.model.layout import fuse_qkv_on_one_device
    from opt_serving.runner.load import local_slots
    return local_slots(cfg, fuse_qkv_on_one_device(params), backend=Backend.xla(), **kwargs)


def peft_model(cfg, folder, seed=0, hf=None):
    """Hugging Face's model (hf_model(cfg, seed), or `hf`) with the PEFT LoRA adapter at `folder`, applied by PEFT
    itself: the reference a LoRA adapter's numbers are checked against."""
    import peft
    return peft.PeftModel.from_pretrained(hf if hf is not None else hf_model(cfg, seed), str(folder)).eval()


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

# Served speculative decoding's configs (config.SpeculativeConfig, vLLM's --speculative-config): one that is served,
# and bad ones, each with a piece of the error it must give; the `serve` flag (test_service_cli.py) and the builder
# argument (test_deploy_configs.py) refuse the same values
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
BAD_SPECULATIVE_CONFIGS = {
    "bad-json": ('{"method": "ngram", "num_speculative_tokens": 4', "not valid JSON"),
    "not-an-object": ("[4]", "must be a JSON object"),
    "eagle": ('{"method": "eagle", "num_speculative_tokens": 4}', "unknown method 'eagle'"),
    "draft-without-model": ('{"method": "draft_model", "num_speculative_tokens": 4}', "needs 'model'"),
    "path-without-model": ('{"path": "/data/opt-125m-np", "num_speculative_tokens": 4}', "give 'model' too"),
    "ngram-with-model": ('{"method": "ngram", "model": "opt-tiny", "num_speculative_tokens": 4}', "takes no 'model'"),
    "draft-with-lookup": ('{"model": "opt-tiny", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
                          "prompt_lookup_max: prompt lookup's"),
    "unknown-method": ('{"method": "suffix", "num_speculative_tokens": 4}', "unknown method 'suffix'"),
    "unknown-key": ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_maximum": 3}',
                    "unknown key(s) prompt_lookup_maximum"),
    "no-token-count": ('{"method": "ngram"}', "num_speculative_tokens is required"),
    "too-many-tokens": ('{"method": "ngram", "num_speculative_tokens": 64}', "num_speculative_tokens must be 1 to"),
    "min-above-max": ('{"num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
                      "prompt_lookup_min <= prompt_lookup_max"),
}


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels_run_on_the_cpu(request):
    """A module marked `pytestmark = pytest.mark.cpu_kernels` tests the CPU kernels, which switch themselves off
    on other devices: it runs on the CPU device, also where JAX has a GPU (then the default device). Set
    globally, not as a context, so the engine's own thread places what it makes there too."""
    if request.node.get_closest_marker("cpu_kernels") is None:
        yield
        return
    import jax
    before = jax.config.jax_default_device
    jax.config.update("jax_default_device", jax.devices("cpu")[0])
    try:
        yield
    finally:
        jax.config.update("jax_default_device", before)


def on_cpu(tree):
    """A tree of arrays on the CPU device (the CPU kernels' tests, where another device is the default)."""
    import jax
    return jax.device_put(tree, jax.devices("cpu")[0])


@pytest.fixture(scope="session")
def opt_tokenizer(tmp_path_factory):
    """The real OPT tokenizer (../shared/opt-assets, set up in a temporary folder the way OPT's is);
    skips where the assets are absent."""
    if not ASSETS.is_dir():
        pytest.skip(f"OPT tokenizer files not found at {ASSETS} (../shared/opt-assets is absent)")
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("opt-tokenizer")
    shutil.copy(ASSETS / "gpt2-vocab.json", d / "vocab.json")
    shutil.copy(ASSETS / "gpt2-merges.txt", d / "merges.txt")
    (d / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>", '
        '"unk_token": "</s>", "pad_token": "<pad>", "add_bos_token": true}')
    return AutoTokenizer.from_pretrained(str(d))


# OPT's real vocabulary at a test's size: the real tokenizer's ids (structured output, logit_bias, prompt scores)
# through a model that compiles in seconds
OPT_VOCAB_SMALL = OPTConfig(vocab_size=50272, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            ffn_dim=128, max_position_embeddings=256, word_embed_proj_dim=64)


@pytest.fixture(scope="session")
def opt_vocab_server(opt_tokenizer):
    """A random-weight OPT_VOCAB_SMALL model (Hugging Face's, the reference, and the engine over the same weights,
    four decode steps a call as served by default) behind the real OPT tokenizer, served under two names (vLLM's
    --served-model-name) -> (generator, base URL, `openai` client, the HF model)."""
    openai = pytest.importorskip("openai")
    from opt_serving.engine.scheduler import Engine, OPTSlots
    from opt_serving.text.generator import Generator
    from opt_serving.model import weights
    from opt_serving.service.app import create_app
    from opt_serving.service.testserver import serve_in_thread
    hf = hf_model(OPT_VOCAB_SMALL, seed=1)
    slots = OPTSlots(OPT_VOCAB_SMALL, weights.params_from_hf_state_dict(OPT_VOCAB_SMALL, hf.state_dict()),
                     num_slots=8, max_seq_len=256)
    # (however long a step takes on a busy machine, four a call while nobody waits for a slot)
    g = Generator(Engine(slots, decode_steps=4, decode_call_s=3600), opt_tokenizer, model_name="opt-small")
    with serve_in_thread(create_app(g, model_name=["opt-small", "my-opt"])) as url:
        yield g, url, openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120), hf
    g.close()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray of the module's own (never a cluster it did not start), stopped after the module's tests
    unless a test stopped it already (to start a simulated cluster)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    yield ray
    if ray.is_initialized():
        ray.shutdown()


def run_jobs(engine, jobs):
    """Submit (prompt, settings) jobs to an engine at once -> [(tokens, finish reason)] in order (the served
    speculative decoding tests compare these between engines)."""
    outs = [([], []) for _ in jobs]
    finished = [threading.Event() for _ in jobs]

    def collect(i):
        def on(out):
            outs[i][0].extend(t.id for t in out.tokens)
            if out.finish_reason:
                outs[i][1].append(out.finish_reason)
                finished[i].set()
        return on
    for i, (prompt, settings) in enumerate(jobs):
        engine.submit(prompt, settings, collect(i))
    assert all(f.wait(120) for f in finished)
    return [(toks, reason[0]) for toks, reason in outs]

"""`opt-serving serve`'s command line: its flags, the `ServeArgs` they make, and what is wrong with them, found
before Ray starts (a replica that loads the model would only report it as a failed deployment).
"""
from __future__ import annotations

import argparse
import os

from opt_serving.config import SpeculativeConfig, get_config
from opt_serving.engine.admission import DECODE_STEPS, PREFILL_BUDGET, PREFILL_CHUNK
from opt_serving.service import lora_args
from opt_serving.service.deployment import ServeArgs, check_model_args
from opt_serving.settings import Settings
from opt_serving.text.chat import load_chat_template
from opt_serving.text.tokenizer import load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="model", choices=["model", "fake"],
                   help="model (default): the model below; fake: the hand-checkable fake engine, for tests and "
                        "demos of the HTTP side (no weights)")
    p.add_argument("--model", default=None,
                   help="model name, e.g. facebook/opt-125m, jax/opt-2.7b, alpa/opt-175b (default: the embedded "
                        "tiny model)")
    p.add_argument("--path", default=None, help="numpy weight folder (default: the embedded tiny model)")
    p.add_argument("--dummy", action="store_true",
                   help="random weights of --model's size (no weight files); for benchmarks and smoke tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the --dummy weights")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder: vocab.json + merges.txt, tokenizer.json, or metaseq's gpt2-vocab.json + "
                        "gpt2-merges.txt (e.g. ../shared/opt-assets); needed with --dummy beyond opt-tiny, and "
                        "with a --path that has no tokenizer files")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): float16 on GPUs, float32 on CPUs")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8 weights with a scale per output channel, from any numpy folder (a folder "
                        "converted with --quantize int8 loads a quarter of the bytes)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"the most tokens a step computes: on the CPU kernels prompts ride the decode steps, a "
                        f"step carrying N tokens at most, the running streams' included; elsewhere prompts with more "
                        f"than N tokens are prefilled N at a time between decode steps (default {PREFILL_CHUNK}; 0: "
                        f"whole prefills)")
    p.add_argument("--prefill-budget", type=int, default=None, metavar="T",
                   help=f"prompt tokens prefilled per engine iteration, whole prompts and chunks, oldest first "
                        f"(default {PREFILL_BUDGET}, vLLM's max_num_batched_tokens on CPUs); less: shorter pauses "
                        "of the running streams, longer waits for a first token under a burst of prompts")
    p.add_argument("--decode-steps", type=int, default=DECODE_STEPS, metavar="K",
                   help="decode steps taken in one call while no waiting request could take a free slot: "
                        "the host's work (dispatch, handing out tokens, streaming) is paid once for K tokens "
                        "of each stream, which arrive together; a newcomer waits at most K steps (1: off)")
    p.add_argument("--engine-ahead", action="store_true",
                   help="send each call of several decode steps before the one in flight is read, so a GPU runs "
                        "it while the host hands out tokens (off by default: no gain measured on CPUs yet)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not keep prompts' KV cache for later prompts that start the same way (on by "
                        "default: such a prompt prefills only what follows its cached prefix)")
    p.add_argument("--max-batch-size", type=int, default=16, help="decode slots (requests advanced per step)")
    p.add_argument("--max-seq-len", type=int, default=None, help="prompt + generated tokens (default: the model's)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond which the answer is 429")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cut off")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) requests may use, as vLLM's flag: the first is the one answers give and "
                        "/v1/models lists them all; a request naming another model is a 404 (default: --model, or "
                        "the embedded model's name)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template /v1/chat/completions renders messages with (a file, or the template "
                        "itself, as vLLM's flag; e.g. deploy/opt-chat-template.jinja); default: the tokenizer's "
                        "own, and without one (OPT has none) chat requests are a 400 naming this flag")
    p.add_argument("--api-key", action="append", default=[],
                   help="accept only requests with `Authorization: Bearer KEY` (repeatable; also "
                        "$OPT_SERVING_API_KEYS, comma separated)")
    _warmup_arguments(p)
    _decoding_feature_arguments(p)
    _plan_and_ray_arguments(p)


def _warmup_arguments(p: argparse.ArgumentParser) -> None:
    """What compiles before the server answers (runner/warmup.py)."""
    p.add_argument("--warmup-all", dest="warmup", action="store_const", const="all", default=True,
                   help="compile every shape before serving, the prefills only scored prompts run (prompt "
                        "logprobs, echo with logprobs: lm-eval's loglikelihood) too; by default those compile at "
                        "their first use where prompts join the decode steps (the CPU kernels), a faster start")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="compile each program at its first use instead of warming up before serving: the server "
                        "answers in seconds, and the first request of each new shape (prompt width, cache window, "
                        "joining block) waits for its compile, read from the compile cache when an earlier start "
                        "compiled it")


def _decoding_feature_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (service/lora_args.py) and speculative decoding."""
    lora_args.add_arguments(p)
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='served speculative decoding, as vLLM\'s flag: prompt lookup, e.g. \'{"method": '
                        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' (greedy and sampled rows '
                        "draft the tokens that followed an earlier occurrence of their last n tokens), or a draft "
                        'model sharing the tokenizer, e.g. \'{"model": "jax/opt-125m", "path": "/data/opt-125m-np", '
                        '"num_speculative_tokens": 4}\' ("model": "opt-tiny" without a path: the embedded model)')


def speculative_config(value: str) -> dict | None:
    """--speculative-config's JSON -> the config as a dict (ServeArgs' speculative_config; None: off), checked
    by config.SpeculativeConfig.parse when the command line is parsed, so a bad value exits naming the flag
    before anything loads."""
    try:
        config = SpeculativeConfig.parse(value)
    except ValueError as e:
        message = str(e)
        for prefix, instead in (("speculative_config: ", ""), ("speculative_config ", "the value ")):
            if message.startswith(prefix):
                message = instead + message[len(prefix):]
                break
        raise argparse.ArgumentTypeError(message) from None
    return None if config is None else config.as_dict()


def _plan_and_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The alpa/ plan's, the service limits' and the Ray/Serve process options (add_arguments' second half)."""
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="TP",
                   help="alpa/ models: devices a stage's layers are split over (default: the planner's choice)")
    p.add_argument("--pipeline-parallel", type=int, default=None, metavar="PP",
                   help="alpa/ models: pipeline stages, Ray actors placed on the cluster's nodes (default: the "
                        "planner's choice for the Ray cluster)")
    p.add_argument("--device-memory", default=None, metavar="BYTES",
                   help="alpa/ models: what each device may hold, e.g. 16GB (CPU nodes, GPUs Ray does not "
                        "name); the planner pipelines a model that does not fit one device")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="pipelined plans: decode slot groups in flight through the stages (default: pp)")
    p.add_argument("--handoff", default="auto", choices=["auto", "cgraph", "refs"],
                   help="pipelined plans: how stages hand hidden states on: a Ray Compiled Graph (cgraph), Ray "
                        "object refs (refs), or auto: refs, the one measured faster (pipeline.choose_handoff says why)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most top alternatives a request may ask for per token (vLLM's --max-logprobs)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="request bodies larger than this are refused with 413 before they are parsed")
    p.add_argument("--num-replicas", type=int, default=None, help="model replicas (default 1)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for a Ray started here (default: all)")
    p.add_argument("--num-gpus", type=float, default=None, metavar="G",
                   help="GPUs each replica of a one-device model reserves (default: 1 where the Ray cluster has "
                        "GPUs, else 0; 0 keeps it on the CPU; a fraction shares a GPU between replicas). alpa/ "
                        "models reserve what their plan uses")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to use: an address, or 'local' to always start a private one (default: the "
                        "running cluster if there is one, else a new local one)")
    p.add_argument("--ray-nice", type=int, default=19, metavar="N",
                   help="with a Ray started by this command: the model replicas run at niceness 0 and Ray's "
                        "own processes (GCS, raylet, dashboard and log agents, Serve's controller, and its "
                        "proxy under direct ingress) at N, so that their periodic work does not preempt the "
                        "model's products; -1 keeps Ray's defaults (workers at 15, Ray's processes at 0)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--ingress", default="auto", choices=["auto", "direct", "proxy"],
                   help="direct: the replica itself answers on --port (Ray Serve's direct ingress, its "
                        "throughput-optimised mode), no proxy hop; proxy: Serve's HTTP proxy forwards to the "
                        "replicas. auto (default): direct for one replica on a Ray started here, else proxy")


def serve_args_from(args: argparse.Namespace):
    """The command line -> the application builder's `ServeArgs`."""
    keys = list(args.api_key) + list(Settings.from_env().api_keys)
    # absolute paths: the replica that reads them is another process, maybe in another folder
    path, tokenizer = (None if a is None else os.path.abspath(a) for a in (args.path, args.tokenizer))
    template = args.chat_template
    template = os.path.abspath(template) if template is not None and os.path.isfile(template) else template
    return ServeArgs(engine=args.engine, model=args.model, path=path, dummy=args.dummy, seed=args.seed,
                     tokenizer=tokenizer, dtype=args.dtype, quantize=args.quantize, prefill_chunk=args.prefill_chunk,
                     prefill_budget=args.prefill_budget, decode_steps=args.decode_steps,
                     prefix_caching=args.prefix_caching, engine_ahead=args.engine_ahead, warmup=args.warmup,
                     max_batch_size=args.max_batch_size,
                     max_seq_len=args.max_seq_len, max_queue=args.max_queue, request_timeout=args.request_timeout,
                     api_keys=keys, served_model_name=args.served_model_name,
                     num_replicas=args.num_replicas, num_gpus=args.num_gpus,
                     graceful_shutdown_timeout_s=args.drain_timeout,
                     tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                     device_memory=args.device_memory, micro_batches=args.micro_batches, handoff=args.handoff,
                     max_logprobs=args.max_logprobs, max_body_bytes=args.max_body_bytes, chat_template=template,
                     speculative_config=args.speculative_config, **lora_args.serve_args(args))


def check_args(serve_args) -> str | None:
    """What is wrong with the model arguments (None: nothing), found before Ray starts: the replica that
    loads the model would only report it as a failed deployment."""
    try:
        check_model_args(serve_args)
        if serve_args.chat_template is not None:
            load_chat_template(serve_args.chat_template)  # a missing file or a syntax error, before Ray starts
        if serve_args.tokenizer is not None:
            if not os.path.isdir(serve_args.tokenizer):
                return f"--tokenizer {serve_args.tokenizer}: no such folder"
            tok = load_tokenizer(serve_args.tokenizer)  # a missing or broken folder fails here, not in Ray
            if serve_args.dummy:
                vocab = get_config(serve_args.model).vocab_size
                if len(tok) > vocab:
                    return (f"--tokenizer {serve_args.tokenizer} has {len(tok)} tokens, more than "
                            f"{serve_args.model}'s {vocab}-token vocabulary")
    except (OSError, ValueError) as e:  # unknown size, bad combination, missing or broken tokenizer folder
        return str(e)
    return None


def command_line_problem(args: argparse.Namespace, serve_args) -> str | None:
    """What is wrong with the command line (None: nothing), found before Ray starts."""
    problem = check_args(serve_args)
    if problem:
        return problem
    if not -1 <= args.ray_nice <= 19:
        return f"--ray-nice must be a niceness from 0 to 19, or -1, got {args.ray_nice}"
    if args.ingress == "direct" and (args.num_replicas or 1) > 1:
        return "--ingress direct serves one replica on --port; use --ingress proxy for --num-replicas > 1"
    return None

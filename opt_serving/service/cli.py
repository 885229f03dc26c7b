"""`opt-serving serve`: run the HTTP service on Ray Serve, starting Ray locally if none is running.

Ctrl-C or SIGTERM: Serve stops taking requests, lets in-flight ones finish for up to
--drain-timeout seconds (then fails them), and the Ray processes this command started are stopped, so
nothing is left behind (metaseq's server needed `killall python`).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

from opt_serving.engine.admission import DECODE_STEPS, PREFILL_BUDGET, PREFILL_CHUNK
from opt_serving.config import get_config
from opt_serving.parallel import ray_address
from opt_serving.parallel.planner import NoFeasiblePlan
from opt_serving.service import lora_args
from opt_serving.service.deployment import ServeArgs, build_app, check_model_args
from opt_serving.service.ports import free_port
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
                   help=f"prompts with more than N tokens to compute are prefilled N at a time, between decode "
                        f"steps, so running streams keep their pace (default {PREFILL_CHUNK}; 0: whole prefills)")
    p.add_argument("--prefill-budget", type=int, default=None, metavar="T",
                   help=f"prompt tokens prefilled per engine iteration, whole prompts and chunks, oldest first "
                        f"(default {PREFILL_BUDGET}, vLLM's max_num_batched_tokens on CPUs); less: shorter pauses "
                        "of the running streams, longer waits for a first token under a burst of prompts")
    p.add_argument("--decode-steps", type=int, default=DECODE_STEPS, metavar="K",
                   help="decode steps taken in one call while no waiting request could take a free slot: "
                        "the host's work (dispatch, handing out tokens, streaming) is paid once for K tokens "
                        "of each stream, which arrive together; a newcomer waits at most K steps (1: off)")
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
    lora_args.add_arguments(p)
    _plan_and_ray_arguments(p)


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


def _start_ray(found, num_cpus: int | None, local_env: dict | None = None) -> bool:
    """Join `found` (ray_address.find_cluster's pick: a cluster that answers), or with none start a local Ray
    with `local_env` set for its processes. Returns True when we started it."""
    import ray
    if ray.is_initialized():
        return False
    if found.note:
        print(f"opt-serving serve: {found.note}; "
              + (f"joining the Ray cluster at {found.address}" if found.address else "starting a Ray of its own"),
              file=sys.stderr, flush=True)
    if found.address is not None:
        ray.init(address=found.address, log_to_driver=False)
        return False
    os.environ.update(local_env or {})  # Ray's processes (controller, replicas) inherit it from here
    ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, log_to_driver=False)
    return True


def port_holder(host: str, port: int) -> str | None:
    """None when `port` can be bound on `host`; else what holds it: the listening process (pid and command
    line) where it can be found, or a plain description."""
    bind_host = "" if host in ("0.0.0.0", "::") else host
    with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no holder
        try:
            s.bind((bind_host, port))
            return None
        except OSError as e:
            reason = e.strerror or str(e)
    try:
        import psutil
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                cmd = " ".join(psutil.Process(c.pid).cmdline())
                return f"process {c.pid} ({cmd[:160]})"
    except (psutil.Error, OSError):
        pass
    return f"another process ({reason})"


def direct_ingress_env(port: int, drain_s: float) -> dict:
    """Ray Serve's throughput-optimised mode (the replica runs the ASGI app on its own HTTP port,
    user code on the main loop, no proxy hop) with that port pinned to ours.
    A replica normally keeps answering 30 s after shutdown starts, for load balancers to notice;
    one machine has none, so it drains for --drain-timeout only.
    A replica's port is normally held out of the pool for 150 s after the replica stops (Ray Serve's
    RAY_SERVE_PORT_QUARANTINE_S: HAProxy's hard-stop-after, 120 s, + 30 s, so that a stale HAProxy worker
    cannot route one app's traffic to another app's replica on the same port). Here there is no HAProxy and
    the pool is the one port, so a replica replacing a dead one (SIGKILL, a failed health check) could not
    get --port for 150 s: every attempt would load the model, fail with NoAvailablePortError and be retried,
    the server refusing connections all the while."""
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # Serve's range excludes its maximum
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(max(drain_s, 0.1)),
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def replica_priority_env(ray_nice: int) -> dict:
    """Ray starts its workers at niceness 15 so that they yield to its own processes; a model replica
    that keeps every core busy then loses its cores to each of their wake-ups, and a product split
    across the cores waits for the slowest part. The replica starts at 0 instead (lower_ray_priority
    then sends Ray's own processes the other way)."""
    return {} if ray_nice < 0 else {"RAY_worker_niceness": "0"}


def lower_ray_priority(ray_nice: int, include_proxy: bool, procs=None) -> int:
    """Give the Ray processes this command started (`procs`, default: every descendant of this process),
    other than the model replicas and idle workers (a restarted replica may take one), niceness
    `ray_nice`, so that their periodic wake-ups do not take the replica's cores (benchmark/README.md has
    the measurements). Returns how many were changed."""
    if ray_nice < 0:
        return 0
    import psutil
    keep = ("ray::ServeReplica", "ray::IDLE") + (() if include_proxy else ("ray::ProxyActor",))
    changed = 0
    for proc in psutil.Process().children(recursive=True) if procs is None else procs:
        try:
            title = " ".join(proc.cmdline())
            if not title.startswith(keep) and proc.nice() < ray_nice:
                proc.nice(ray_nice)
                changed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or not ours to change
            continue
    return changed


def wants_direct_ingress(ingress: str, num_replicas: int | None) -> bool:
    """Direct ingress gives each replica its own port, so only one replica can own --port."""
    return ingress == "direct" or (ingress == "auto" and (num_replicas or 1) == 1)


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
                     prefix_caching=args.prefix_caching, max_batch_size=args.max_batch_size,
                     max_seq_len=args.max_seq_len, max_queue=args.max_queue, request_timeout=args.request_timeout,
                     api_keys=keys, served_model_name=args.served_model_name,
                     num_replicas=args.num_replicas, num_gpus=args.num_gpus,
                     graceful_shutdown_timeout_s=args.drain_timeout,
                     tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                     device_memory=args.device_memory, micro_batches=args.micro_batches, handoff=args.handoff,
                     max_logprobs=args.max_logprobs, max_body_bytes=args.max_body_bytes, chat_template=template,
                     **lora_args.serve_args(args))


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


def _command_line_problem(args: argparse.Namespace, serve_args) -> str | None:
    """What is wrong with the command line (None: nothing), found before Ray starts."""
    problem = check_args(serve_args)
    if problem:
        return problem
    if not -1 <= args.ray_nice <= 19:
        return f"--ray-nice must be a niceness from 0 to 19, or -1, got {args.ray_nice}"
    if args.ingress == "direct" and (args.num_replicas or 1) > 1:
        return "--ingress direct serves one replica on --port; use --ingress proxy for --num-replicas > 1"
    return None


def _banner(args: argparse.Namespace, serve_args, direct: bool) -> str:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    what = "the fake engine" if serve_args.engine == "fake" else (
        (serve_args.model or "the embedded tiny model") + (" (random weights)" if serve_args.dummy else ""))
    return (f"opt-serving: serving {what} at http://{host}:{args.port}/ "
            f"(OpenAI base_url http://{host}:{args.port}/v1; {'direct ingress' if direct else 'Serve proxy'}); "
            "Ctrl-C to stop")


def _stop_serving(started_ray: bool, deployed: str | None, timeout_s: float) -> bool:
    """Stop what this command started: with a Ray it started, Serve and that Ray; on someone else's cluster
    only the application it deployed (`deployed`, its name), then disconnect. Bounded by `timeout_s`, and
    with a cluster that has gone (its GCS does not answer) the Serve calls, which would retry for a minute,
    are skipped. Returns False when it did not finish in time."""
    import ray

    if not ray.is_initialized():
        return True
    try:
        alive = ray_address.answers(ray.get_runtime_context().gcs_address, timeout_s=1.0)
    except Exception:
        alive = False

    def stop() -> None:
        if alive:
            from ray import serve
            if started_ray:
                serve.shutdown()
            elif deployed is not None:  # someone else's cluster: remove only our application
                serve.delete(deployed)
        ray.shutdown()  # stops the processes we started; merely disconnects otherwise

    done = threading.Event()

    def guarded() -> None:
        try:
            stop()
        except Exception as e:  # a cluster going away under us: nothing more to stop there
            print(f"opt-serving: while stopping: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            done.set()

    threading.Thread(target=guarded, daemon=True, name="opt-serving-stop").start()
    if not alive:
        print("opt-serving: the Ray cluster has gone; nothing left to stop there", file=sys.stderr, flush=True)
    return done.wait(timeout_s if alive else min(timeout_s, 5.0))


def _local_ray_env(args: argparse.Namespace, direct: bool) -> dict:
    """Environment for the processes of a Ray started here (an existing cluster keeps its own)."""
    local_env = replica_priority_env(args.ray_nice)
    if direct:
        local_env.update(direct_ingress_env(args.port, args.drain_timeout))
    return local_env


APP_NAME = "opt"


def _deploy(args: argparse.Namespace, serve_args, direct: bool, started_ray: bool) -> tuple[str | None, str | None]:
    """Start Serve on the Ray just joined and run the application on it -> (the name of the application
    deployed, None) or (None, why not): the planner finds no plan that fits an alpa/ model on the cluster, or
    a cluster this command did not start already runs Serve elsewhere than --port or an application of our
    name (never replaced), or Serve refuses the application."""
    from ray import serve  # after Ray started: Serve reads its settings when imported

    # with direct ingress Serve still starts its proxy: it gets a spare port, the replica owns --port
    serve.start(http_options={"host": args.host, "port": free_port() if direct else args.port})
    if not started_ray:
        problem = _foreign_serve_problem(args)
        if problem:
            return None, problem
    try:
        app = build_app(serve_args)  # plans alpa/ models for the cluster just joined
    except NoFeasiblePlan as e:
        return None, str(e)
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except Exception as e:  # e.g. another application holds the route prefix "/", or a replica failed to start
        return None, (f"Ray Serve on the cluster at {_cluster_address()} refused the application: {e}"
                      + _deployment_messages(APP_NAME))
    return APP_NAME, None


def _deployment_messages(name: str) -> str:
    """What Serve says of the application's deployments that are not running (a replica's constructor's error,
    with its traceback), to print beside Serve's one-line refusal; "" where it says nothing more."""
    from ray import serve
    try:
        app = serve.status().applications.get(name)
    except Exception:  # the controller gone with the failure: the refusal is all there is
        return ""
    if app is None:
        return ""
    said = [f"{d}: {s.message}" for d, s in app.deployments.items() if s.message and s.status != "HEALTHY"]
    return "".join(f"\n  {m}" for m in said)


def _cluster_address() -> str:
    import ray
    return ray.get_runtime_context().gcs_address


def _foreign_serve_problem(args: argparse.Namespace) -> str | None:
    """On a cluster this command did not start: why it cannot serve there (None: it can). Serve keeps the HTTP
    settings it first started with, so a Serve already running on another port would leave --port
    unanswered; an application of our name there is someone else's."""
    from ray import serve
    from ray.serve.context import _get_global_client
    where, http = _cluster_address(), _get_global_client().http_config
    if http.port != args.port or http.host != args.host:
        return (f"Ray Serve already runs on the Ray cluster at {where}, its HTTP proxy on {http.host}:{http.port}, "
                f"and keeps that: this command cannot serve on {args.host}:{args.port} there. Use --host "
                f"{http.host} --port {http.port} to serve beside its applications, or --ray-address local for a "
                "Ray of this command's own")
    if APP_NAME in serve.status().applications:
        return (f"the Ray cluster at {where} already runs a Serve application named '{APP_NAME}' that this "
                "command did not deploy: it is left as it is. Stop it there (`serve shutdown`, or the program "
                "that deployed it), or use --ray-address local for a Ray of this command's own")
    return None


def _answers(url: str, timeout_s: float) -> bool:
    """Whether an HTTP server answers at `url` (any status) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return True
        except urllib.error.HTTPError:  # an answer, if not a 200 (a health check failing, an API key)
            return True
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    serve_args = serve_args_from(args)
    problem = _command_line_problem(args, serve_args)
    if problem:
        print(f"opt-serving serve: {problem}", file=sys.stderr)
        return 2
    try:
        found = ray_address.find_cluster(args.ray_address)
    except ConnectionError as e:
        print(f"opt-serving serve: {e}", file=sys.stderr)
        return 2
    if found.address is None:  # a Ray of our own will serve on --port: it must be free
        holder = port_holder(args.host, args.port)
        if holder:
            print(f"opt-serving serve: --port {args.port} on {args.host} is taken by {holder}; stop that, or "
                  "choose another --port", file=sys.stderr)
            return 2
    direct = wants_direct_ingress(args.ingress, args.num_replicas)
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}

    def take_signals() -> None:
        # Ctrl-C / SIGTERM only set `stop`; the shutdown below runs in the main thread. Taken again after
        # ray.init, which installs a SIGTERM handler that exits without stopping the processes it started.
        for s in signals:
            signal.signal(s, lambda *_: stop.set())

    take_signals()
    started_ray, deployed, code = False, None, 1
    try:
        started_ray = _start_ray(found, args.num_cpus, _local_ray_env(args, direct))
        take_signals()
        if stop.is_set():
            code = 130
            return code
        if direct and not started_ray:  # a cluster started elsewhere keeps its own Serve settings
            if args.ingress == "direct":
                print("opt-serving serve: --ingress direct needs a Ray started by this command "
                      "(--ray-address local)", file=sys.stderr)
                code = 2
                return code
            direct = False
        deployed, problem = _deploy(args, serve_args, direct, started_ray)
        if problem:
            print(f"opt-serving serve: {problem}", file=sys.stderr)
            code = 2
            return code
        take_signals()
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        if not _answers(f"http://{host}:{args.port}/health", timeout_s=60):
            print(f"opt-serving serve: the application is running but nothing answers at http://{host}:"
                  f"{args.port}/ ({'its replica' if direct else 'Serve proxy'} did not bind it); stopping",
                  file=sys.stderr)
            code = 1
            return code
        if started_ray:  # the replicas are up: every other process Ray started is running by now
            lower_ray_priority(args.ray_nice, include_proxy=direct)
        print(_banner(args, serve_args, direct), flush=True)
        stop.wait()
        print("opt-serving: shutting down (draining in-flight requests)", file=sys.stderr, flush=True)
        code = 0
        return code
    finally:
        # second Ctrl-C while draining should not leave a half-stopped cluster: ignore it
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        try:
            finished = _stop_serving(started_ray, deployed, timeout_s=args.drain_timeout + 30)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        if not finished:  # Ray's own exit handlers would wait on the same gone cluster
            print("opt-serving: stopping did not finish in time; exiting", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(code)

"""The Ray Serve deployment: `build_app(args)` is the application builder behind
`serve run opt_serving.service:app model=... path=...` and `opt-serving serve`. Each replica builds its
generator (`build_generator`) and serves `app.create_app` over it.
"""
from __future__ import annotations

import gc
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator

from opt_serving import jax_env, startlog
from opt_serving.config import SpeculativeConfig
from opt_serving.engine.admission import DECODE_STEPS, PREFILL_CHUNK
from opt_serving.text.fake import fake_generator
from opt_serving.text.loading import check_model_args as check_model_names
from opt_serving.text.loading import load_generator
from opt_serving.parallel.placement import never_placed, stage_bundles
from opt_serving.service import lora_args
from opt_serving.service import protocol as P
from opt_serving.service.app import create_app
from opt_serving.service.limits import DEFAULT_MAX_BODY_BYTES
from opt_serving.spec import ModelSpec, is_parallel
from opt_serving.text.chat import load_chat_template


class ServeArgs(BaseModel):
    """Arguments of the application builder (`serve run opt_serving.service:app model=... path=...`);
    strings from the command line are converted (lax mode). An argument not listed here is an error
    naming it (a misspelt `pipeline_paralel` never leaves a deployment silently unpipelined)."""
    model_config = ConfigDict(extra="forbid")

    # model: the named model's weights (below). fake: the hand-checkable fake engine
    # (opt_serving/engine/fake.py), for tests and demos of the HTTP side; it takes no model arguments
    engine: Literal["model", "fake"] = "model"
    fake_step_s: NonNegativeFloat = 0.0  # the fake engine's decode step time (a request in flight for a known while)
    model: Optional[str] = None          # None: the embedded tiny model
    path: Optional[str] = None
    dummy: bool = False                  # random weights of the named size (no path)
    seed: int = 0                        # of the random weights
    tokenizer: Optional[str] = None      # tokenizer folder, instead of the weights folder's / the embedded one
    dtype: str = "auto"                  # float16 on GPUs, float32 on CPUs
    quantize: Optional[Literal["int8"]] = None  # int8 weights, a scale per output channel (model/quantize.py)
    max_batch_size: int = 16
    max_seq_len: Optional[int] = None
    max_queue: int = 256
    prefill_chunk: NonNegativeInt = PREFILL_CHUNK  # prompts longer than this: prefilled this many tokens a step (0: whole)
    prefill_budget: Optional[PositiveInt] = None  # prompt tokens an iteration, whole and chunks (None: 2048)
    decode_steps: PositiveInt = DECODE_STEPS  # decode steps in one call while nobody waits for a slot
    prefix_caching: bool = True          # keep prompts' KV for later prompts that start the same way
    engine_ahead: bool = False           # send each call of several steps before the one in flight is read (GPUs)
    # compile what generation runs before the replica serves ("all": every shape, the prefills only scored prompts
    # run too; False: each at its first use, a start in seconds and a first request of each new shape that waits
    # for its compile)
    warmup: Union[bool, Literal["all"]] = True
    request_timeout: float = 600.0
    api_keys: list[str] | str = []       # a list, or comma separated
    # the names requests may call the model by (vLLM's --served-model-name; a list, or comma separated); the
    # first is the one answers give. None: the model's name
    served_model_name: list[str] | str | None = None
    num_replicas: Optional[int] = None  # None: 1, or what serve_config.yaml's autoscaling_config decides
    num_cpus: float = 1.0                # per replica
    # GPUs per replica of a one-device model; None: one where the cluster has GPUs, else none (alpa/ plans
    # reserve their own: --tensor-parallel, --pipeline-parallel)
    num_gpus: Optional[float] = Field(default=None, ge=0)
    graceful_shutdown_timeout_s: float = 10.0
    # alpa/ models: the plan (left out: the planner's choice for the Ray cluster)
    tensor_parallel: Optional[int] = None
    pipeline_parallel: Optional[int] = None
    device_memory: Optional[str] = None  # what each device may hold ("16GB"): CPU nodes, GPUs Ray does not name
    micro_batches: Optional[int] = None  # decode slot groups of a pipelined plan (default pp)
    # how pipeline stages hand hidden states on: a Ray Compiled Graph (one node) or object refs (parallel/pipeline.py)
    handoff: Literal["auto", "cgraph", "refs"] = "auto"
    health_check_period_s: float = 5.0
    max_logprobs: int = P.MAX_LOGPROBS   # vLLM's --max-logprobs
    # /v1/chat/completions' Jinja template: a file (read by each replica), or the template itself; None: the
    # tokenizer's own (OPT has none: chat requests are then a 400 naming --chat-template)
    chat_template: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # LoRA adapters (service/lora_args.py: vLLM's flags): adapters served as models a request may name
    enable_lora: bool = False
    lora_modules: list[str] | str = []   # name=path (or JSON), a list or comma separated
    max_loras: Optional[int] = None      # on the device at once (None: as many as lora_modules, at least 1)
    max_lora_rank: int = 16
    lora_target_modules: list[str] | str | None = None  # None: those of lora_modules, or every linear layer
    enable_lora_runtime_updates: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    # served speculative decoding (vLLM's --speculative-config): a dict (serve_config.yaml) or its JSON (`serve run
    # ... speculative_config='{...}'`), prompt lookup or a draft model; checked here, kept as the dict (None: off)
    speculative_config: dict | str | None = None

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _check_speculative_config(cls, value):
        """config.SpeculativeConfig.parse's errors (each names speculative_config, a value of another type too)
        when the arguments are made, before anything loads; the config's dict (every key spelt out) or None."""
        config = SpeculativeConfig.parse(value)
        return None if config is None else config.as_dict()

    def key_list(self) -> list[str]:
        keys = self.api_keys.split(",") if isinstance(self.api_keys, str) else self.api_keys
        return [k.strip() for k in keys if k.strip()]

    def model_names(self) -> list[str]:
        """The served model names (none given: the model's own name, or the generator's for the embedded one)."""
        names = self.served_model_name or []
        names = names.split(",") if isinstance(names, str) else names
        return [n.strip() for n in names if n.strip()] or [n for n in (self.model,) if n]

    def lora_options(self):
        """The LoRA adapters served (model/lora_config.py's LoraOptions), or None; ValueError naming the flag."""
        return lora_args.options(self.enable_lora, self.lora_modules, self.max_loras, self.max_lora_rank,
                                 self.lora_target_modules, self.enable_lora_runtime_updates)

    def speculative(self) -> Optional[SpeculativeConfig]:
        """The served speculative decoding (config.SpeculativeConfig), or None."""
        return SpeculativeConfig.parse(self.speculative_config)

    def plan_args(self) -> dict:
        """What load_engine takes about the plan (alpa/ models only)."""
        if not is_parallel(self.model):
            return {}
        return dict(tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel,
                    device_memory=self.device_memory, micro_batches=self.micro_batches, handoff=self.handoff)


def check_model_args(args: ServeArgs) -> None:
    """The model arguments' own errors (ValueError, naming the builder argument and the CLI flag), found
    before anything loads or Ray starts."""
    if args.engine == "fake":
        if args.path is not None or args.dummy or args.tokenizer is not None:
            raise ValueError("the fake engine (--engine fake) takes no weights or tokenizer (--path, --dummy, "
                             "--tokenizer)")
        if args.lora_options() is not None:
            raise ValueError("the fake engine (--engine fake) serves no LoRA adapters")
        if args.speculative_config is not None:
            raise ValueError("the fake engine (--engine fake) does not speculate (speculative_config, "
                             "--speculative-config)")
        return
    if args.fake_step_s:
        raise ValueError("fake_step_s goes with the fake engine (engine: fake)")
    check_model_names(args.model, args.path, args.dummy, args.tokenizer)
    args.lora_options()


def build_generator(args: ServeArgs):
    """The generator a replica serves: the named model from `path` (or random weights of its size with
    `dummy`), the embedded tiny one (neither), or the fake engine."""
    check_model_args(args)
    if args.engine == "fake":
        return fake_generator(num_slots=args.max_batch_size, max_seq_len=args.max_seq_len or 256,
                              max_queue=args.max_queue, step_s=args.fake_step_s)
    return load_generator(args.model, args.path, dtype=args.dtype, max_batch_size=args.max_batch_size,
                          max_seq_len=args.max_seq_len, max_queue=args.max_queue, dummy=args.dummy, seed=args.seed,
                          tokenizer=args.tokenizer, quantize=args.quantize, prefill_chunk=args.prefill_chunk,
                          prefill_budget=args.prefill_budget, decode_steps=args.decode_steps,
                          prefix_caching=args.prefix_caching, warmup=args.warmup, lora=args.lora_options(),
                          ahead=args.engine_ahead,
                          speculative=args.speculative(), **args.plan_args())


def placement(args: ServeArgs) -> dict:
    """Deployment options from the plan, for every model kind: the Ray resources the replica reserves and the
    JAX device settings of the processes that run the model (jax_env).

    A one-device model (jax/, facebook/, the embedded one) reserves a GPU where the cluster has GPUs (`num_gpus`
    overrides: 0 keeps it on the CPU, a fraction shares a GPU between replicas). An `alpa/` model is planned here,
    for the Ray cluster this process joins (address="auto"; one is started when none runs, as `serve run` would),
    and the replica's placement group holds what the plan needs: its own bundle (with the plan's tp GPUs when
    pp = 1), or one bundle per pipeline stage with the replica in the first, so the stages belong to the replica
    and live and die with it. The plan's degrees go to the replica, which plans its layer split for the same
    cluster."""
    if args.engine == "fake":  # no model, no JAX
        return {"ray_actor_options": {"num_cpus": args.num_cpus}}
    if not is_parallel(args.model):
        have = cluster_gpus()
        gpus = args.num_gpus if args.num_gpus is not None else (1.0 if have > 0 else 0.0)
        if gpus > have:
            raise ValueError(f"num_gpus (--num-gpus) {gpus:g}: the Ray cluster has {have:g} GPUs")
        return {"ray_actor_options": _actor_options(args.num_cpus, gpus, _jax_env(gpus) if have else {})}
    if args.num_gpus is not None:
        raise ValueError("num_gpus (--num-gpus) is for one-device models; an alpa/ model's plan reserves its "
                         "GPUs (--tensor-parallel, --pipeline-parallel)")
    # JAX and the planner are imported only for an alpa/ model's plan: a one-device or fake deployment's
    # process (the `serve` command's) never loads them
    from opt_serving.parallel import backend
    from opt_serving.runner.load import resolve_dtype
    args.dtype = resolve_dtype(args.dtype, cluster=True)  # the cluster's GPUs decide "auto", not this process's
    # the plan needs only the config: the folder's, or the preset's when there is no folder (yet)
    spec = ModelSpec.parse(args.model, args.path, dummy=args.dummy or args.path is None,
                           tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                           quantize=args.quantize)
    plan, _, _ = backend.plan_model(spec, args.dtype, device_memory=args.device_memory,
                                    batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    args.tensor_parallel, args.pipeline_parallel = plan.tp, plan.pp
    gpus = cluster_gpus() > 0
    if plan.pp == 1:
        if not gpus:  # CPU: the replica's process makes its own tp host devices
            env = jax_env.host_devices(plan.tp) if plan.tp > 1 else {}
            return {"ray_actor_options": _actor_options(args.num_cpus, 0, env)}
        return {"ray_actor_options": _actor_options(args.num_cpus, plan.tp, _jax_env(plan.tp)),
                "placement_group_bundles": [{"CPU": args.num_cpus, "GPU": float(plan.tp)}],
                "placement_group_strategy": "STRICT_PACK"}
    # one bundle per stage, the replica in stage 0's (a bundle lies on one node, so a stage's tp devices
    # do too); CPU nodes are the planner's devices: one stage a node where there are enough of them. The
    # replica only drives the stages (each holds its own GPUs' share): it needs no GPU
    bundles, strategy = stage_bundles(plan, gpus, extra_cpus=args.num_cpus)
    import ray
    never = never_placed(bundles, strategy, ray.nodes())
    if never:  # refused now: Serve would wait for the placement group for ever
        raise ValueError(f"the plan's {plan.pp} stages ({bundles}, {strategy}) cannot be placed: {never}")
    return {"ray_actor_options": _actor_options(args.num_cpus, 0, _jax_env(0) if gpus else {}),
            "placement_group_bundles": bundles, "placement_group_strategy": strategy}


def _actor_options(num_cpus: float, num_gpus: float, env: dict) -> dict:
    """A replica's ray_actor_options: its CPUs, its GPUs and the environment of its process; no key for none."""
    options: dict = {"num_cpus": num_cpus}
    if num_gpus:
        options["num_gpus"] = num_gpus
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


def _jax_env(gpus: float) -> dict:
    """The JAX settings of a replica that runs the model on `gpus` GPUs (a user's own values, in this process's
    environment, win)."""
    return jax_env.keep_users(jax_env.runs_model(gpus))


def cluster_gpus() -> float:
    """GPUs of the Ray cluster this process is connected to; before it is (`serve run` builds the application
    before it joins Ray), this machine's, as Ray counts them."""
    import ray
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0))
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource
        return float(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators())
    except (ImportError, AttributeError):  # another Ray's internals
        return 0.0


class _ReuseAddrSockets:
    """The `socket` module, except that the sockets it makes have SO_REUSEADDR set (see below)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def socket(self, *args, **kwargs):
        sock = self._module.socket(*args, **kwargs)
        sock.setsockopt(self._module.SOL_SOCKET, self._module.SO_REUSEADDR, 1)
        return sock


def reuse_replica_port_after_crash() -> bool:
    """Under direct ingress the replica binds its HTTP port itself (Ray Serve's
    `http_util.start_asgi_http_server`, the only socket that module makes), without SO_REUSEADDR. When a
    replica dies with connections open (SIGKILL, OOM), the kernel closes them and each lingers in TIME_WAIT
    on that port for 60 s; until then the replacement's bind fails (EADDRINUSE), Serve gives up on it and
    starts another, which loads the model again, and the deployment stays down for that whole minute.
    SO_REUSEADDR, which uvicorn sets on its own sockets, lets the bind pass TIME_WAIT connections and still
    fails while another process listens on the port. Called in the replica's process, before Serve binds.
    Returns False where Serve's module is not there to adjust."""
    try:
        from ray.serve._private import http_util
    except ImportError:
        return False
    if not isinstance(http_util.socket, _ReuseAddrSockets):
        http_util.socket = _ReuseAddrSockets(http_util.socket)
    return True


def build_app(args: ServeArgs | dict | None = None):
    """Ray Serve application builder: `opt_serving.service:app`."""
    from ray import serve

    args = args if isinstance(args, ServeArgs) else ServeArgs(**(args or {}))

    @serve.ingress()
    class OPTServer:
        def __init__(self, serve_args: dict):
            reuse_replica_port_after_crash()  # before Serve binds the port, after this constructor
            self.args = ServeArgs(**serve_args)
            # (the template first: a file this replica cannot read fails it before the model loads)
            self.chat_template = None if self.args.chat_template is None else load_chat_template(
                self.args.chat_template)
            with startlog.PHASES.phase("the replica's generator (all the above)"):
                self.generator = build_generator(self.args)
            # what is loaded by now (the model, its compiled steps, Ray, FastAPI) lives as long as the replica:
            # frozen, a full collection no longer walks it while holding the GIL, stalling the engine's steps
            # and every stream
            gc.collect()
            gc.freeze()

        def __serve_build_asgi_app__(self):
            return create_app(self.generator, model_name=self.args.model_names(), api_keys=self.args.key_list(),
                              request_timeout=self.args.request_timeout, close_generator=True,
                              max_logprobs=self.args.max_logprobs, max_body_bytes=self.args.max_body_bytes,
                              chat_template=self.chat_template,
                              lora_runtime_updates=self.args.enable_lora_runtime_updates)

        def start_phases(self) -> list[dict]:
            """Where this replica's start went (startlog.py), for `opt-serving serve` to print."""
            return startlog.PHASES.as_dicts()

        def check_health(self):
            """Serve replaces the replica when this raises: a dead or stuck engine, a dead pipeline stage."""
            self.generator.check_health()

    replicas = {} if args.num_replicas is None else {"num_replicas": args.num_replicas}
    options = placement(args)  # plans alpa/ models, fixing their degrees in args
    deployment = serve.deployment(
        OPTServer, name="OPTServer", **replicas,
        # every waiting request must reach the engine's own bounded queue (which answers 429), not Serve's
        max_ongoing_requests=args.max_queue + args.max_batch_size,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        health_check_period_s=args.health_check_period_s, **options)
    return deployment.bind(args.model_dump())

"""Measured decode-step times of pipeline stages at each tensor-parallel degree.

Alpa profiled candidate stages rather than trusting an analytic model; this does the same
for the devices this process sees. For each tp degree it jits `runner.stage.StageSlots` decode steps
over a mesh of tp local devices (the code pp > 1 plans run) and times:

    middle stages of 1, 4 and all layers -> a stage of n layers, interpolated between them
                                            (measured, not assumed linear: on a CPU a
                                            12-layer step cost 4x a 4-layer one at tp 1)
    a first stage of 1 layer             -> the embeddings (less the 1-layer middle stage)
    a last stage of 1 layer              -> final LN + tied logits + gather

All steps are built first, then timed in interleaved rounds and summarised by medians: on
a shared machine the load drifts, and interleaving spreads the drift over every variant.
`cost.stage_time` uses a profile when one matches the model, batch, context and dtype;
the roofline stays for dry runs of clusters this process does not have.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from opt_serving import jax_env
from opt_serving.config import OPTConfig

def model_key(cfg: OPTConfig) -> tuple[int, ...]:
    """What a layer's and the head's cost depends on (not the number of layers)."""
    return (cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads, cfg.vocab_size,
            cfg.word_embed_proj_dim)


def variants(depths: tuple[int, ...]) -> list[tuple[int, bool, bool]]:
    """(layers, first, last) of the stages timed per tp: middle stages at every depth, and
    a first and a last stage at the shallowest."""
    return [(n, False, False) for n in depths] + [(depths[0], True, False), (depths[0], False, True)]


@dataclasses.dataclass(frozen=True)
class TpTimes:
    """Seconds for one decode step of one stage on a tp group; all-reduces included."""
    middle_s: tuple[tuple[int, float], ...]  # (layers, seconds) of middle stages, layers ascending
    embed_s: float       # token + position embedding (the first stage)
    head_s: float        # final layer norm + logits + gather (the last stage)
    spread: float        # largest relative interquartile range of the samples behind these

    def middle(self, n_layers: int) -> float:
        """A middle stage of n layers: piecewise linear through the measured depths (a step's
        cost need not be linear in its layers: caches and threads change with its size)."""
        ns, ts = zip(*self.middle_s)
        if len(ns) == 1:
            return ts[0] * n_layers / ns[0]
        # the segment holding n; the end segments extend past the measured depths
        i = int(np.clip(np.searchsorted(ns, n_layers) - 1, 0, len(ns) - 2))
        slope = (ts[i + 1] - ts[i]) / (ns[i + 1] - ns[i])
        return max(0.0, ts[i] + (n_layers - ns[i]) * slope)

    @property
    def layer_s(self) -> float:
        """Average seconds per layer between the shallowest and deepest stage measured."""
        (n0, t0), (n1, t1) = self.middle_s[0], self.middle_s[-1]
        return (t1 - t0) / (n1 - n0) if n1 > n0 else t0 / n0

    @property
    def dispatch_s(self) -> float:
        """The fixed part of a stage step: the shallowest stages' times extended to 0 layers."""
        return min(self.middle(0), self.middle_s[0][1])

    def stage_s(self, n_layers: int, first: bool, last: bool) -> float:
        return self.middle(n_layers) + first * self.embed_s + last * self.head_s


@dataclasses.dataclass(frozen=True)
class DecodeProfile:
    model: tuple[int, ...]                  # model_key() of the profiled config
    batch: int
    context: int                            # KV cache length
    dtype: str
    by_tp: tuple[tuple[int, TpTimes], ...]  # (tp, times), tp ascending, in this process
    # the same measured inside Ray stage actors (tp host devices each), as pp > 1 runs them
    stage_by_tp: tuple[tuple[int, TpTimes], ...] = ()

    def times(self, cfg: OPTConfig, tp: int, batch: int, tokens: int, context: int,
              dtype: str, pipelined: bool = False) -> TpTimes | None:
        """The measured times for this stage shape, or None when it was not profiled."""
        if (tokens != 1 or batch != self.batch or context != self.context or dtype != self.dtype
                or model_key(cfg) != self.model):
            return None
        if pipelined and tp in dict(self.stage_by_tp):
            return dict(self.stage_by_tp)[tp]
        return dict(self.by_tp).get(tp)

    @property
    def tps(self) -> list[int]:
        return [tp for tp, _ in self.by_tp]


def derive(samples: dict, depths: tuple[int, ...]) -> tuple[tuple[int, TpTimes], ...]:
    """Per-stage samples, keyed (tp, layers, first, last) -> (tp, times) from their medians."""
    medians = {k: float(np.median(t)) for k, t in samples.items()}
    spreads = {k: float(np.subtract(*np.percentile(t, [75, 25])) / max(medians[k], 1e-12))
               for k, t in samples.items()}
    n0 = depths[0]
    out = []
    for tp in sorted({k[0] for k in medians}):
        mid = medians[tp, n0, False, False]
        # more layers never run faster: a dip is noise, so the times only rise with depth
        rising = np.maximum.accumulate([medians[tp, n, False, False] for n in depths])
        out.append((tp, TpTimes(
            middle_s=tuple((n, float(t)) for n, t in zip(depths, rising)),
            embed_s=max(0.0, medians[tp, n0, True, False] - mid),
            head_s=max(0.0, medians[tp, n0, False, True] - mid),
            spread=max(spreads[(tp, *v)] for v in variants(depths)))))
    return tuple(out)


def time_interleaved(steps: dict, rounds: int, repeats: int,
                     clock: Callable[[], float] = time.perf_counter) -> dict:
    """Every step's per-call times, `repeats` calls per step per round, steps taking turns."""
    samples = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            for _ in range(repeats):
                t0 = clock()
                step()
                samples[k].append(clock() - t0)
    return samples


def _stage_steps(cfg: OPTConfig, tp: int, depths: tuple[int, ...], batch: int, context: int,
                 dtype: str) -> dict[tuple[int, bool, bool], Callable[[], None]]:
    """The jitted stage steps of `variants(depths)` for one tp degree, compiled and warmed: the stage
    code a pipeline runs (runner.stage.StageSlots over opt.StageSpec), one decode of `batch` rows."""
    import jax
    import jax.numpy as jnp
    from opt_serving.model import opt, param_tree
    from opt_serving.runner.stage import StageSlots
    dt = jnp.dtype(dtype)
    params = param_tree.init_params(cfg.replace(num_hidden_layers=max(depths)), 0, dt)
    tokens = np.full((batch,), 5, np.int32)
    hidden = np.zeros((batch, cfg.hidden_size), dt)
    where = np.full((batch,), context // 2, np.int32)   # position and cache slot written
    if tp > 1:  # the whole model's Megatron shardings; a stage's params cut from them keep theirs
        from opt_serving.parallel.sharding import make_mesh, shard_params
        params = shard_params(params, cfg.replace(num_hidden_layers=max(depths)), make_mesh(jax.devices()[:tp], tp))
    steps = {}
    for n, first, last in variants(depths):
        spec = opt.StageSpec(0, n, first, last)
        part = param_tree.stage_params(params, spec)
        stage = StageSlots(cfg, part, spec, rows=batch, max_seq_len=context)
        stage.seq_open(0, batch, context)
        x = tokens if first else hidden

        def step(stage=stage, x=x):
            jax.block_until_ready(stage.seq_decode(0, x, where, where))
        step()                                           # compile and warm
        steps[n, first, last] = step
    return steps


def default_depths(cfg: OPTConfig) -> tuple[int, ...]:
    """One layer, a few, and the whole model (what a pp = 1 plan runs)."""
    return tuple(sorted({1, min(4, cfg.num_hidden_layers), cfg.num_hidden_layers}))


def profile_decode(cfg: OPTConfig, tps: list[int] | None = None, *, batch: int = 1,
                   context: int = 256, dtype: str = "float32",
                   depths: tuple[int, ...] | None = None, rounds: int = 15, repeats: int = 3,
                   make_steps: Callable[..., dict] | None = None,
                   clock: Callable[[], float] = time.perf_counter,
                   stage_actors: bool = False) -> DecodeProfile:
    """Measure decode-step times of `cfg`'s stages at each tp degree on the local devices.

    tps: the degrees to profile (default: every power of two up to the device count that
    divides heads and ffn). depths: the middle-stage depths timed (default: 1, 4 and all
    layers). `make_steps(cfg, tp, depths, batch, context, dtype)` -> {(layers, first, last):
    step} and `clock` can be replaced (tests inject fake steps and a fake clock).
    stage_actors: also time the stages inside Ray actors set up as pipeline stages are
    (needs ray.init()); pp > 1 plans are then costed from those.
    """
    depths = tuple(sorted(set(depths or default_depths(cfg))))
    if depths[0] < 1 or depths[-1] > cfg.num_hidden_layers:
        raise ValueError(f"stage depths {depths} must lie in 1..{cfg.num_hidden_layers} "
                         f"(the model's layers)")
    if tps is None:
        import jax
        n = len(jax.devices())
        tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= n
               and cfg.num_attention_heads % t == 0 and cfg.ffn_dim % t == 0]
    make_steps = make_steps or _stage_steps
    steps = {}
    for tp in tps:
        for v, step in make_steps(cfg, tp, depths, batch, context, dtype).items():
            steps[(tp, *v)] = step
    samples = time_interleaved(steps, rounds, repeats, clock)
    staged = ()
    if stage_actors:
        staged = derive(_actor_samples(cfg, tps, depths, batch, context, dtype, rounds, repeats),
                        depths)
    return DecodeProfile(model_key(cfg), batch, context, dtype, derive(samples, depths), staged)


class _ProfileActor:
    """A process set up as a pipeline stage's (tp host devices), running stage steps."""

    def __init__(self, cfg, tp, depths, batch, context, dtype):
        self.steps = _stage_steps(cfg, tp, depths, batch, context, dtype)

    def keys(self) -> list:
        return list(self.steps)

    def run(self, key) -> None:
        self.steps[key]()

    def ping(self) -> None:
        pass


def _actor_samples(cfg: OPTConfig, tps, depths, batch, context, dtype, rounds, repeats) -> dict:
    """Stage samples measured in Ray actors made like `pipeline.RayStages`' CPU stages. Each
    step is one call from here, as a pipeline's stages are driven: an actor idles between
    its calls, every actor and step taking turns. The round trip of an empty call, taken
    in the same turns, is subtracted: the planner adds the hops itself. Needs ray.init()."""
    import ray
    actors = {}
    for tp in tps:
        env = {"env_vars": {**jax_env.host_devices(tp), "JAX_PLATFORMS": "cpu"}}
        actors[tp] = ray.remote(_ProfileActor).options(num_cpus=1, runtime_env=env).remote(
            cfg, tp, depths, batch, context, dtype)
    try:
        calls = {}
        for tp, actor in actors.items():
            for key in ray.get(actor.keys.remote()):
                calls[(tp, *key)] = lambda a=actor, k=key: ray.get(a.run.remote(k))
            calls[tp, "ping"] = lambda a=actor: ray.get(a.ping.remote())
        samples = time_interleaved(calls, rounds, repeats)
        hop = {tp: float(np.median(samples.pop((tp, "ping")))) for tp in actors}
        return {k: [max(0.0, t - hop[k[0]]) for t in v] for k, v in samples.items()}
    finally:
        for actor in actors.values():
            ray.kill(actor)

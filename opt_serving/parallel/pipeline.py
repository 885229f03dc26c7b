"""Pipeline parallelism: contiguous layer slices in Ray actors, hidden states handed on by ref.

A stage runs MODEL's own modules (`opt.DecoderLayer`, its embeddings and layer norm) over
its slice of layers, as pure jitted steps: (params, cache slice, hidden or ids) -> (hidden
or logits, cache slice). The first stage embeds, the last applies the final layer norm and
the tied logits (it holds its own copy of embed_tokens). Actors are placed by a placement
group with one bundle per stage; the driver chains `stage.step.remote(ref)` calls, so
several micro-batches can be in flight at once: each stage works on the next micro-batch
while later stages finish the previous one.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.config import OPTConfig
from opt_serving.model import opt
from opt_serving.model.kv_cache import init_cache, reorder
from opt_serving.model.weights import flax_path, global_param_shapes, layer_param_shapes, load_checked


class StageDied(RuntimeError):
    """A pipeline stage's actor is gone; rebuild the model (a new get_model call)."""


# ---- one stage, pure ----

def _embed(cfg, params, input_ids, positions):
    dt = params["embed_tokens"]["embedding"].dtype
    h = jnp.take(params["embed_tokens"]["embedding"], input_ids, axis=0)  # [B, S, word_embed]
    if cfg.has_project_in_out:
        h = h @ params["project_in"]["kernel"]
    pos = jnp.take(params["embed_positions"]["embedding"], positions + cfg.position_offset, axis=0)
    return (h + pos).astype(dt)


def _head(cfg, params, h):
    dt = params["embed_tokens"]["embedding"].dtype
    if cfg.has_final_layer_norm:
        h = opt.LayerNorm(dt).apply({"params": params["layer_norm"]}, h)
    if cfg.has_project_in_out:
        h = h @ params["project_out"]["kernel"]
    return jnp.einsum("bsd,vd->bsv", h, params["embed_tokens"]["embedding"],
                      preferred_element_type=jnp.float32)


def _run_layers(cfg, params, layers, h, attends):
    dt = h.dtype
    caches = []
    for i, attend in zip(layers, attends):
        h, c = opt.DecoderLayer(cfg, dt).apply({"params": params[f"layers_{i}"]}, h, attend)
        caches.append(c)
    return h, {"k": tuple(c[0] for c in caches), "v": tuple(c[1] for c in caches)}


def stage_prefill(cfg, layers, first, last, params, cache, x, attention_mask, all_logits=True):
    """x: input_ids [B, S] on the first stage, else hidden [B, S, hidden]."""
    positions = opt.prefill_positions(attention_mask)
    h = _embed(cfg, params, x, positions) if first else x
    attends = [opt._prefill_attend(k, v, attention_mask) for k, v in zip(cache["k"], cache["v"])]
    h, new = _run_layers(cfg, params, layers, h, attends)
    s = attention_mask.shape[1]
    new["mask"] = jnp.zeros_like(cache["mask"]).at[:, :s].set(attention_mask.astype(jnp.bool_))
    if not last:
        return h, new
    logits = _head(cfg, params, h if all_logits else h[:, -1:])
    return (logits if all_logits else logits[:, 0]), new


def stage_decode(cfg, layers, first, last, params, cache, x, positions, write_index):
    """x: tokens [B] on the first stage, else hidden [B, 1, hidden]."""
    rows = jnp.arange(positions.shape[0])
    mask = cache["mask"].at[rows, write_index].set(True)
    h = _embed(cfg, params, x[:, None], positions[:, None]) if first else x
    attends = [opt._decode_attend(k, v, mask, write_index) for k, v in zip(cache["k"], cache["v"])]
    h, new = _run_layers(cfg, params, layers, h, attends)
    new["mask"] = mask
    return (_head(cfg, params, h)[:, 0] if last else h), new


def stage_param_names(cfg: OPTConfig, layers: range, first: bool, last: bool) -> list[str]:
    names = []
    g = global_param_shapes(cfg)
    if first:
        names += [n for n in ("decoder.embed_tokens.weight", "decoder.embed_positions.weight",
                              "decoder.project_in_dim.weight") if n in g]
    if last:
        names += [n for n in ("decoder.embed_tokens.weight", "decoder.layer_norm.weight",
                              "decoder.layer_norm.bias", "decoder.project_out_dim.weight")
                  if n in g and n not in names]
    for i in layers:
        names += list(layer_param_shapes(cfg, i))
    return names


def load_stage_params(folder, cfg: OPTConfig, layers: range, first: bool, last: bool,
                      dtype=jnp.float32, mesh=None) -> dict:
    """Only this stage's tensors, memory-mapped, into a Flax-shaped tree. With a tp `mesh`,
    each device reads only its own slice of each file."""
    shapes = {**global_param_shapes(cfg)}
    for i in layers:
        shapes.update(layer_param_shapes(cfg, i))
    np_dtype = np.dtype(jnp.dtype(dtype))
    tree: dict = {}
    for name in stage_param_names(cfg, layers, first, last):
        path, transpose = flax_path(name)
        a = load_checked(folder, name, shapes[name])
        view = a.T if transpose else a
        if mesh is None:
            arr = jnp.asarray(np.ascontiguousarray(view, dtype=np_dtype))
        else:
            from jax.sharding import NamedSharding
            from opt_serving.parallel.sharding import TP_RULES, param_spec
            arr = jax.make_array_from_callback(
                view.shape, NamedSharding(mesh, param_spec(name, TP_RULES)),
                lambda idx, v=view: np.ascontiguousarray(v[idx], dtype=np_dtype))
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = arr
    return tree


def select_stage_params(params: dict, cfg: OPTConfig, layers: range, first: bool, last: bool,
                        place=lambda name, arr: arr) -> dict:
    """A full Flax tree (e.g. dummy weights) cut down to one stage; `place(name, leaf)` may move each leaf."""
    out: dict = {}
    for name in stage_param_names(cfg, layers, first, last):
        path, _ = flax_path(name)
        src, node = params, out
        for p in path:
            src = src[p]
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = place(name, src)
    return out


def _shard_stage(params: dict, cfg: OPTConfig, layers, first, last, mesh) -> dict:
    """Put a stage's param tree on its tp mesh with the Megatron specs of sharding.py."""
    from jax.sharding import NamedSharding
    from opt_serving.parallel.sharding import TP_RULES, param_spec
    return select_stage_params(
        params, cfg, layers, first, last,
        place=lambda name, arr: jax.device_put(arr, NamedSharding(mesh, param_spec(name, TP_RULES))))


class Stage:
    """One stage in this process: its params, cache and jitted steps (tp-sharded if tp > 1)."""

    def __init__(self, cfg: OPTConfig, params: dict, layers: range, first: bool, last: bool,
                 tp: int = 1):
        self.cfg, self.layers = cfg, tuple(layers)
        self.first, self.last = first, last
        self.dtype = jax.tree_util.tree_leaves(params)[0].dtype
        self.mesh = None
        if tp > 1:
            from opt_serving.parallel.sharding import _check_divisible, make_mesh
            if len(jax.devices()) < tp:
                raise ValueError(f"a tp={tp} stage needs {tp} devices, this process sees "
                                 f"{len(jax.devices())}")
            _check_divisible(cfg, tp)
            self.mesh = make_mesh(jax.devices()[:tp], tp)
            params = _shard_stage(params, cfg, layers, first, last, self.mesh)
        self.params = params
        statics = (cfg, self.layers, first, last)
        self._prefill = jax.jit(partial(stage_prefill, *statics), static_argnames=("all_logits",),
                                donate_argnums=(1,))
        self._decode = jax.jit(partial(stage_decode, *statics), donate_argnums=(1,))
        self._reorder = jax.jit(reorder, donate_argnums=(0,))
        self.caches: dict[int, dict] = {}   # micro-batch id -> this stage's cache slice

    def init_cache(self, mb: int, batch: int, max_len: int) -> None:
        cache = init_cache(self.cfg.replace(num_hidden_layers=len(self.layers)), batch, max_len,
                           self.dtype)
        if self.mesh is not None:
            from opt_serving.parallel.sharding import cache_shardings
            sh = cache_shardings(self.cfg.replace(num_hidden_layers=len(self.layers)), self.mesh)
            cache = jax.device_put(cache, sh)
        self.caches[mb] = cache

    def free_cache(self, mb: int) -> None:
        self.caches.pop(mb, None)

    def prefill(self, mb: int, x, attention_mask, all_logits: bool = True):
        out, self.caches[mb] = self._prefill(self.params, self.caches[mb], jnp.asarray(x),
                                             jnp.asarray(attention_mask), all_logits=all_logits)
        return np.asarray(out)

    def decode(self, mb: int, x, positions, write_index):
        out, self.caches[mb] = self._decode(self.params, self.caches[mb], jnp.asarray(x),
                                            jnp.asarray(positions), jnp.asarray(write_index))
        return np.asarray(out)

    def reorder(self, mb: int, index) -> None:
        """Beam search: row i of the cache continues from row index[i]."""
        index = np.asarray(index, np.int32)
        n = self.caches[mb]["mask"].shape[0]
        if index.shape != (n,) or index.min(initial=0) < 0 or index.max(initial=0) >= n:
            raise ValueError(f"reorder index must be {n} row numbers in [0, {n}), got {index}")
        self.caches[mb] = self._reorder(self.caches[mb], jnp.asarray(index))


# ---- the pipeline over Ray actors ----

def split_layers(num_layers: int, pp: int, layer_split: list[int] | None = None) -> list[range]:
    split = layer_split or [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
    if len(split) != pp or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"layer split {split} does not cover {num_layers} layers in {pp} stages")
    starts = np.cumsum([0, *split])
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


class Pipeline:
    """pp Ray actors, one per stage, placed by a placement group (one bundle per stage)."""

    def __init__(self, cfg: OPTConfig, pp: int, folder=None, params=None, dtype=jnp.float32,
                 layer_split: list[int] | None = None, tp: int = 1, use_gpus: bool | None = None,
                 cpus_per_stage: float = 1, placement_timeout_s: float = 120):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if (folder is None) == (params is None):
            raise ValueError("give either a numpy folder or an in-memory param tree")
        self.cfg, self.pp, self.tp = cfg, pp, tp
        self.ranges = split_layers(cfg.num_hidden_layers, pp, layer_split)
        if use_gpus is None:
            use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        # one bundle per stage: its tp devices (GPUs), or a CPU slot whose process gets tp
        # host devices from XLA_FLAGS
        bundle = {"CPU": cpus_per_stage, "GPU": tp} if use_gpus else {"CPU": cpus_per_stage}
        self.pg = placement_group([bundle] * pp, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"the Ray cluster cannot place {pp} stages of {bundle} within "
                f"{placement_timeout_s:.0f} s; available: {ray.available_resources()}") from None
        env = {} if use_gpus else {"env_vars": {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}", "JAX_PLATFORMS": "cpu"}}
        actor = ray.remote(StageActor)
        self.actors = []
        for s, layers in enumerate(self.ranges):
            first, last = s == 0, s == pp - 1
            part = None if params is None else jax.device_get(
                select_stage_params(params, cfg, layers, first, last))
            self.actors.append(actor.options(
                num_cpus=cpus_per_stage, num_gpus=tp if use_gpus else 0, runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, s)).remote(
                    cfg, layers, first, last, folder, part, jnp.dtype(dtype).name, tp))
        self._call(lambda a: a.ready.remote())

    def _get(self, refs):
        import ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            dead = [f"stage {s} (layers {r.start}-{r.stop - 1})"
                    for s, (a, r) in enumerate(zip(self.actors, self.ranges)) if not _alive(a)]
            raise StageDied(f"pipeline {', '.join(dead) or 'stage'} died "
                            f"({e.__class__.__name__}); rebuild the model with get_model(...)") from None

    def _call(self, fn):
        return self._get([fn(a) for a in self.actors])

    def init_cache(self, mb: int, batch: int, max_len: int) -> None:
        self._call(lambda a: a.init_cache.remote(mb, batch, max_len))

    def free_cache(self, mb: int) -> None:
        self._call(lambda a: a.free_cache.remote(mb))

    def prefill_async(self, mb: int, input_ids, attention_mask, all_logits: bool = True):
        """Chain the stages; returns the last stage's ref without waiting."""
        x = np.asarray(input_ids)
        for a in self.actors:
            x = a.prefill.remote(mb, x, np.asarray(attention_mask), all_logits)
        return x

    def decode_async(self, mb: int, tokens, positions, write_index):
        x = np.asarray(tokens)
        for a in self.actors:
            x = a.decode.remote(mb, x, np.asarray(positions), np.asarray(write_index))
        return x

    def reorder_async(self, mb: int, index) -> list:
        """Every stage gathers its cache rows by `index`; Ray runs one caller's calls to an actor
        in order, so a decode sent after this sees the reordered cache."""
        index = np.asarray(index, np.int32)
        return [a.reorder.remote(mb, index) for a in self.actors]

    def reorder(self, mb: int, index) -> None:
        self._get(self.reorder_async(mb, index))

    def prefill(self, mb, *args, **kw):
        return self._get(self.prefill_async(mb, *args, **kw))

    def decode(self, mb, *args):
        return self._get(self.decode_async(mb, *args))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)


def _alive(actor) -> bool:
    import ray
    try:
        ray.get(actor.ready.remote(), timeout=10)
        return True
    except Exception:
        return False


class StageActor:
    """Runs inside a Ray worker: a `Stage` loaded from the folder (its slice only)."""

    def __init__(self, cfg, layers, first, last, folder, params, dtype, tp=1):
        if params is None:
            mesh = None
            if tp > 1:
                from opt_serving.parallel.sharding import make_mesh
                mesh = make_mesh(jax.devices()[:tp], tp)
            params = load_stage_params(folder, cfg, layers, first, last, dtype, mesh)
        self.stage = Stage(cfg, params, layers, first, last, tp)

    def ready(self) -> bool:
        return True

    def init_cache(self, mb, batch, max_len):
        self.stage.init_cache(mb, batch, max_len)

    def free_cache(self, mb):
        self.stage.free_cache(mb)

    def num_devices(self) -> int:
        return len(jax.devices())

    def prefill(self, mb, x, attention_mask, all_logits):
        return self.stage.prefill(mb, x, attention_mask, all_logits)

    def decode(self, mb, x, positions, write_index):
        return self.stage.decode(mb, x, positions, write_index)

    def reorder(self, mb, index):
        self.stage.reorder(mb, index)

    def pid(self) -> int:
        import os
        return os.getpid()


class _Echo:
    def echo(self, x):
        return x


def measure_handoff_latency(repeat: int = 30, nbytes: int = 4096) -> float:
    """Seconds one stage-to-stage hand-off costs through Ray (actor call + object ref), for
    calibrating the cost model's `handoff_latency_s`. Needs ray.init() first."""
    import time
    import ray
    a, b = ray.remote(num_cpus=0)(_Echo).remote(), ray.remote(num_cpus=0)(_Echo).remote()
    x = np.zeros(nbytes // 4, np.float32)
    ray.get(b.echo.remote(a.echo.remote(x)))          # start both workers
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ray.get(b.echo.remote(a.echo.remote(x)))
        times.append(time.perf_counter() - t0)
    for actor in (a, b):
        ray.kill(actor)
    # two calls in the chain: the hand-off between them plus the final return
    return float(np.median(times)) / 2

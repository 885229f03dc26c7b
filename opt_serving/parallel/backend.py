"""`alpa/opt-*`: the planner picks the degrees for the Ray cluster, sharding.py and pipeline.py run them.

    model = get_model("alpa/opt-tiny", folder, tensor_parallel=2)      # one tp group, this process
    model = get_model("alpa/opt-tiny", folder, pipeline_parallel=2)    # two Ray stage actors
    model.generate(input_ids, max_new_tokens=8)

The plan comes from the Ray cluster this process is connected to, or joins (`address="auto"`) when
one is running; with none, from this process's devices. `device_memory` ("16GB") overrides what each
device may hold (CPU nodes, GPU kinds Ray does not name), so a model too big for one device gets
pp > 1 from the planner itself. Explicit degrees override the planner; any left out is still chosen
by it. One call builds one replica: data parallelism is more replicas (e.g. Ray Serve deployments).

With pp = 1 the model is `wrapper.OPTModel` over tensor-sharded params, so generate() is the same
jitted loop as jax/ (GSPMD partitions it). With pp > 1 generate() is the same `wrapper.Generation`
front (every argument, scores, return_dict_in_generate) over a host loop across the stage actors
(pipeline.py), with the rows (beam search: the prompts, each with its beams) split into micro-batches
that are in flight together; the tokens are chosen by the same jitted `wrapper.pick_tokens` and
`beam_search.beam_step`, and every stage reorders its cache rows after a beam step.
"""
from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving import jax_env, sampling
from opt_serving.backend import choose
from opt_serving.config import OPTConfig, config_for, get_config
from opt_serving.model import beam_search, layout, loader, sources, wrapper
from opt_serving.parallel import cluster as clusters
from opt_serving.parallel import ray_address
from opt_serving.parallel.cluster import Cluster, parse_bytes
from opt_serving.parallel.pipeline import RayStages
from opt_serving.parallel.planner import Plan, search
from opt_serving.parallel.sharding import ShardedOPT, make_mesh, sharded_parts
from opt_serving.spec import ModelSpec


def connect_ray(start: bool = True):
    """Join the Ray cluster of the last `ray start --head` on this machine, or RAY_ADDRESS's, if it answers (a
    stale address file is skipped, saying so: parallel/ray_address.py); with none, start a local one when
    `start`, else return None."""
    import ray  # Ray is imported where a cluster is joined: planning for this process's devices needs none
    up, _ = ray_address.init(start=start, include_dashboard=False, logging_level="ERROR")
    return ray if up else None


def cluster_dtype(dtype) -> str:
    """"auto" for a model planned over the Ray cluster: float16 where the cluster has GPUs, float32 on CPUs,
    read from Ray's resources without starting JAX in this process (which may only plan and drive); with no
    cluster running, the model runs here and this process's devices decide."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return jnp.dtype(loader.model_dtype(dtype)).name
    ray = connect_ray(start=False)
    if ray is not None:
        return "float16" if ray.cluster_resources().get("GPU", 0) > 0 else "float32"
    return jnp.dtype(loader.model_dtype(dtype)).name


def _memory(device_memory) -> float | None:
    if device_memory is None or isinstance(device_memory, (int, float)):
        return device_memory
    return parse_bytes(str(device_memory))


def plan_cluster(tensor_parallel=None, pipeline_parallel=None, device_memory=None) -> Cluster:
    """What the planner plans for: the Ray cluster when one runs (joined if need be), else this
    process's devices; `device_memory` (bytes or "16GB") overrides each device's memory."""
    memory = _memory(device_memory)
    ray = connect_ray(start=pipeline_parallel not in (None, 1))
    if ray is not None:
        cluster = clusters.cluster_from_ray(device_memory=memory)
        if cluster.spec.kind == "cpu" and (tensor_parallel or 1) > 1:
            # a CPU node's stage process makes its own tp host devices (XLA_FLAGS)
            cluster = dataclasses.replace(cluster, devices_per_node=tensor_parallel,
                                          device_memory=cluster.device_memory / tensor_parallel)
    else:
        cluster = clusters.cluster_from_jax()
        if memory is not None:
            cluster = dataclasses.replace(cluster, device_memory=memory)
    want = (tensor_parallel or 1) * (pipeline_parallel or 1)
    if cluster.spec.kind == "cpu" and cluster.num_devices < want:
        # CPU stages are processes that make their own host devices, so the devices an explicit CPU
        # plan asks for exist once its actors start
        cluster = dataclasses.replace(cluster, num_nodes=1, devices_per_node=want,
                                      device_memory=cluster.total_memory / want)
    return cluster


def plan_model(spec: ModelSpec, dtype="float32", device_memory=None, batch_size: int = 1, max_seq_len=None,
               cluster: Cluster | None = None):
    """(plan, config, weights folder or None) of an alpa/ model: the planner's best plan with the spec's
    degrees fixed (`spec.quantize="int8"`: planned for int8 weights). Raises planner.NoFeasiblePlan with
    `opt-serving plan`'s message when nothing fits."""
    dtype = loader.model_dtype(dtype)
    folder = None
    if spec.weights.random:
        cfg = get_config(spec.name)
    else:
        if spec.weights.folder is None:
            raise ValueError(f"{spec.name}: give path= (the numpy weights folder) or dummy=True")
        folder = loader.resolve_numpy_folder(spec.weights.folder, spec.name)
        cfg = config_for(spec.name, folder)
    cluster = cluster or plan_cluster(spec.tensor_parallel, spec.pipeline_parallel, device_memory)
    plan = search(cfg, cluster, model=spec.label, batch_size=batch_size,
                  max_seq_len=max_seq_len, dtype=jnp.dtype(dtype).name, tensor_parallel=spec.tensor_parallel,
                  pipeline_parallel=spec.pipeline_parallel, weights=spec.quantize or "float32").best
    return plan, cfg, folder


def tensor_parallel_model(cfg: OPTConfig, plan: Plan, folder, dtype, seed: int = 0,
                          quantize: str | None = None) -> "TensorParallelOPT":
    """A pp = 1 plan in this process: params sharded over the first tp devices, each device reading its slice
    of the folder or drawing its slice of the random weights (model/sources.py) (`quantize="int8"`: int8
    weights, model/quantize.py's, split as the float ones are)."""
    if len(jax.devices()) < plan.tp:
        raise ValueError(f"the plan {plan.name} needs {plan.tp} devices in this process, it sees "
                         f"{len(jax.devices())} (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = make_mesh(jax.devices()[:plan.tp], plan.tp)
    dtype = loader.model_dtype(dtype)
    source = sources.RandomSource(seed) if folder is None else sources.FolderSource(folder, quantize)
    # tp = 1: the one device's runtime layout built a layer at a time (a mesh keeps the checkpoint's)
    backend, params = layout.runtime_parts(sharded_parts(source, cfg, mesh, dtype=dtype, quantize=quantize),
                                           mesh.devices.flat, dtype, weights=quantize or "float32")
    return TensorParallelOPT(cfg, params, mesh, plan, backend=backend)


class TensorParallelOPT(wrapper.OPTModel):
    """jax/'s model over params sharded on a tp mesh; engine steps keep the cache sharded."""

    def __init__(self, cfg: OPTConfig, params, mesh, plan: Plan | None = None, weights: str = "float32",
                 backend=None):
        """`params` in the checkpoint's layout, or with `backend` in its runtime layout (see OPTModel)."""
        super().__init__(cfg, params, backend=backend, weights=weights)
        self.plan, self.mesh = plan, mesh
        self._sharded = ShardedOPT(cfg, self.fused_params, mesh, backend=self.backend)

    def init_cache(self, batch: int, max_len: int):
        return self._sharded.init_cache(batch, max_len)

    def prefill(self, cache, input_ids, attention_mask, all_logits=True):
        return self._sharded.prefill(cache, input_ids, attention_mask, all_logits)

    def decode(self, cache, tokens, positions, write_index):
        return self._sharded.decode(cache, tokens, positions, write_index)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st):
    """beam_search.beam_step, jitted on its own: the driver runs it between pipelined decodes."""
    return beam_search.beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st)


def _rows(tree, rows):
    return jax.tree_util.tree_map(lambda a: a[rows] if getattr(a, "ndim", 0) else a, tree)


class PipelinedOPT(wrapper.Generation):
    """pp stage actors (pipeline.RayStages); generate() keeps `micro_batches` groups of rows in flight.
    `close()` (or dropping the model) frees the actors and their placement group."""

    def __init__(self, cfg: OPTConfig, stages, plan: Plan | None = None, micro_batches: int | None = None):
        self.config, self.stages, self.plan = cfg, stages, plan
        self.micro_batches = micro_batches or stages.n
        # this process picks the tokens from the logits the last stage sends back
        self.argmax = choose(jax.devices()[:1], jnp.float32).argmax
        self._keys = itertools.count()

    @property
    def pipeline(self):  # the stage actors (tests, benchmarks)
        return self.stages

    def close(self) -> None:
        self.stages.close()

    shutdown = close

    def _chain(self, method: str, key, x, *rest):
        for i in range(self.stages.n):
            x = self.stages.call(i, "seq", method, key, x, *rest)
        return x

    def _open(self, batch: int, max_len: int):
        key = next(self._keys)
        self.stages.get([self.stages.call(i, "seq", "open", key, batch, max_len) for i in range(self.stages.n)])
        return key

    def _close(self, keys) -> None:
        for key in keys:
            for i in range(self.stages.n):
                self.stages.call(i, "seq", "close", key)

    def __call__(self, input_ids, attention_mask=None):
        """Full-sequence logits [B, S, V] (reference and tests)."""
        ids = np.asarray(input_ids, np.int32)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
        key = self._open(*ids.shape)
        try:
            return self.stages.get(self._chain("prefill", key, ids, mask, True))
        finally:
            self._close([key])

    def _groups(self, n: int) -> list[np.ndarray]:
        return [g for g in np.array_split(np.arange(n), min(self.micro_batches, n)) if len(g)]

    def _sample(self, ids, mask, st, max_new, new_bucket, pad, output_scores):
        """wrapper._sample_loop's contract over the stages: the rows in micro-batches, round-robin, so
        while one micro-batch's logits come back the others are in the stages."""
        b, s = ids.shape
        total = s + new_bucket
        runs = []
        try:
            for rows in self._groups(b):
                key = self._open(len(rows), total)
                runs.append(dict(rows=rows, key=key, st=_rows(st, rows), steps=0,
                                 state=sampling.init_state(ids[rows], mask[rows], self.config.vocab_size, total),
                                 unfinished=jnp.ones(len(rows), jnp.bool_), n_real=mask[rows].sum(1).astype(np.int32),
                                 ref=self._chain("prefill", key, ids[rows], mask[rows], False)))
            scores = np.zeros((new_bucket if output_scores else 0, b, self.config.vocab_size), np.float32)
            for i in range(max_new):
                for r in runs:
                    if r["ref"] is None:
                        continue
                    logits = self.stages.get(r["ref"])
                    tok, r["state"], r["unfinished"], sc = wrapper.pick_tokens(
                        jnp.asarray(logits), r["state"], r["st"], r["unfinished"], pad, self.argmax)
                    r["steps"], r["ref"] = i + 1, None
                    if output_scores:
                        scores[i, r["rows"]] = np.asarray(sc)
                    if i + 1 < max_new and bool(r["unfinished"].any()):
                        r["ref"] = self._chain("decode", r["key"], np.asarray(tok), r["n_real"] + i,
                                               np.full(len(r["rows"]), s + i, np.int32))
        finally:
            self._close([r["key"] for r in runs])
        steps = max(r["steps"] for r in runs)
        out = np.full((b, total), pad, np.int32)
        for r in runs:
            out[r["rows"], :s + r["steps"]] = np.asarray(r["state"].history)[:, :s + r["steps"]]
        return out, steps, scores

    def _beams(self, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad, output_scores,
               should_stop=None):
        """beam_search.search's contract over the stages: prompts in micro-batches, each with its K
        beams; per step the logits come to the driver, `beam_step` picks the beams, every stage reorders
        its cache rows to follow them (Ray runs one caller's calls to an actor in order, so the next
        decode sees the reordered cache), and the next decode goes out."""
        bk, s = ids.shape
        b, total, v = bk // k, s + max_new, self.config.vocab_size
        fill = pad if pad else eos
        runs, scores = [], np.zeros((max_new if output_scores else 0, bk, v), np.float32)
        try:
            for items in self._groups(b):
                rows = (items[:, None] * k + np.arange(k)).reshape(-1)
                key = self._open(len(rows), total)
                runs.append(dict(items=items, rows=rows, key=key, c=beam_search.beam_init(
                    jnp.asarray(ids[rows]), jnp.asarray(mask[rows]), k, total, fill),
                    seen=sampling.init_state(ids[rows], mask[rows], v, total), st=_rows(st, rows),
                    n_real=mask[rows].sum(1).astype(np.int32),
                    ref=self._chain("prefill", key, ids[rows], mask[rows], False)))
            live = True
            while live:
                live = False
                for r in runs:
                    if r["ref"] is None:
                        continue
                    beam_search.check_stop(should_stop)  # before each micro-batch's step
                    cur = int(r["c"]["cur"])
                    r["c"], parents, last, go, lp = _beam_step(k, s, length_penalty, early_stop, eos,
                                                               jnp.asarray(self.stages.get(r["ref"])), r["c"],
                                                               r["seen"], r["st"])
                    r["ref"] = None
                    if output_scores:
                        scores[cur - s, r["rows"]] = np.asarray(lp)
                    if bool(go):
                        for i in range(self.stages.n):
                            self.stages.call(i, "seq", "reorder", r["key"], np.asarray(parents))
                        r["ref"] = self._chain("decode", r["key"], np.asarray(last), r["n_real"] + (cur - s),
                                               np.full(len(r["rows"]), cur, np.int32))
                        live = True
        finally:
            self._close([r["key"] for r in runs])
        seqs = np.full((b * n_return, total), fill, np.int32)
        idx = np.full((b * n_return, max_new), -1, np.int32)
        best = np.zeros(b * n_return, np.float32)
        for r in runs:
            n = len(r["items"])
            out = (r["items"][:, None] * n_return + np.arange(n_return)).reshape(-1)
            seqs[out] = np.asarray(r["c"]["seqs"])[:, :n_return].reshape(n * n_return, total)
            idx[out] = np.asarray(r["c"]["beam_idx"])[:, :n_return].reshape(n * n_return, -1)
            best[out] = np.asarray(r["c"]["beam_scores"])[:, :n_return].reshape(-1)
        return (seqs, idx), scores, best


def get_alpa_model(spec: ModelSpec, dtype="auto", batch_size: int = 1, max_seq_len: int | None = None,
                   cluster: Cluster | None = None, device_memory=None, micro_batches: int | None = None,
                   handoff: str = "auto", **unused):
    """An alpa/ model: a plan (the spec's explicit degrees kept) for the Ray cluster, then sharded or pipelined
    (`spec.quantize="int8"`: int8 weights, each stage quantizing its own, or reading them from a quantized
    folder; `handoff`: how pipeline stages hand hidden states on, pipeline.RayStages)."""
    if unused:
        raise TypeError(f"get_model() got unsupported arguments: {sorted(unused)}")
    dtype = cluster_dtype(dtype)
    seed, quantize = spec.weights.seed or 0, spec.quantize
    plan, cfg, folder = plan_model(spec, dtype, device_memory, batch_size, max_seq_len, cluster)
    if plan.pp == 1:
        return tensor_parallel_model(cfg, plan, folder, dtype, seed, quantize)
    # this process only drives the stages (each holds its GPUs' share): no device memory taken ahead of need
    jax_env.apply(jax_env.route_only())
    connect_ray()
    return PipelinedOPT(cfg, RayStages(cfg, plan, folder, dtype=jnp.dtype(loader.model_dtype(dtype)).name, seed=seed,
                                       quantize=quantize, handoff=handoff), plan, micro_batches)

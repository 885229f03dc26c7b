"""`alpa/opt-*`: the planner picks the degrees, sharding.py and pipeline.py run them.

    model = get_model("alpa/opt-tiny", folder, tensor_parallel=2)      # one tp group, this process
    model = get_model("alpa/opt-tiny", folder, pipeline_parallel=2)    # two Ray stage actors
    model.generate(input_ids, max_new_tokens=8)

Explicit degrees override the planner; any left out is still chosen by it (for the devices
this process sees, or the Ray cluster when one is running). One call builds one replica:
data parallelism is more replicas (e.g. Ray Serve deployments), not more of this object.

With pp = 1 the model is `wrapper.OPTModel` over tensor-sharded params, so generate() is
the same jitted loop as jax/ (greedy, sampling and beam search; GSPMD partitions it). With
pp > 1 generate() runs a host loop over the stage actors, with the rows (beam search: the
prompts, each with its beams) split into micro-batches that are in flight together. Beam
search there runs `wrapper.beam_step` (the step of jax/'s beam search, without the decode) on the
driver, then has every stage reorder its cache rows before the next decode.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving import sampling
from opt_serving.config import OPTConfig, get_config
from opt_serving.model import opt, wrapper
from opt_serving.parallel.cluster import Cluster, cluster_from_jax, cluster_from_ray
from opt_serving.parallel.planner import Plan, search


def connect_ray():
    """Join the running Ray cluster, else start a local one."""
    import ray
    if not ray.is_initialized():
        try:
            ray.init(address="auto", logging_level="ERROR")
        except ConnectionError:
            ray.init(include_dashboard=False, logging_level="ERROR")
    return ray


def choose_plan(cfg: OPTConfig, name: str, dtype, cluster: Cluster | None = None,
                tensor_parallel=None, pipeline_parallel=None, batch_size: int = 1,
                max_seq_len: int | None = None) -> Plan:
    """The planner's best plan with the given degrees fixed."""
    if cluster is None:
        import ray
        gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        cluster = cluster_from_ray() if gpus else cluster_from_jax()
        want = (tensor_parallel or 1) * (pipeline_parallel or 1)
        if not gpus and cluster.num_devices < want:
            # CPU stages are processes that make their own host devices (XLA_FLAGS), so the
            # devices an explicit CPU plan asks for exist once its actors start
            import dataclasses
            cluster = dataclasses.replace(cluster, num_nodes=1, devices_per_node=want,
                                          device_memory=cluster.total_memory / want)
    return search(cfg, cluster, model=name, batch_size=batch_size, max_seq_len=max_seq_len,
                  dtype=jnp.dtype(dtype).name, tensor_parallel=tensor_parallel,
                  pipeline_parallel=pipeline_parallel).best


class TensorParallelOPT(wrapper.OPTModel):
    """jax/'s model over params sharded on a tp mesh; engine steps keep the cache sharded."""

    def __init__(self, cfg: OPTConfig, params, mesh, plan: Plan | None = None):
        from opt_serving.parallel.sharding import ShardedOPT
        super().__init__(cfg, params)
        self.plan, self.mesh = plan, mesh
        self._sharded = ShardedOPT(cfg, params, mesh)

    def init_cache(self, batch: int, max_len: int):
        return self._sharded.init_cache(batch, max_len)

    def prefill(self, cache, input_ids, attention_mask, all_logits=True):
        return self._sharded.prefill(cache, input_ids, attention_mask, all_logits)

    def decode(self, cache, tokens, positions, write_index):
        return self._sharded.decode(cache, tokens, positions, write_index)


@jax.jit
def _pick(logits, state, settings, unfinished, pad):
    tok, _ = sampling.sample(logits, state, settings)
    tok = jnp.where(unfinished, tok, pad)
    return tok, sampling.update_state(state, tok), unfinished & (tok != settings.eos_token_id)


_beam_init = wrapper.beam_init


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st):
    """wrapper.beam_step, jitted on its own: the driver runs it between pipelined decodes."""
    return wrapper.beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st)[:4]


class PipelinedOPT:
    """pp stage actors; generate() keeps `micro_batches` groups of rows in flight."""

    def __init__(self, cfg: OPTConfig, pipeline, plan: Plan | None = None, micro_batches: int | None = None):
        self.config, self.pipeline, self.plan = cfg, pipeline, plan
        self.micro_batches = micro_batches or pipeline.pp

    def shutdown(self) -> None:
        self.pipeline.shutdown()

    def __call__(self, input_ids, attention_mask=None):
        """Full-sequence logits [B, S, V] (reference and tests)."""
        ids = np.asarray(input_ids, np.int32)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
        self.pipeline.init_cache(-1, *ids.shape)
        try:
            return self.pipeline.prefill(-1, ids, mask)
        finally:
            self.pipeline.free_cache(-1)

    def generate(self, input_ids, attention_mask=None, max_new_tokens=None, max_length=None,
                 do_sample=False, temperature=1.0, top_k=50, top_p=1.0, repetition_penalty=1.0,
                 no_repeat_ngram_size=0, min_new_tokens=0, eos_token_id=None, pad_token_id=None,
                 num_beams=1, num_return_sequences=1, length_penalty=1.0, early_stopping=False,
                 seed=None, **unused):
        if unused:
            raise TypeError(f"generate() got unsupported arguments: {sorted(unused)}")
        if num_beams > 1 and do_sample:
            raise NotImplementedError("beam sampling (num_beams > 1 with do_sample) is not supported")
        if num_return_sequences > max(num_beams, 1) and not do_sample:
            raise ValueError(f"num_return_sequences ({num_return_sequences}) > num_beams ({num_beams}); "
                             "greedy search returns one sequence per prompt")
        cfg = self.config
        ids, mask, max_new_tokens, _ = wrapper.prepare_inputs(cfg, input_ids, attention_mask,
                                                              max_length, max_new_tokens)
        b, s = ids.shape
        eos = cfg.eos_token_id if eos_token_id is None else int(eos_token_id)
        pad = cfg.pad_token_id if pad_token_id is None else int(pad_token_id)
        seed = int(np.random.randint(0, 2 ** 31)) if seed is None else seed
        settings = dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                        min_new_tokens=min_new_tokens, eos_token_id=eos)
        if num_beams > 1:
            return self._beam_search(ids, mask, max_new_tokens, num_beams, num_return_sequences,
                                     float(length_penalty), early_stopping is True, eos, pad,
                                     settings, seed)
        if num_return_sequences > 1:
            ids, mask = np.repeat(ids, num_return_sequences, 0), np.repeat(mask, num_return_sequences, 0)
            b = ids.shape[0]
        total = s + max_new_tokens
        groups = [g for g in np.array_split(np.arange(b), min(self.micro_batches, b)) if len(g)]
        runs = []
        for mb, rows in enumerate(groups):
            st = sampling.make_settings(
                len(rows), temperature=temperature if do_sample else 0.0,
                top_k=(top_k or 0) if do_sample else 0, top_p=top_p if do_sample else 1.0,
                seed=seed + rows, **settings)
            self.pipeline.init_cache(mb, len(rows), total)
            runs.append(dict(rows=rows, st=st, state=sampling.init_state(ids[rows], mask[rows],
                                                                         cfg.vocab_size, total),
                             unfinished=jnp.ones(len(rows), jnp.bool_),
                             n_real=mask[rows].sum(1).astype(np.int32),
                             ref=self.pipeline.prefill_async(mb, ids[rows], mask[rows], False)))
        try:
            # round-robin: while one micro-batch's logits come back, the others are in the stages
            for i in range(max_new_tokens):
                for mb, r in enumerate(runs):
                    if r["ref"] is None:
                        continue
                    logits = self.pipeline._get(r["ref"])
                    tok, r["state"], r["unfinished"] = _pick(jnp.asarray(logits), r["state"], r["st"],
                                                             r["unfinished"], pad)
                    r["ref"] = None
                    if i + 1 < max_new_tokens and bool(r["unfinished"].any()):
                        t = np.asarray(tok)
                        r["ref"] = self.pipeline.decode_async(
                            mb, t, r["n_real"] + i, np.full(len(t), s + i, np.int32))
        finally:
            for mb in range(len(runs)):
                self.pipeline.free_cache(mb)
        out = np.full((b, total), pad, np.int32)
        steps = max(int(r["state"].length[0]) for r in runs)
        for r in runs:
            out[r["rows"]] = np.asarray(r["state"].history)
            out[r["rows"], int(r["state"].length[0]):] = pad
        return out[:, :steps]

    def _beam_search(self, ids, mask, max_new, k, n_return, length_penalty, early_stop, eos, pad,
                     settings, seed):
        """wrapper._beam_search over the stages: prompts split into micro-batches, each with its
        K beams; per step the logits come to the driver, `_beam_step` picks the beams, every
        stage reorders its cache rows to follow them, and the next decode goes out."""
        cfg = self.config
        b, s = ids.shape
        total = s + max_new
        fill = pad if pad else eos
        groups = [g for g in np.array_split(np.arange(b), min(self.micro_batches, b)) if len(g)]
        runs = []
        try:
            for mb, items in enumerate(groups):
                gi, gm = np.repeat(ids[items], k, 0), np.repeat(mask[items], k, 0)  # [n*K, S]
                self.pipeline.init_cache(mb, len(gi), total)
                runs.append(dict(items=items, c=_beam_init(jnp.asarray(gi), jnp.asarray(gm), k, total,
                                                           fill),
                                 seen=sampling.init_state(gi, gm, cfg.vocab_size, total),
                                 st=sampling.make_settings(len(gi), seed=seed, **settings),
                                 n_real=gm.sum(1).astype(np.int32),
                                 ref=self.pipeline.prefill_async(mb, gi, gm, False), pending=[]))
            live = True
            while live:
                live = False
                for mb, r in enumerate(runs):
                    if r["ref"] is None:
                        continue
                    # the reorders sent with this decode surface their errors here
                    logits = self.pipeline._get([*r["pending"], r["ref"]])[-1]
                    r["c"], parents, last, go = _beam_step(k, s, length_penalty, early_stop, eos,
                                                           jnp.asarray(logits), r["c"], r["seen"], r["st"])
                    r["ref"], r["pending"] = None, []
                    if bool(go):
                        cur = int(r["c"]["cur"])
                        r["pending"] = self.pipeline.reorder_async(mb, np.asarray(parents))
                        r["ref"] = self.pipeline.decode_async(
                            mb, np.asarray(last), r["n_real"] + (cur - 1 - s),
                            np.full(len(parents), cur - 1, np.int32))
                        live = True
        finally:
            for mb in range(len(groups)):
                self.pipeline.free_cache(mb)
        out = np.full((b * n_return, total), fill, np.int32)
        steps = 0
        for r in runs:
            n = len(r["items"])
            seqs = np.asarray(r["c"]["seqs"])[:, :n_return].reshape(n * n_return, total)
            idx = np.asarray(r["c"]["beam_idx"])[:, :n_return].reshape(n * n_return, -1)
            rows = (r["items"][:, None] * n_return + np.arange(n_return)).reshape(-1)
            out[rows] = seqs
            steps = max(steps, int(((idx + 1) != 0).sum(1).max()))
        return out[:, :s + steps]


def get_alpa_model(model_name: str, path=None, dtype=jnp.float32, tensor_parallel: int | None = None,
                   pipeline_parallel: int | None = None, dummy: bool = False, seed: int = 0,
                   batch_size: int = 1, max_seq_len: int | None = None, cluster: Cluster | None = None,
                   **unused):
    """An alpa/ model: a plan (explicit degrees kept), then sharded or pipelined execution."""
    dtype = wrapper._dtype(dtype)
    folder = None
    if dummy:
        cfg = get_config(model_name)
    else:
        if path is None:
            raise ValueError(f"{model_name}: give path= (the numpy weights folder) or dummy=True")
        folder = wrapper.resolve_numpy_folder(path, model_name)
        cfg = (OPTConfig.from_hf_json(folder) if (Path(folder) / "config.json").exists()
               else get_config(model_name))
    name = model_name.rsplit("/", 1)[-1]
    if pipeline_parallel not in (None, 1):
        connect_ray()
    plan = choose_plan(cfg, name, dtype, cluster, tensor_parallel, pipeline_parallel,
                       batch_size, max_seq_len)
    params = opt.init_params(cfg, seed, dtype) if dummy else None
    if plan.pp == 1:
        from opt_serving.parallel.sharding import load_sharded_params, make_mesh, shard_params
        mesh = make_mesh(jax.devices()[:plan.tp], plan.tp)
        params = (shard_params(params, cfg, mesh) if dummy
                  else load_sharded_params(folder, cfg, mesh, dtype=dtype))
        return TensorParallelOPT(cfg, params, mesh, plan)
    from opt_serving.parallel.pipeline import Pipeline
    connect_ray()
    pipe = Pipeline(cfg, plan.pp, folder=folder, params=params, dtype=dtype,
                    layer_split=plan.layer_split, tp=plan.tp)
    return PipelinedOPT(cfg, pipe, plan)

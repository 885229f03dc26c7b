"""Hugging Face's generate() over the runner's stages: the host loop of a pipelined model.

The front (every argument of generate(), sampling settings, scores, return_dict_in_generate) is model/wrapper.py's
`Generation`, the same for every plan. A model on one device or one tensor-parallel mesh runs it as one compiled
on-device loop (wrapper.OPTModel); a model whose layers are split over stages runs it here, as a loop on the
host over the same stage objects the engine steps (runner.stage.StageSlots, in Ray actors or in this process):
each stage keeps whole-sequence caches of its own layers (its seq_* calls, runner.types.STAGE_CALLS), the rows
(beam search: the prompts, each with its beams) split into micro-batches that are in flight together, the tokens
chosen here from the last stage's logits by the same jitted `wrapper.pick_tokens` and `beam_search.beam_step`,
and every stage reorders its cache rows after a beam step.
"""
from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend import choose, sampling
from opt_serving.config import OPTConfig
from opt_serving.model import beam_search, wrapper


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st):
    """beam_search.beam_step, jitted on its own: the driver runs it between pipelined decodes."""
    return beam_search.beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st)


def _rows(tree, rows):
    return jax.tree_util.tree_map(lambda a: a[rows] if getattr(a, "ndim", 0) else a, tree)


class StageGeneration(wrapper.Generation):
    """generate() over the runner's `stages` (runner.slots.Stages: Ray stage actors, pipeline.RayStages, or stages
    in this process), keeping `micro_batches` groups of rows in flight. `close()` (or dropping the model) frees
    the stages (Ray's: the actors and their placement group)."""

    def __init__(self, cfg: OPTConfig, stages, plan=None, micro_batches: int | None = None):
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
            x = self.stages.call(i, "seq_" + method, key, x, *rest)
        return x

    def _open(self, batch: int, max_len: int):
        key = next(self._keys)
        self.stages.get([self.stages.call(i, "seq_open", key, batch, max_len) for i in range(self.stages.n)])
        return key

    def _close(self, keys) -> None:
        for key in keys:
            for i in range(self.stages.n):
                self.stages.call(i, "seq_close", key)

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
                            self.stages.call(i, "seq_reorder", r["key"], np.asarray(parents))
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

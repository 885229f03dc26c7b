"""Beam search, a port of transformers 5.23 `_beam_search` (vectorised, one EOS token): `beam_init` and
`beam_step` are pure functions of the next-token logits and the beams' state, which the on-device loop
(`search`) and the pipelined host loop (runner/generate.py) run between decodes.

A search can be stopped between steps (a server's client gone): the caller's `should_stop` is asked before
every step, on the host; the on-device loop asks it through a host callback (`stoppable`, `_stopped`), and
the search then ends with SearchStopped instead of a result."""
from __future__ import annotations

import contextlib
import itertools
import threading
from functools import partial
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from opt_serving.backend import Backend, sampling
from opt_serving.model import kv_cache, steps
from opt_serving.model.lora import applied


class SearchStopped(Exception):
    """The caller's `should_stop` said so before a step: the search ended without a result."""


# searches that can be stopped, by the token their compiled loop passes to the host callback: the callback
# is one module-level function, so a new search compiles nothing new
_STOPS: dict[int, Callable[[], bool]] = {}
_STOPS_LOCK = threading.Lock()
_TOKENS = itertools.count(1)


@contextlib.contextmanager
def stoppable(should_stop: Optional[Callable[[], bool]]) -> Iterator[Optional[int]]:
    """The token (None without `should_stop`) to give `search` while it runs; `should_stop` (once True, True
    from then on) is then asked before every step."""
    if should_stop is None:
        yield None
        return
    with _STOPS_LOCK:
        token = next(_TOKENS)
        _STOPS[token] = should_stop
    try:
        yield token
    finally:
        with _STOPS_LOCK:
            _STOPS.pop(token, None)


def _stopped(token) -> np.ndarray:
    with _STOPS_LOCK:
        should_stop = _STOPS.get(int(token))
    return np.bool_(should_stop is not None and should_stop())


def check_stop(should_stop: Optional[Callable[[], bool]]) -> None:
    """Raise SearchStopped if the caller wants the search stopped (host loops, and after the device loop)."""
    if should_stop is not None and should_stop():
        raise SearchStopped("beam search stopped by its caller")


def _gather_beams(x, idx):
    """x [B, K, ...], idx [B, K'] -> [B, K', ...]"""
    return jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(x, idx)


def beam_init(ids, mask, k: int, max_length: int, fill: int) -> dict:
    """Beam state for prompts already repeated k times (rows [B*K])."""
    bk, s = ids.shape
    b = bk // k
    running = jnp.full((b, k, max_length), fill, jnp.int32).at[:, :, :s].set(ids.reshape(b, k, s))
    idx = jnp.full((b, k, max_length - s), -1, jnp.int32)
    return dict(cur=jnp.int32(s), running=running, running_scores=jnp.zeros((b, k), jnp.float32)
                .at[:, 1:].set(-1e9), running_idx=idx, seqs=running,
                beam_scores=jnp.full((b, k), -1e9, jnp.float32), beam_idx=idx,
                finished=jnp.zeros((b, k), jnp.bool_), unsat=jnp.ones((b, 1), jnp.bool_))


def beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st):
    """One step of transformers 5.23 `_beam_search` (vectorised, one EOS token) given the next-token
    logits [B*K, V] -> (new state, the parent row of every beam [B*K] (reorder the cache by it), the
    token each beam feeds next [B*K], whether to go on, the processed log-probs [B*K, V]).
    Pure: the on-device loop (`search`) and the pipelined host loop (runner/generate.py) both run it."""
    bk, v = logits.shape
    b = bk // k
    cur, running, running_scores, running_idx = (c["cur"], c["running"], c["running_scores"],
                                                 c["running_idx"])
    max_length = running.shape[2]
    keep = 2 * k  # beams_to_keep = max(2, 1 + n_eos) * num_beams
    top_mask = jnp.arange(keep) < k
    g = _gather_beams
    state = _state_from_history(prompt_seen, running.reshape(bk, max_length), cur, v)
    log_probs = sampling.process_logits(jax.nn.log_softmax(logits.astype(jnp.float32), -1), state, st)
    acc = (log_probs.reshape(b, k, v) + running_scores[:, :, None]).reshape(b, k * v)
    topk_lp, topk_i = jax.lax.top_k(acc, keep)
    cur_beam, topk_ids = topk_i // v, (topk_i % v).astype(jnp.int32)
    t_idx = g(running_idx, cur_beam)
    t_seq = jax.lax.dynamic_update_slice(g(running, cur_beam), topk_ids[:, :, None], (0, 0, cur))
    flat_parent = (cur_beam + jnp.arange(b)[:, None] * k).astype(jnp.int32)
    t_idx = jax.lax.dynamic_update_slice(t_idx, flat_parent[:, :, None], (0, 0, cur - s))
    hits = (cur + 1 >= max_length) | (topk_ids == eos)
    # the best unfinished beams continue
    t_run_lp = topk_lp + hits.astype(jnp.float32) * -1.0e9
    nxt = jax.lax.top_k(t_run_lp, k)[1]
    running, running_scores, running_idx = g(t_seq, nxt), g(t_run_lp, nxt), g(t_idx, nxt)
    # finished hypotheses merge into the kept ones by length-normalised score
    did = hits & top_mask[None, :]
    t_lp = topk_lp / ((cur + 1 - s).astype(jnp.float32) ** length_penalty)
    full = jnp.all(c["finished"], axis=-1, keepdims=True) & early_stop
    t_lp = t_lp + full * -1.0e9 + (~c["unsat"]) * -1.0e9 + (~did) * -1.0e9
    top = jax.lax.top_k(jnp.concatenate([c["beam_scores"], t_lp], 1), k)[1]
    merged = lambda a, t: g(jnp.concatenate([a, t], 1), top)  # noqa: E731
    seqs, beam_scores = merged(c["seqs"], t_seq), merged(c["beam_scores"], t_lp)
    beam_idx, finished = merged(c["beam_idx"], t_idx), merged(c["finished"], did)
    # the cache follows the surviving beams
    parents = jax.lax.dynamic_slice_in_dim(running_idx, cur - s, 1, axis=2).reshape(bk)
    cur = cur + 1
    best = running_scores[:, :1] / ((cur - s).astype(jnp.float32) ** length_penalty)
    worst = jnp.where(finished, jnp.min(beam_scores, axis=1, keepdims=True), -1.0e9)
    unsat = c["unsat"] & jnp.any(best > worst, axis=-1, keepdims=True)
    go = jnp.any(unsat) & ~(jnp.all(finished) & early_stop) & ~jnp.all(hits) & (cur < max_length)
    # next: feed each surviving beam's newest token
    last = jax.lax.dynamic_slice_in_dim(running, cur - 1, 1, axis=2).reshape(bk)
    c = dict(cur=cur, running=running, running_scores=running_scores, running_idx=running_idx,
             seqs=seqs, beam_scores=beam_scores, beam_idx=beam_idx, finished=finished, unsat=unsat)
    return c, parents, last, go, log_probs


@partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9, 10, 11, 12, 13))
def search(cfg, params, ids, mask, st, max_new, k, n_return, length_penalty, early_stop,
           eos, pad, output_scores, backend: Backend, stop_token=None, lora=None):
    """`_search` with LoRA adapters applied (model/lora.py's Lora of the rows; None: the base model)."""
    with applied(lora):
        return _search(cfg, params, ids, mask, st, max_new, k, n_return, length_penalty, early_stop, eos, pad,
                       output_scores, backend, stop_token)


def _search(cfg, params, ids, mask, st, max_new, k, n_return, length_penalty, early_stop,
            eos, pad, output_scores, backend: Backend, stop_token=None):
    """The whole search on device: decodes and beam_step in one jitted loop -> ((seqs, beam_idx) of the
    n_return best per prompt, processed log-probs [max_new, B*K, V] (or [0, ...]), their scores).
    `stop_token` (from `stoppable`): before each step the loop asks the host whether to stop (then its
    results are partial: the caller raises SearchStopped); None: no host call, the loop runs on device."""
    bk, s = ids.shape
    b = bk // k
    n_real = jnp.sum(mask, axis=1).astype(jnp.int32)  # [B*K]; equal within a batch item
    prompt_seen = sampling.init_state(ids, mask, cfg.vocab_size, s + max_new)
    scores_buf = jnp.zeros((max_new if output_scores else 0, bk, cfg.vocab_size), jnp.float32)
    logits, cache = steps.start(cfg, params, ids, mask, max_new, backend)

    def step(carry):
        c, logits, cache, _, scores_buf = carry
        cur = c["cur"]
        c, parents, last, go, log_probs = beam_step(k, s, length_penalty, early_stop, eos, logits, c, prompt_seen, st)
        if output_scores:
            scores_buf = scores_buf.at[cur - s].set(log_probs)
        cache = kv_cache.reorder(cache, parents)
        logits, cache = jax.lax.cond(
            go,
            # the write index a scalar: see sample.search
            lambda: steps.decode_step(cfg, params, cache, last, n_real + (cur - s), cur, backend=backend),
            lambda: (logits, cache))
        return c, logits, cache, go, scores_buf

    def go_on(carry):
        if stop_token is None:
            return carry[3]
        return carry[3] & ~io_callback(_stopped, jax.ShapeDtypeStruct((), jnp.bool_), stop_token)

    c = beam_init(ids, mask, k, s + max_new, pad if pad else eos)
    c, *_, scores_buf = jax.lax.while_loop(go_on, step, (c, logits, cache, jnp.bool_(True), scores_buf))
    flat = lambda x: x[:, :n_return].reshape((b * n_return,) + x.shape[2:])  # noqa: E731
    return (flat(c["seqs"]), flat(c["beam_idx"])), scores_buf, flat(c["beam_scores"])


def _state_from_history(prompt_state, hist, cur, v):
    """A sampling.State for beams whose history was just reordered (seen = prompt + generated)."""
    bk, L = hist.shape
    gen = (jnp.arange(L)[None, :] >= prompt_state.prompt_length[:, None]) & (jnp.arange(L) < cur)
    rows = jnp.broadcast_to(jnp.arange(bk)[:, None], (bk, L))
    seen = prompt_state.seen.at[rows, jnp.where(gen, hist, v)].set(True, mode="drop")
    counts = jnp.zeros((bk, v), jnp.int32).at[rows, jnp.where(gen, hist, v)].add(1, mode="drop")
    return sampling.State(history=hist, length=jnp.full((bk,), cur, jnp.int32),
                          prompt_length=prompt_state.prompt_length, seen=seen, counts=counts)

"""Hugging Face's `_sample` (greedy or sampled rows, transformers 5.23) as one compiled on-device loop over a whole
model's params, `search`, with no host round trip per token: what a whole-model stage runs for generate()
(runner/stage.py's `seq_generate`). The token choice it makes each step is also one jitted function of its own,
`pick_tokens`, which the pipelined host loop (runner/generate.py) runs between decodes, so the two choose alike.
Beam search's loop is beam_search.py's.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from opt_serving.backend import Backend, sampling
from opt_serving.model import kv_cache, opt, steps
from opt_serving.model.lora import applied


def processed_choice(logits, state, st, argmax=sampling.argmax):
    """HF's logits processors and warpers over logits [B, V], then each row's greedy or sampled token ->
    (tokens [B], the processed scores [B, V]: what output_scores returns)."""
    scores = sampling.warp(sampling.process_logits(logits, state, st), st)
    return sampling.choose(scores, state, st, argmax), scores


def append_tokens(tok, state, st, unfinished, pad):
    """Finished rows get `pad`; the tokens join the history; a row finishes at its EOS."""
    tok = jnp.where(unfinished, tok, pad)
    state = sampling.update_state(state, tok)
    return tok, state, unfinished & (tok != st.eos_token_id)


@partial(jax.jit, static_argnames=("argmax",))
def pick_tokens(logits, state, st, unfinished, pad, argmax=sampling.argmax):
    """One generate() step's choice from the next-token logits [B, V], as a jitted function of its own
    (a host loop's, e.g. over pipeline stages) -> (tokens, state, unfinished, processed scores)."""
    tok, scores = processed_choice(logits, state, st, argmax)
    return (*append_tokens(tok, state, st, unfinished, pad), scores)


def decode_windows(prompt_len: int, total: int) -> list[int]:
    """The cache sizes a generation of `total` positions runs through (kv_cache.windows): powers of two from the
    first that holds the prompt and its first new token, then `total`."""
    return kv_cache.windows(total, kv_cache.bucket_length(prompt_len + 1, total))


@partial(jax.jit, static_argnums=(0, 6, 7, 8, 9))
def search(cfg, params, ids, mask, st, max_new, new_bucket, pad, output_scores, backend: Backend, lora=None):
    """`_search` with LoRA adapters applied (model/lora.py's Lora of the rows; None: the base model)."""
    with applied(lora):
        return _search(cfg, params, ids, mask, st, max_new, new_bucket, pad, output_scores, backend)


def _search(cfg, params, ids, mask, st, max_new, new_bucket, pad, output_scores, backend: Backend):
    """HF `_sample`: greedy or sampled rows, finished rows filled with pad; stops when all are done.

    `max_new` is traced; buffers are sized by the static `new_bucket` >= max_new. The cache
    starts at the smallest window holding the prompt and grows a window at a time
    (decode_windows): one decode loop per window. With the backend's attention kernel, which
    reads only the entries written so far, the cache is full-size from the start and there is
    one loop.

    Steps where every row takes the plain argmax (sampling.plain_argmax) go through opt.lm_argmax: no
    sampling processors, and with the backend's screened greedy head not even the logits."""
    b, s = ids.shape
    total = s + new_bucket
    windows = [total] if backend.attention else decode_windows(s, total)
    n_real = jnp.sum(mask, axis=1).astype(jnp.int32)
    h, cache = steps.start(cfg, params, ids, mask, windows[0] - s, backend, return_hidden=True)
    state = sampling.init_state(ids, mask, cfg.vocab_size, total)
    scores_buf = jnp.zeros((new_bucket if output_scores else 0, b, cfg.vocab_size), jnp.float32)
    plain_when_greedy = not output_scores

    def choice(h, state):
        return processed_choice(opt.lm_logits(params, h, backend), state, st, backend.argmax)

    def pick(h, state, unfinished, scores_buf, i):  # h: final hidden states [B, D]
        if plain_when_greedy:
            tok = jax.lax.cond(sampling.plain_argmax(state, st),
                               lambda: opt.lm_argmax(params, h, sampling.held_back(state, st), backend),
                               lambda: choice(h, state)[0])
        else:
            tok, scores = choice(h, state)
            if output_scores:
                scores_buf = scores_buf.at[i].set(scores)
        tok, state, unfinished = append_tokens(tok, state, st, unfinished, pad)
        return tok, state, unfinished, scores_buf

    tok, state, unfinished, scores_buf = pick(h, state, jnp.ones((b,), jnp.bool_), scores_buf, 0)

    def body(c):
        i, tok, cache, state, unfinished, scores_buf = c
        # one write index for all rows (a scalar): an in-place slice update, where a per-row
        # scatter makes XLA copy the loop-carried cache every step
        h, cache = steps.decode_step(cfg, params, cache, tok, n_real + i - 1, s + i - 1,
                                     read_len=s + i, return_hidden=True, backend=backend)
        tok, state, unfinished, scores_buf = pick(h, state, unfinished, scores_buf, i)
        return i + 1, tok, cache, state, unfinished, scores_buf

    carry = (jnp.int32(1), tok, cache, state, unfinished, scores_buf)
    for j, window in enumerate(windows):
        if j:
            carry = carry[:2] + (kv_cache._resize(carry[2], window),) + carry[3:]
        # step i writes entry s + i - 1: this window holds the steps up to i = window - s
        carry = jax.lax.while_loop(
            lambda c, last=window - s: (c[0] < max_new) & (c[0] <= last) & jnp.any(c[4]), body, carry)
    n_steps, _, _, state, _, scores_buf = carry
    return state.history, n_steps, scores_buf

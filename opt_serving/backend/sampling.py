"""Logits processors and samplers, batched, with per-row settings given as arrays.

generate() and the engine both call `sample(logits, state, settings)` inside
their jitted steps. Every setting is a `[B]` array (never a compile-time
constant), so rows with different requests share one compiled step.

Processors apply in Hugging Face's order (transformers 5.23 `_get_logits_processor`), after OpenAI's
`logit_bias` (added to the raw logits) and a structured-output token mask (`allowed`):
repetition penalty, (OpenAI presence/frequency penalties), no-repeat n-gram,
bad words, min length, min new tokens; then, for sampled rows only,
temperature, top-k, top-p. Rows with temperature 0 take the argmax (greedy).

Each row's randomness comes from its own seed and step, so a seeded request
samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf
MAX_NGRAM = 8  # longest no_repeat_ngram_size supported (a static unroll bound)


@flax.struct.dataclass
class Settings:
    """Per-row sampling settings, every field shaped [B] (bad_words [B, W, L], bias_ids / bias_values [B, K])."""
    temperature: jax.Array         # float32; 0 = greedy
    top_k: jax.Array               # int32; 0 = off
    top_p: jax.Array               # float32; 1 = off
    min_p: jax.Array               # float32; 0 = off (vLLM's: drop tokens below min_p x the top probability)
    repetition_penalty: jax.Array  # float32; 1 = off (HF/CTRL: divide positive logits of seen tokens)
    presence_penalty: jax.Array    # float32; OpenAI: minus this once per generated token type
    frequency_penalty: jax.Array   # float32; OpenAI: minus this times the generated count
    no_repeat_ngram_size: jax.Array  # int32; 0 = off, at most MAX_NGRAM
    min_length: jax.Array          # int32; EOS banned while history length < this (HF min_length)
    min_new_tokens: jax.Array      # int32; EOS banned while generated tokens < this
    eos_token_id: jax.Array        # int32; -1 = none
    seed: jax.Array                # uint32
    bad_words: jax.Array           # int32 [B, W, L]: banned sequences, right-padded with -1
    bias_ids: jax.Array            # int32 [B, K]: OpenAI's logit_bias, token ids (-1: none) ...
    bias_values: jax.Array         # float32 [B, K]: ... and what is added to their logits


def make_settings(batch: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                  presence_penalty=0.0, frequency_penalty=0.0, no_repeat_ngram_size=0,
                  min_length=0, min_new_tokens=0, eos_token_id=-1, seed=0,
                  bad_words_ids: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]] | None = None,
                  logit_bias: Sequence | None = None, bias_width: int = 0) -> Settings:
    """Settings for `batch` rows; each argument is a scalar (all rows) or a length-`batch` sequence.

    `bad_words_ids` is one list of token sequences for every row, or a list per row. `logit_bias`: one
    {token id: bias} mapping (or (id, bias) pairs) per row, or None; `bias_width`: the entries a row can hold
    (at least the most any row has), so that settings of any requests have one shape."""
    # device_put, not jnp.asarray: this JAX compiles a program for every shape jnp.asarray copies from numpy
    # (hundreds over an engine's warm-up, each held for good)
    def arr(x, dtype):
        return jax.device_put(np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype), (batch,))))
    ngram = np.asarray(no_repeat_ngram_size)
    if ngram.max(initial=0) > MAX_NGRAM:
        raise ValueError(f"no_repeat_ngram_size above {MAX_NGRAM} is not supported")
    return Settings(
        temperature=arr(temperature, np.float32), top_k=arr(top_k, np.int32),
        top_p=arr(top_p, np.float32), min_p=arr(min_p, np.float32),
        repetition_penalty=arr(repetition_penalty, np.float32),
        presence_penalty=arr(presence_penalty, np.float32),
        frequency_penalty=arr(frequency_penalty, np.float32),
        no_repeat_ngram_size=arr(ngram, np.int32), min_length=arr(min_length, np.int32),
        min_new_tokens=arr(min_new_tokens, np.int32), eos_token_id=arr(eos_token_id, np.int32),
        seed=arr(np.asarray(seed, np.int64) % (1 << 32), np.uint32),
        bad_words=jax.device_put(pack_bad_words(bad_words_ids, batch)),
        **{k: jax.device_put(v) for k, v in zip(("bias_ids", "bias_values"),
                                              pack_logit_bias(logit_bias, batch, bias_width))})


def pack_logit_bias(logit_bias, batch: int, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-row logit biases ({id: bias} or (id, bias) pairs, or None) -> (int32 ids [batch, K] padded with -1,
    float32 biases [batch, K]), K the largest of `width` and the most entries of a row."""
    rows = [dict(r or {}) for r in (logit_bias or [None] * batch)]
    if len(rows) != batch:
        raise ValueError(f"logit_bias has {len(rows)} rows for a batch of {batch}")
    k = max([width] + [len(r) for r in rows])
    ids, values = np.full((batch, k), -1, np.int32), np.zeros((batch, k), np.float32)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = list(r.keys())
        values[b, :len(r)] = list(r.values())
    return ids, values


def pack_bad_words(bad_words_ids, batch: int) -> np.ndarray:
    """Bad word sequences -> int32 [batch, W, L] padded with -1 (W = 0 when none)."""
    if not bad_words_ids:
        return np.full((batch, 0, 1), -1, np.int32)
    nested = any(len(x) and isinstance(x[0], (list, tuple, np.ndarray)) for x in bad_words_ids)
    per_row = bad_words_ids if nested else [bad_words_ids] * batch
    if len(per_row) != batch:
        raise ValueError(f"bad_words_ids has {len(per_row)} rows for a batch of {batch}")
    for words in per_row:
        for w in words:
            if len(w) == 0 or any(int(t) < 0 for t in w):
                raise ValueError(f"bad_words_ids entries must be non-empty lists of token ids, got {w}")
    w_max = max(len(words) for words in per_row)
    l_max = max(len(w) for words in per_row for w in words)
    out = np.full((batch, w_max, l_max), -1, np.int32)
    for b, words in enumerate(per_row):
        for i, w in enumerate(words):
            out[b, i, :len(w)] = w
    return out


@flax.struct.dataclass
class State:
    """What the processors need to know about each row's tokens so far."""
    history: jax.Array        # int32 [B, L]: prompt (as the model saw it, pads included) + generated
    length: jax.Array         # int32 [B]: valid entries of history
    prompt_length: jax.Array  # int32 [B]: entries of history that were the prompt
    seen: jax.Array           # bool [B, V]: token appeared in the real prompt or the generation
    counts: jax.Array         # int32 [B, V]: times each token was generated (OpenAI penalties)


@partial(jax.jit, static_argnums=(2, 3))
def init_state(prompt_ids, prompt_mask, vocab_size: int, max_len: int) -> State:
    """State for left-padded prompts [B, S]; history holds up to `max_len` tokens per row."""
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    prompt_mask = jnp.asarray(prompt_mask).astype(jnp.bool_)
    b, s = prompt_ids.shape
    if s > max_len:
        raise ValueError(f"prompt of {s} tokens does not fit a history of {max_len}")
    history = jnp.zeros((b, max_len), jnp.int32).at[:, :s].set(prompt_ids)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
    # pads write out of range and are dropped: the repetition penalty skips them, as HF does
    seen = jnp.zeros((b, vocab_size), jnp.bool_).at[
        rows, jnp.where(prompt_mask, prompt_ids, vocab_size)].set(True, mode="drop")
    length = jnp.full((b,), s, jnp.int32)
    return State(history=history, length=length, prompt_length=length, seen=seen,
                 counts=jnp.zeros((b, vocab_size), jnp.int32))


@jax.jit
def update_state(state: State, tokens, active=None) -> State:
    """Append one token per row (only to rows where `active`, when given: the others stay as they are)."""
    rows = jnp.arange(tokens.shape[0])
    step = 1
    if active is not None:
        # inactive rows scatter out of range and are dropped: no pass over the whole [B, V] state
        rows = jnp.where(active, rows, tokens.shape[0])
        step = active.astype(jnp.int32)
    return state.replace(
        history=state.history.at[rows, state.length].set(tokens, mode="drop"),
        length=state.length + step,
        seen=state.seen.at[rows, tokens].set(True, mode="drop"),
        counts=state.counts.at[rows, tokens].add(1, mode="drop"))


# ---- processors (HF order) ----

def _repetition_penalty(logits, state, s):
    p = s.repetition_penalty[:, None]
    penalised = jnp.where(logits < 0, logits * p, logits / p)
    return jnp.where(state.seen, penalised, logits)


def _openai_penalties(logits, state, s):
    c = state.counts.astype(logits.dtype)
    return logits - s.frequency_penalty[:, None] * c - s.presence_penalty[:, None] * (c > 0)


def _banned_ngram_mask(state, s, vocab):
    """bool [B, V]: tokens that would repeat an n-gram already in the history."""
    hist, length, n = state.history, state.length, s.no_repeat_ngram_size
    b, L = hist.shape
    starts = jnp.arange(L)  # candidate n-gram start j: hist[j : j+n]
    # hist[j+k] == hist[length-n+1+k] for every k < n-1 (the n-1 token prefix matches the tail)
    match = (starts[None, :] + n[:, None] <= length[:, None]) & (n[:, None] > 0) \
        & (length[:, None] + 1 >= n[:, None])
    for k in range(MAX_NGRAM - 1):
        a = jnp.take_along_axis(hist, jnp.clip(starts[None, :] + k, 0, L - 1), axis=1)
        tail = jnp.take_along_axis(hist, jnp.clip(length - n + 1 + k, 0, L - 1)[:, None], axis=1)
        match &= (k >= n[:, None] - 1) | (a == tail)
    banned_tok = jnp.take_along_axis(hist, jnp.clip(starts[None, :] + n[:, None] - 1, 0, L - 1),
                                     axis=1)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, L))
    return jnp.zeros((b, vocab), jnp.bool_).at[rows, jnp.where(match, banned_tok, vocab)].set(
        True, mode="drop")


def _bad_words_mask(state, s, vocab):
    """bool [B, V]: last tokens of bad words whose prefix ends the history (single tokens always)."""
    words = s.bad_words  # [B, W, Lw]
    b, w, lw = words.shape
    wlen = jnp.sum(words >= 0, axis=-1)  # [B, W]
    hist, length = state.history, state.length
    ok = (wlen > 0) & (wlen - 1 <= length[:, None])
    # HF drops bad words that are exactly one EOS token
    ok &= ~((wlen == 1) & (words[..., 0] == s.eos_token_id[:, None]))
    L = hist.shape[1]
    for k in range(lw - 1):
        idx = jnp.clip(length[:, None] - (wlen - 1) + k, 0, L - 1)  # [B, W]
        h = jnp.take_along_axis(hist, idx, axis=1)
        ok &= (k >= wlen - 1) | (h == words[..., k])
    last = jnp.take_along_axis(words, jnp.clip(wlen - 1, 0, lw - 1)[..., None], axis=-1)[..., 0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
    return jnp.zeros((b, vocab), jnp.bool_).at[rows, jnp.where(ok, last, vocab)].set(
        True, mode="drop")


def add_logit_bias(logits, s: Settings):
    """OpenAI's logit_bias: each row's biases added to the logits of their tokens (a scatter of B x K
    entries, not a pass over [B, V]); rows without any pass as they are."""
    if not s.bias_ids.shape[1]:
        return logits
    v = logits.shape[-1]
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], s.bias_ids.shape)
    ids = jnp.where(s.bias_ids >= 0, s.bias_ids, v)  # none: out of range, dropped
    return jax.lax.cond(jnp.any(s.bias_ids >= 0),
                        lambda x: x.at[rows, ids].add(s.bias_values.astype(x.dtype), mode="drop"),
                        lambda x: x, logits)


def unpack_bitmask(bitmask, vocab: int):
    """A token bitmask int32 [B, W] (token t allowed where bit t % 32 of word t // 32 is set, as llguidance and
    xgrammar write them) -> bool [B, vocab]."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab] > 0


def allow_only(logits, allowed):
    """Structured output: `allowed` = (bitmask int32 [B, W], constrained bool [B]); a constrained row's tokens
    outside its mask get -inf, the other rows pass as they are (and a step with none skips the pass)."""
    if allowed is None:
        return logits
    bitmask, constrained = allowed
    return jax.lax.cond(
        jnp.any(constrained),
        lambda x: jnp.where(constrained[:, None] & ~unpack_bitmask(bitmask, x.shape[-1]), NEG_INF, x),
        lambda x: x, logits)


@jax.jit
def process_logits(logits, state: State, s: Settings):
    """The non-warping processors, HF order, after the logit bias; float32 [B, V] in and out."""
    logits = add_logit_bias(logits.astype(jnp.float32), s)
    v = logits.shape[-1]
    # each pass over [B, V] costs real time at large batch: skip what no row asks for
    logits = jax.lax.cond(jnp.any(s.repetition_penalty != 1.0),
                          lambda: _repetition_penalty(logits, state, s), lambda: logits)
    logits = jax.lax.cond(jnp.any((s.presence_penalty != 0) | (s.frequency_penalty != 0)),
                          lambda: _openai_penalties(logits, state, s), lambda: logits)
    logits = jax.lax.cond(jnp.any(s.no_repeat_ngram_size > 0),
                          lambda: jnp.where(_banned_ngram_mask(state, s, v), NEG_INF, logits),
                          lambda: logits)
    if s.bad_words.shape[1]:  # the engine always has bad-word slots; most requests leave them empty
        logits = jax.lax.cond(jnp.any(s.bad_words >= 0),
                              lambda: jnp.where(_bad_words_mask(state, s, v), NEG_INF, logits),
                              lambda: logits)
    return leave_out(logits, held_back(state, s))


def leave_out(logits, token):
    """logits [..., V] with each row's `token` [...] (int32, -1 for none) set to -inf: one entry per row,
    not a pass over [B, V]."""
    flat = logits.reshape(-1, logits.shape[-1])  # [rows, V]; index V (none) is dropped
    col = jnp.where(token < 0, flat.shape[-1], token).reshape(-1)
    return flat.at[jnp.arange(flat.shape[0]), col].set(NEG_INF, mode="drop").reshape(logits.shape)


def held_back(state: State, s: Settings):
    """Each row's EOS while min_length / min_new_tokens holds it back, else -1 -> int32 [B]."""
    eos_banned = (state.length < s.min_length) | (state.length - state.prompt_length < s.min_new_tokens)
    return jnp.where(eos_banned & (s.eos_token_id >= 0), s.eos_token_id, -1).astype(jnp.int32)


@partial(jax.jit, static_argnums=(2,))
def warp(logits, s: Settings, min_tokens_to_keep: int = 1):
    """Temperature, top-k, top-p as HF's warpers, then min-p as vLLM's (rows with temperature 0 pass through)."""
    sampled = s.temperature > 0
    logits = jax.lax.cond(  # an all-greedy batch skips the pass over [B, V]
        jnp.any(sampled),
        lambda x: jnp.where(sampled[:, None], x / jnp.where(sampled, s.temperature, 1.0)[:, None], x),
        lambda x: x, logits)
    need_sort = sampled & ((s.top_k > 0) | (s.top_p < 1.0))

    def topk_topp(logits):
        v = logits.shape[-1]
        order = jnp.argsort(logits, axis=-1)  # ascending, as HF's top-p sorts
        asc = jnp.take_along_axis(logits, order, axis=-1)
        k = jnp.clip(jnp.maximum(s.top_k, min_tokens_to_keep), 1, v)
        kth = jnp.take_along_axis(asc, (v - k)[:, None], axis=-1)
        use_k = (sampled & (s.top_k > 0))[:, None]
        asc = jnp.where(use_k & (asc < kth), NEG_INF, asc)
        cum = jnp.cumsum(jax.nn.softmax(asc, axis=-1), axis=-1)
        remove = (cum <= (1.0 - s.top_p)[:, None]) & (sampled & (s.top_p < 1.0))[:, None]
        remove = remove.at[:, v - min_tokens_to_keep:].set(False)
        asc = jnp.where(remove, NEG_INF, asc)
        # back to vocabulary order through the inverse permutation: a scatter into a fresh [B, V]
        # buffer here cost time on every step, even when this branch was not taken
        return jnp.take_along_axis(asc, jnp.argsort(order, axis=-1), axis=-1)

    # a full-vocabulary sort per row is the costly part: only when some row asks for it
    logits = jax.lax.cond(jnp.any(need_sort), topk_topp, lambda x: x, logits)
    use_min_p = sampled & (s.min_p > 0)

    def min_p(logits):  # a token stays if its probability is at least min_p times the likeliest one's
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        keep = probs >= s.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        return jnp.where(use_min_p[:, None] & ~keep, NEG_INF, logits)
    return jax.lax.cond(jnp.any(use_min_p), min_p, lambda x: x, logits)


def plain_argmax(state: State, s: Settings, active=None):
    """True (a traced scalar) when every row (every `active` one) takes the plain argmax of its raw
    logits, leaving out at most its held_back token: greedy, and no other processor changes a logit at
    this step. The logits then need not be made at all (Backend.greedy(params, h, held_back(state, s)))."""
    plain = ((s.temperature <= 0) & (s.repetition_penalty == 1.0) & (s.presence_penalty == 0)
             & (s.frequency_penalty == 0) & (s.no_repeat_ngram_size <= 0))
    if s.bad_words.shape[1]:
        plain = plain & ~jnp.any(s.bad_words >= 0, axis=(1, 2))
    if s.bias_ids.shape[1]:
        plain = plain & ~jnp.any(s.bias_ids >= 0, axis=1)
    if active is not None:
        plain = plain | ~active
    return jnp.all(plain)


def row_keys(s: Settings, step):
    """One PRNG key per row from its seed and its step (reproducible per request)."""
    return jax.vmap(lambda seed, t: jax.random.fold_in(jax.random.PRNGKey(seed), t))(
        s.seed, jnp.broadcast_to(step, s.seed.shape))


def argmax(x):
    """jnp.argmax over the last axis (first index of the maximum, NaN wins as in argmax) -> int32: plain XLA,
    the default of the functions here that take an `argmax` (a Backend's is faster on a CPU)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("argmax",))
def sample(logits, state: State, s: Settings, argmax: Callable = argmax, allowed=None):
    """Next token per row -> (tokens int32 [B], logprobs float32 [B, V]). `allowed`: structured output's
    token masks (`allow_only`), or None.

    logprobs are of the distribution the token was chosen from (processed, and
    warped for sampled rows)."""
    scores = warp(process_logits(allow_only(logits.astype(jnp.float32), allowed), state, s), s)
    return choose(scores, state, s, argmax), jax.nn.log_softmax(scores, axis=-1)


def choose(scores, state: State, s: Settings, argmax: Callable = argmax):
    """Argmax for greedy rows, a seeded categorical draw for sampled rows -> int32 [B]."""
    return choose_at(scores, s, state.length, argmax)


def choose_at(scores, s: Settings, length, argmax: Callable = argmax):
    """`choose` where each row has `length` [B] tokens before the one chosen: a sampled row's draw is keyed by its
    seed and that length (row_keys), so the same row at the same length draws the same token."""
    greedy = argmax(scores)

    def draw():
        keys = row_keys(s, length)
        # jax.random.categorical's Gumbel-max draw, through the given argmax
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, scores.shape[1:], scores.dtype))(keys)
        return jnp.where(s.temperature > 0, argmax(scores + gumbel), greedy)

    # drawing [B, V] random numbers is costly on a CPU: only when some row samples
    return jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda: greedy)

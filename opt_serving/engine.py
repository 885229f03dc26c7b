"""Continuous batching over a fixed number of decode slots (JetStream's shape).

Two layers, one file:
  * a slot model (`OPTSlots` here, `FakeSlots` in `testing/fake_engine.py`) owns the KV cache and the jitted
    steps: `prefill(tokens, settings) -> Prefix`, `insert(prefix, slot)`, `step() -> StepResult` (one decode over
    every slot), `free(slot)`. Sampling settings are per-slot arrays, so requests with different settings share
    a step.
  * `Engine`, the scheduler: a bounded queue and a background thread that admits queued requests into free
    slots (prefilled together when the slot model has `prefill_batch`), steps, and hands each request its
    tokens through a callback (called on the engine thread; the
    generator forwards them to asyncio with `loop.call_soon_threadsafe`). EOS, max_tokens, the context limit,
    a callback asking to stop (stop strings) and `cancel()` (client disconnects) free the slot before the next
    step.
No HTTP and no Ray here.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)

# top alternatives computed for every token; OpenAI's `logprobs` goes up to 5
MAX_TOP_LOGPROBS = 5
PREFILL_MIN_BUCKET = 8  # short prompts (chat turns, benchmarks) are not padded to 16: prefill is compute
# Prompts of a short bucket are prefilled PREFILL_BATCH_TOKENS // bucket at a time (OPT-125m, 2-core CPU: an
# 8-token prompt alone took 24.5 ms, mostly reading the weights; four in one pass 38.8 ms, 9.7 ms each; a
# pass of 32 tokens is close to compute-bound). A prompt alone takes the whole pass, hence the small number.
PREFILL_BATCH_TOKENS = 32
# bad words live in fixed-shape per-slot arrays so the decode step compiles once
MAX_BAD_WORDS, MAX_BAD_WORD_LEN = 8, 8


class QueueFull(RuntimeError):
    """The engine's request queue is at capacity (the service answers 429 with Retry-After)."""


class EngineClosed(RuntimeError):
    """The engine was closed (shutdown) before or while serving the request."""


@dataclasses.dataclass(frozen=True)
class SlotSettings:
    """One request's decoding settings; the slot model turns them into per-slot arrays."""
    max_tokens: int = 16
    min_tokens: int = 0             # stop tokens are masked out until this many tokens are generated
    temperature: float = 0.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF's: over prompt and generated tokens
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()   # finish "stop" when sampled (EOS); min_tokens holds back the first
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # HF's: a word's last token is banned after its prefix
    no_repeat_ngram_size: int = 0
    prompt_logprobs: bool = False   # score the prompt too (echo with logprobs)
    # the chosen tokens' log-probabilities (TokenInfo.logprob; None when off). A step where no slot wants
    # them and every slot is plainly greedy may then skip the logits (OPTSlots: the screened greedy head)
    logprob: bool = True
    top_logprobs: bool = True       # find each token's top alternatives (a top-k over the vocabulary)


@dataclasses.dataclass
class TokenInfo:
    """One token with the model's log-probability (log-softmax of raw logits) and the top alternatives."""
    id: int
    logprob: Optional[float]   # None for a prompt's first token, and when not asked (SlotSettings.logprob)
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # best first


@dataclasses.dataclass
class EngineOutput:
    """What a request's callback receives: prompt scores once, then each new token; the last has finish_reason."""
    tokens: list[TokenInfo]
    is_prompt: bool = False
    finish_reason: Optional[str] = None   # "stop" | "length" | "cancelled" | "error"
    error: Optional[BaseException] = None


@dataclasses.dataclass
class Prefix:
    """A prefilled request, ready to be inserted into a slot."""
    length: int                      # prompt tokens
    first: TokenInfo                 # the first generated token (sampled by prefill)
    prompt: Optional[list[TokenInfo]]  # prompt scores when settings.prompt_logprobs
    state: Any                       # the slot model's own (e.g. a batch-1 KV cache)
    settings: SlotSettings


@dataclasses.dataclass
class StepResult:
    """One decode step over all slots (rows of inactive slots are garbage)."""
    tokens: np.ndarray        # int32 [slots]
    logprobs: np.ndarray      # float32 [slots]
    top_ids: np.ndarray       # int32 [slots, MAX_TOP_LOGPROBS]
    top_logprobs: np.ndarray  # float32 [slots, MAX_TOP_LOGPROBS]

    def token(self, slot: int) -> TokenInfo:
        top = [(int(i), float(lp)) for i, lp in zip(self.top_ids[slot], self.top_logprobs[slot]) if i >= 0]
        return TokenInfo(int(self.tokens[slot]), float(self.logprobs[slot]), top)


class SlotModel(Protocol):
    num_slots: int
    max_seq_len: int
    vocab_size: int

    def warmup(self) -> None: ...
    def prefill(self, tokens: Sequence[int], settings: SlotSettings) -> Prefix: ...
    # optional: `prefill_batch(prompts, settings) -> list[Prefix]`, several requests at once (see Engine._prefill)
    def insert(self, prefix: Prefix, slot: int) -> None: ...
    def step(self) -> StepResult: ...
    def free(self, slot: int) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------------------

Callback = Callable[[EngineOutput], Optional[bool]]


class EngineRequest:
    """A handle on a submitted request; `Engine.cancel(handle)` stops it."""
    _ids = itertools.count()

    def __init__(self, prompt: list[int], settings: SlotSettings, on_output: Callback):
        self.id = next(self._ids)
        self.prompt = prompt
        self.settings = settings
        self.on_output = on_output
        self.slot: Optional[int] = None
        self.generated = 0
        self.cancelled = False
        self.done = False
        self.submitted_at = time.monotonic()


@dataclasses.dataclass
class EngineStats:
    queue_length: int
    running: int              # occupied slots
    num_slots: int
    steps: int                # decode steps run
    step_tokens: int          # tokens produced by decode steps (sum of active slots per step)
    prefills: int
    generated_tokens: int     # all generated tokens, prefill's first tokens included
    prompt_tokens: int
    last_step_batch: int      # active slots in the latest step
    active_per_step: dict[int, int]  # {active slots: number of steps with that many}

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0


class Engine:
    """Scheduler thread over a slot model: bounded queue, admission into free slots, one step for all."""

    def __init__(self, model: SlotModel, max_queue: int = 256, start: bool = True):
        self.model = model
        self.max_queue = max_queue
        self._queue: collections.deque[EngineRequest] = collections.deque()
        self._slots: list[Optional[EngineRequest]] = [None] * model.num_slots
        self._cv = threading.Condition()
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        self._steps = self._step_tokens = self._prefills = self._generated = self._prompt_tokens = 0
        self._last_batch = 0
        self._active_hist: collections.Counter[int] = collections.Counter()
        if start:
            self.start()

    # ---- public, thread-safe ----
    @property
    def num_slots(self) -> int:
        return self.model.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def warmup(self) -> None:
        """Compile every prefill bucket and the decode step now, not at the first request."""
        self.model.warmup()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="opt-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt: Sequence[int], settings: SlotSettings, on_output: Callback) -> EngineRequest:
        """Queue a request. `on_output` runs on the engine thread for the prompt scores (if asked), every
        new token and the finish; it returns True to stop the request (its slot is freed at once).
        Raises QueueFull, EngineClosed, or ValueError for a prompt that cannot fit."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        need = len(prompt) + max(settings.max_tokens, 0)
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({settings.max_tokens}) = {need} "
                             f"exceeds the maximum context length of {self.max_seq_len} tokens")
        words = settings.bad_words_ids
        if len(words) > MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_BAD_WORD_LEN for w in words):
            raise ValueError(f"bad_words_ids: at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_LEN} tokens each")
        req = EngineRequest(prompt, settings, on_output)
        with self._cv:
            if self._closing:
                raise EngineClosed("the engine is shut down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"request queue is full ({self.max_queue} waiting)")
            self._queue.append(req)
            self._cv.notify()
        return req

    def cancel(self, req: EngineRequest) -> None:
        """Stop a request (client gone); its slot is freed before the next step. No callback follows."""
        with self._cv:
            req.cancelled = True
            if req.slot is None and req in self._queue:
                self._queue.remove(req)
                req.done = True
            self._cv.notify()

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(
                queue_length=len(self._queue), running=sum(r is not None for r in self._slots),
                num_slots=self.num_slots, steps=self._steps, step_tokens=self._step_tokens,
                prefills=self._prefills, generated_tokens=self._generated,
                prompt_tokens=self._prompt_tokens, last_step_batch=self._last_batch,
                active_per_step=dict(self._active_hist))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread; queued and running requests finish with EngineClosed."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._cv:
            pending = list(self._queue) + [r for r in self._slots if r is not None]
            self._queue.clear()
        for req in pending:
            self._fail(req, EngineClosed("the engine shut down before the request finished"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- engine thread ----
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closing or self._queue or any(self._slots)):
                    self._cv.wait()
                if self._closing:
                    return
            # cancelled requests leave their slots before anything else runs
            for req in self._slots:
                if req is not None and req.cancelled:
                    self._release(req)
            with self._cv:
                admit = []
                free = self._slots.count(None)
                while self._queue and len(admit) < free:
                    req = self._queue.popleft()
                    if not req.cancelled:
                        admit.append(req)
            for req, prefix in zip(admit, self._prefill(admit)):
                try:
                    if isinstance(prefix, BaseException):
                        raise prefix
                    self._admit(req, self._slots.index(None), prefix)
                except Exception as e:  # this request fails, the others carry on
                    log.exception("request %d: prefill failed", req.id)
                    self._fail(req, e)
            if any(self._slots):
                try:
                    self._step()
                except Exception as e:  # a failed step fails the requests in it, the engine keeps serving
                    log.exception("engine step failed")
                    for req in [r for r in self._slots if r is not None]:
                        self._fail(req, e)

    def _prefill(self, reqs: list[EngineRequest]) -> list:
        """A Prefix (or the exception that stopped it) per request: together where the slot model has
        `prefill_batch`, and one by one if that fails, so only the request that caused it fails."""
        batched = getattr(self.model, "prefill_batch", None)
        if batched is not None and len(reqs) > 1:
            try:
                return batched([r.prompt for r in reqs], [r.settings for r in reqs])
            except Exception:
                log.exception("prefilling %d requests together failed; prefilling them one by one", len(reqs))
        out = []
        for req in reqs:
            try:
                out.append(self.model.prefill(req.prompt, req.settings))
            except Exception as e:
                out.append(e)
        return out

    def _admit(self, req: EngineRequest, slot: int, prefix: Prefix) -> None:
        with self._cv:
            self._prefills += 1
            self._prompt_tokens += len(req.prompt)
        if prefix.prompt is not None and self._emit(req, EngineOutput(prefix.prompt, is_prompt=True)):
            return
        if req.settings.max_tokens <= 0:  # scoring only (echo with max_tokens=0)
            self._finish(req, EngineOutput([], finish_reason="length"))
            return
        req.slot = slot
        self._slots[slot] = req
        self.model.insert(prefix, slot)
        self._deliver(req, prefix.first)

    def _step(self) -> None:
        result = self.model.step()
        active = [r for r in self._slots if r is not None]
        with self._cv:
            self._steps += 1
            self._step_tokens += len(active)
            self._last_batch = len(active)
            self._active_hist[len(active)] += 1
        for req in active:
            self._deliver(req, result.token(req.slot))

    def _deliver(self, req: EngineRequest, tok: TokenInfo) -> None:
        """Hand one new token to the request and free its slot if it finished."""
        if req.cancelled:  # cancelled during the step: the token is dropped
            self._release(req)
            return
        req.generated += 1
        with self._cv:
            self._generated += 1
        s = req.settings
        if not s.logprob:  # not asked: the same answer whether or not this step made the logits
            tok = dataclasses.replace(tok, logprob=None)  # (top alternatives follow top_logprobs)
        reason = None
        if tok.id in s.stop_token_ids and req.generated > s.min_tokens:
            reason = "stop"
        elif req.generated >= s.max_tokens or len(req.prompt) + req.generated >= self.max_seq_len:
            reason = "length"
        out = EngineOutput([tok], finish_reason=reason)
        if reason is not None:
            self._finish(req, out)
        elif self._emit(req, out):
            self._release(req)

    def _emit(self, req: EngineRequest, out: EngineOutput) -> bool:
        """Call the request's callback; True means the request is over (asked to stop, cancelled or failed)."""
        if req.cancelled:
            self._release(req)
            return True
        try:
            stop = bool(req.on_output(out))
        except Exception:
            log.exception("request %d: output callback failed; cancelling it", req.id)
            stop = True
        if stop:
            self._release(req)
        return stop

    def _finish(self, req: EngineRequest, out: EngineOutput) -> None:
        # the slot is free before the client hears it is done (a /metrics scrape right after shows it)
        cancelled = req.cancelled
        self._release(req)
        if not cancelled:
            self._emit(req, out)

    def _release(self, req: EngineRequest) -> None:
        req.done = True
        if req.slot is not None:
            self.model.free(req.slot)
            self._slots[req.slot] = None
            req.slot = None

    def _fail(self, req: EngineRequest, error: BaseException) -> None:
        if not req.done and not req.cancelled:
            try:
                req.on_output(EngineOutput([], finish_reason="error", error=error))
            except Exception:
                log.exception("request %d: output callback failed", req.id)
        try:
            self._release(req)
        except Exception:  # the slot model may be the thing that broke
            log.exception("request %d: could not free its slot", req.id)
            if req.slot is not None:
                self._slots[req.slot] = None
                req.slot = None


# ---------------------------------------------------------------------------------------------------------
# The real slot model: OPT on one device (jax/ models)
# ---------------------------------------------------------------------------------------------------------



def _prompt_state(ids, mask, lengths, rows: int, history_len: int, vocab: int):
    """Sampling state for k right-padded prompts (ids, mask [k, n]; lengths [k]) in the first k of `rows`
    rows: history = the prompt (pads as 0), seen = its real tokens."""
    import jax.numpy as jnp
    from opt_serving import sampling
    k, n = ids.shape
    history = jnp.zeros((rows, history_len), jnp.int32).at[:k, :n].set(ids * mask)
    at = jnp.broadcast_to(jnp.arange(k)[:, None], (k, n))
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[at, jnp.where(mask > 0, ids, vocab)].set(True, mode="drop")
    length = jnp.zeros((rows,), jnp.int32).at[:k].set(lengths)
    return sampling.State(history=history, length=length, prompt_length=length, seen=seen,
                          counts=jnp.zeros((rows, vocab), jnp.int32))


def _split_rows(tree, k: Optional[int] = None) -> list:
    """The first k (default: all) batch rows of every array in `tree`, as k batch-1 trees (what insert
    takes)."""
    import jax
    if k is None:
        k = jax.tree_util.tree_leaves(tree)[0].shape[0]
    return [jax.tree_util.tree_map(lambda a: a[j:j + 1], tree) for j in range(k)]


def _raw_scores(logits):
    """The model's own log-probabilities (before any processor) and the top alternatives, per row."""
    import jax
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, MAX_TOP_LOGPROBS)
    return lp, top_ids.astype("int32"), top_lp


def _token_scores(logits, tok, want_top):
    """The chosen tokens' log-probabilities [B] and, when `want_top`, the top alternatives ([B, K] ids
    and log-probabilities; ids -1 otherwise). Each pass over [B, V] costs milliseconds on a CPU at
    batch 32, so neither the full log-softmax nor an unwanted top-k is materialised."""
    import jax
    import jax.numpy as jnp
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B]
    lp = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - lse

    def top():
        vals, ids = jax.lax.top_k(logits, MAX_TOP_LOGPROBS)
        return ids.astype(jnp.int32), vals - lse[:, None]

    return lp, *jax.lax.cond(want_top, top, lambda: _no_top(logits.shape[0]))


def _no_top(b: int):
    """No top alternatives for b rows: ids -1 [b, K], log-probabilities 0 [b, K]."""
    import jax.numpy as jnp
    return jnp.full((b, MAX_TOP_LOGPROBS), -1, jnp.int32), jnp.zeros((b, MAX_TOP_LOGPROBS), jnp.float32)


class OPTSlots:
    """`SlotModel` over the Flax OPT in `model/opt.py`: one batch-`num_slots` KV cache of `max_seq_len` entries.

    Prompts are right-padded to a bucket (powers of two from 8), so a slot's tokens sit at cache entries
    0..n-1 and each decode writes at the token's own position; prompts of the short buckets are prefilled
    several to a pass (`batch_rows`). The cache holds only the window the longest active slot needs (powers
    of two from 16): it grows and shrinks by a bucket at a time, where slicing a window out of a full-length
    cache made XLA copy it every step (~20% of a step at 32 slots). With the CPU attention kernel, which
    reads only the entries written so far, it only grows (a shrink is a copy of the whole cache that buys
    nothing; resizing cost ~2% of a served run). Per-slot sampling state and settings are
    `sampling.State` / `sampling.Settings` rows; all prefill buckets, their inserts, the decode step and free
    compile in `warmup()`."""

    def __init__(self, cfg, params, num_slots: int = 8, max_seq_len: Optional[int] = None):
        # jax is imported here, not at the top, so the fake engine (service tests) stays light to import
        import jax
        import jax.numpy as jnp
        from opt_serving import sampling
        from opt_serving.model import cpu_kernels, kv_cache, opt
        # one device: q/k/v as one matmul, on a CPU pre-packed (opt.runtime_params; a tensor-parallel
        # plan's params stay split by heads)
        self.cfg, self.params = cfg, opt.runtime_params(params)
        self.num_slots = num_slots
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.vocab_size = cfg.vocab_size
        dtype = opt.param_dtype(params)
        L, V = self.max_seq_len, cfg.vocab_size
        self.buckets = sorted({kv_cache.bucket_length(n, L, PREFILL_MIN_BUCKET)
                               for n in [1] + [2 ** i for i in range(3, 16)] + [L]
                               if n <= L})
        self.windows = sorted({kv_cache.bucket_length(n, L) for n in [1] + [2 ** i for i in range(4, 16)] + [L]
                               if n <= L})
        self._empty_cache = lambda: kv_cache.init_cache(cfg, num_slots, self.windows[0], dtype)  # smallest window
        self.cache = self._empty_cache()
        empty = jnp.zeros((num_slots, 1), jnp.int32)
        # own buffers per leaf (init_state shares one for length and prompt_length): the step donates them
        self.state = jax.tree_util.tree_map(jnp.copy, sampling.init_state(empty, empty, V, L))
        self.settings = self._settings_rows([], num_slots)
        self.active = jnp.zeros(num_slots, jnp.bool_)
        # host copy of each slot's token count (0 = free): picks the step's cache window and read length
        self._lengths = np.zeros(num_slots, np.int64)
        self._want_top = np.zeros(num_slots, np.bool_)  # host copy: does any active slot want alternatives
        self._want_lp = np.zeros(num_slots, np.bool_)   # ... or its tokens' log-probabilities

        # The model steps compile once per prefill bucket / attention window; sampling (a large graph
        # of per-row processors) compiles for batch 1, for a batched prefill pass and for the slots, not inside each.
        def prefill(params, ids, mask, lengths, want_prompt, state_rows):
            """k right-padded prompts [k, bucket] in one pass -> k batch-1 caches, their sampling state and
            last hidden states padded to `state_rows` rows (one `choose` compile serves every batched pass),
            and the prompt scores [k, bucket, ...] of rows that `want_prompt` (zeros otherwise)."""
            k, n = ids.shape
            cache = kv_cache.init_cache(cfg, k, n, dtype)
            h, cache = opt._prefill(cfg, params, cache, ids, mask, return_hidden=True)  # [k, bucket, D]
            last = jnp.zeros((state_rows, h.shape[-1]), h.dtype).at[:k].set(h[jnp.arange(k), lengths - 1])

            def prompt_scores():  # position i predicts token i+1; the full logits only when asked
                plp, ptop, ptop_lp = _raw_scores(opt.lm_logits(params, h))  # [k, bucket, V], [k, bucket, K] x 2
                return jnp.take_along_axis(plp, jnp.roll(ids, -1, axis=1)[..., None], axis=-1)[..., 0], ptop, ptop_lp

            none = lambda: (jnp.zeros((k, n), jnp.float32), jnp.zeros((k, n, MAX_TOP_LOGPROBS), jnp.int32),
                            jnp.zeros((k, n, MAX_TOP_LOGPROBS), jnp.float32))
            return (_split_rows(cache, k), _prompt_state(ids, mask, lengths, state_rows, L, V), last,
                    jax.lax.cond(jnp.any(want_prompt), prompt_scores, none))

        screened = cpu_kernels.has_head(self.params)

        def choose(params, h, state, settings, active, want_scores, want_top):
            """One token per row from the final hidden states h [B, D], scored when `want_scores`, appended
            to the rows that are `active`. When no row wants scores and every active row takes the plain
            argmax, params with the screened greedy head never make the logits (opt.lm_argmax); the
            scores are then NaN."""
            def full():
                logits = opt.lm_logits(params, h)  # [B, V]
                tok, _ = sampling.sample(logits, state, settings)
                return (tok, *_token_scores(logits, tok, want_top))

            def plain():
                tok = opt.lm_argmax(params, h, sampling.held_back(state, settings))
                return (tok, jnp.full(tok.shape, jnp.nan, jnp.float32), *_no_top(h.shape[0]))
            out = jax.lax.cond(~want_scores & sampling.plain_argmax(state, settings, active), plain, full) \
                if screened else full()
            # free slots keep their state, so their positions never run past the cache
            state = sampling.update_state(state, out[0], active)
            return state, out

        # the cache part compiles per (window, prefill bucket) pair, so it is kept apart from the rest
        def insert(state, settings, active, row_state, row_settings, slot):
            put = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=0)
            return (jax.tree_util.tree_map(put, state, row_state),
                    jax.tree_util.tree_map(put, settings, row_settings), active.at[slot].set(True))

        # packed params on a CPU: the decode attention kernel reads only the entries written so far
        # (up to the longest slot), not the whole window
        self.read_written = read_written = cpu_kernels.is_packed(self.params)

        def step(params, cache, state, active, read_len):
            rows = jnp.arange(num_slots)
            pos = jnp.where(active, state.length - 1, 0)  # the newest token goes in at its own position
            tokens = state.history[rows, pos]
            h, cache = opt._decode(cfg, params, cache, tokens, pos, pos,
                                   read_len=read_len if read_written else None, return_hidden=True)
            return h, cache

        def free(cache, active, slot):
            return kv_cache.free_slot(cache, slot), active.at[slot].set(False)

        self._prefill = jax.jit(prefill, static_argnums=(5,))
        self._split_rows = jax.jit(_split_rows)  # a pass's sampling state and settings -> batch-1 rows
        # short prompt buckets -> rows a pass (at most the slots: never more requests are admitted at once).
        # Every prompt of such a bucket runs in a pass of that many rows, even alone: a prompt's numbers
        # then never depend on the requests it was batched with (XLA's elementwise ops can round an ulp
        # differently at another shape, enough to flip a near-tied greedy token).
        self.batch_rows = {b: PREFILL_BATCH_TOKENS // b for b in self.buckets
                           if 2 * b <= PREFILL_BATCH_TOKENS and PREFILL_BATCH_TOKENS // b <= num_slots}
        # a batched pass chooses its first tokens over this many rows (padded): sampling costs a pass over
        # [rows, V] per processor, so not the slots' 32 rows for 4 prompts, and one compile for all passes
        self.pass_rows = max(self.batch_rows.values(), default=1)
        self._choose = jax.jit(choose, donate_argnums=(2,))
        self._insert = jax.jit(insert, donate_argnums=(0, 1, 2))
        # its own compiled copies (jit shares the compile cache of a function among its wrappers)
        self._insert_cache = jax.jit(lambda cache, pcache, slot: kv_cache._insert(cache, pcache, slot),
                                     donate_argnums=(0,))
        self._resize = jax.jit(lambda cache, n: kv_cache._resize(cache, n), static_argnums=(1,))
        self._step = jax.jit(step, donate_argnums=(1,))
        self._free = jax.jit(free, donate_argnums=(0, 1))

    @staticmethod
    def _settings_rows(rows: Sequence[SlotSettings], batch: int):
        """`sampling.Settings` of `batch` rows: these requests' settings, then defaults."""
        from opt_serving import sampling
        rows = list(rows) + [SlotSettings()] * (batch - len(rows))
        bad = np.full((batch, MAX_BAD_WORDS, MAX_BAD_WORD_LEN), -1, np.int32)
        for r, s in enumerate(rows):
            if len(s.bad_words_ids) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_LEN for w in s.bad_words_ids):
                raise ValueError(f"at most {MAX_BAD_WORDS} bad words of up to {MAX_BAD_WORD_LEN} tokens each")
            for i, w in enumerate(s.bad_words_ids):
                bad[r, i, :len(w)] = w
        col = lambda f: [f(s) for s in rows]
        settings = sampling.make_settings(
            batch, temperature=col(lambda s: s.temperature), top_k=col(lambda s: s.top_k),
            top_p=col(lambda s: s.top_p), repetition_penalty=col(lambda s: s.repetition_penalty),
            presence_penalty=col(lambda s: s.presence_penalty),
            frequency_penalty=col(lambda s: s.frequency_penalty),
            no_repeat_ngram_size=col(lambda s: s.no_repeat_ngram_size), min_new_tokens=col(lambda s: s.min_tokens),
            eos_token_id=col(lambda s: s.stop_token_ids[0] if s.stop_token_ids else -1),
            seed=col(lambda s: s.seed % 2 ** 63))
        return settings.replace(bad_words=bad)

    def _right_padded(self, prompts: Sequence[Sequence[int]], rows: int, bucket: int):
        """ids, mask [rows, bucket] and lengths [rows]: the prompts right-padded (a prompt owns cache
        entries 0..n-1), then rows of one pad token."""
        ids = np.full((rows, bucket), self.cfg.pad_token_id, np.int32)
        mask = np.zeros((rows, bucket), np.int32)
        lengths = np.ones(rows, np.int32)
        mask[:, 0] = 1
        for j, tokens in enumerate(prompts):
            ids[j, :len(tokens)] = tokens
            mask[j, :len(tokens)] = 1
            lengths[j] = len(tokens)
        return ids, mask, lengths

    def prefill(self, tokens: Sequence[int], settings: SlotSettings) -> Prefix:
        return self.prefill_batch([tokens], [settings])[0]

    def prefill_batch(self, prompts: Sequence[Sequence[int]], settings: Sequence[SlotSettings]) -> list[Prefix]:
        """`prefill` for several requests: prompts of a short bucket (`batch_rows`) share passes of a fixed
        number of rows, longer ones go one at a time."""
        from opt_serving.model.kv_cache import bucket_length
        out: list[Optional[Prefix]] = [None] * len(prompts)
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for i, tokens in enumerate(prompts):
            groups[bucket_length(len(tokens), self.max_seq_len, PREFILL_MIN_BUCKET)].append(i)
        for bucket, todo in groups.items():
            rows = self.batch_rows.get(bucket, 1)
            for at in range(0, len(todo), rows):
                chunk = todo[at:at + rows]
                for i, prefix in zip(chunk, self._prefill_pass(bucket, [prompts[i] for i in chunk],
                                                               [settings[i] for i in chunk])):
                    out[i] = prefix
        return out

    def _prefill_pass(self, bucket: int, prompts, settings) -> list[Prefix]:
        k, rows = len(prompts), self.batch_rows.get(bucket, 1)
        state_rows = self.pass_rows if rows > 1 else 1
        ids, mask, lengths = self._right_padded(prompts, rows, bucket)
        want_prompt = np.array([s.prompt_logprobs for s in settings] + [False] * (rows - k))
        caches, state, last, scores = self._prefill(self.params, ids, mask, lengths, want_prompt, state_rows)
        want_top = np.array([s.top_logprobs for s in settings] + [False] * (state_rows - k))
        want_scores = any(s.top_logprobs or s.logprob for s in settings)
        pass_settings = self._settings_rows(settings, state_rows)
        state, first = self._choose(self.params, last, state, pass_settings, np.arange(state_rows) < k,
                                    np.bool_(want_scores), np.bool_(want_top.any()))
        tok, lp, top_ids, top_lp = (np.asarray(a) for a in first)
        first = StepResult(tok, lp, np.where(want_top[:, None], top_ids, -1), top_lp)
        rows_state = self._split_rows((state, pass_settings)) if state_rows > 1 else [(state, pass_settings)]
        plp, ptop, ptop_lp = (np.asarray(a) for a in scores) if want_prompt.any() else (None,) * 3
        out = []
        for j, (tokens, s) in enumerate(zip(prompts, settings)):
            prompt = None
            if s.prompt_logprobs:
                prompt = [TokenInfo(int(tokens[0]), None)] + [
                    TokenInfo(int(tokens[i + 1]), float(plp[j, i]),
                              list(zip(ptop[j, i].tolist(), ptop_lp[j, i].tolist())))
                    for i in range(len(tokens) - 1)]
            out.append(Prefix(length=len(tokens), first=first.token(j), prompt=prompt,
                              state=(caches[j], *rows_state[j]), settings=s))
        return out

    def _fit_cache(self, need: int, shrink: bool) -> None:
        """Resize the cache to the smallest window holding `need` entries, one window at a time (so
        only neighbouring sizes compile); without `shrink` it only grows."""
        from opt_serving.model import kv_cache
        target = next(w for w in self.windows if w >= need)
        at = self.windows.index(kv_cache.cache_max_len(self.cache))
        while self.windows[at] < target or (shrink and self.windows[at] > target):
            at += 1 if self.windows[at] < target else -1
            self.cache = self._resize(self.cache, self.windows[at])

    def insert(self, prefix: Prefix, slot: int) -> None:
        pcache, row_state, row_settings = prefix.state
        from opt_serving.model.kv_cache import cache_max_len
        self._fit_cache(cache_max_len(pcache), shrink=False)
        self.cache = self._insert_cache(self.cache, pcache, np.int32(slot))
        self.state, self.settings, self.active = self._insert(
            self.state, self.settings, self.active, row_state, row_settings, np.int32(slot))
        self._lengths[slot] = prefix.length + 1  # the prompt and the first token
        self._want_top[slot] = prefix.settings.top_logprobs
        self._want_lp[slot] = prefix.settings.logprob

    def window_needed(self) -> int:
        """The cache window the next step needs: the bucket holding every active slot's tokens."""
        from opt_serving.model.kv_cache import bucket_length
        return bucket_length(min(max(int(self._lengths.max()), 1), self.max_seq_len), self.max_seq_len)

    def step(self) -> StepResult:
        # two dispatches, one host sync (np.asarray below). Reading only the written entries, a step
        # costs the same in any window, and a shrink copies the whole cache: the cache only grows then
        # (to at most what a full load needs anyway)
        self._fit_cache(self.window_needed(), shrink=not self.read_written)
        h, self.cache = self._step(self.params, self.cache, self.state, self.active,
                                   np.int32(self._lengths.max()))
        busy = self._lengths > 0
        want_top = np.bool_(self._want_top[busy].any())
        want_scores = np.bool_(want_top or self._want_lp[busy].any())
        self.state, out = self._choose(self.params, h, self.state, self.settings, self.active, want_scores, want_top)
        self._lengths[self._lengths > 0] += 1
        tok, lp, top_ids, top_lp = (np.asarray(a) for a in out)
        # the top-k ran for every row if one wanted it: the others get none
        return StepResult(tok, lp, np.where(self._want_top[:, None], top_ids, -1), top_lp)

    def free(self, slot: int) -> None:
        self.cache, self.active = self._free(self.cache, self.active, np.int32(slot))
        self._lengths[slot] = 0

    def warmup(self) -> None:
        """Compile every prefill bucket, its insert into every cache window that holds it, the decode
        step and free at every window, and the resizes between neighbouring windows (growing only, where
        steps never shrink the cache)."""
        # b - 1 prompt tokens fill prefill bucket b
        prefixes = [self.prefill([self.cfg.bos_token_id] * (b - 1), SlotSettings()) for b in self.buckets]
        for w in self.windows:  # growing: each window's inserts, then its step (length w -> window w)
            self._fit_cache(w, shrink=False)
            for b, prefix in zip(self.buckets, prefixes):
                if b <= w:
                    self.insert(prefix, 0)
            self.step()
            self.free(0)
        if self.read_written:  # no slot is in use: start again from an empty smallest window
            self.cache = self._empty_cache()
        else:
            for w in reversed(self.windows[:-1]):  # shrinking, as steps will
                self._fit_cache(w, shrink=True)


def load_engine(model_name: str, path=None, dtype: str = "float32", num_slots: int = 16,
                max_seq_len: Optional[int] = None, max_queue: int = 256, warmup: bool = True,
                dummy: bool = False, tensor_parallel: Optional[int] = None,
                pipeline_parallel: Optional[int] = None, seed: int = 0) -> Engine:
    """An engine serving weights from a numpy folder (or its parent holding `<size>-np/`), or random
    weights of the named size (`dummy`, drawn from `seed`; no files).

    `jax/` and `facebook/` names run on one device. `alpa/` names take the planner's tensor-parallel
    plan: the jitted steps accept the sharded params as they are (GSPMD shards the KV cache by heads),
    so the slots need nothing special. Pipeline stages (pp > 1) are Ray actors that this engine's
    single jitted step cannot drive yet, so the plan is asked for pp = 1."""
    from opt_serving.model.wrapper import get_model
    kwargs = {}
    if model_name.startswith("alpa/"):
        if pipeline_parallel not in (None, 1):
            raise NotImplementedError(
                f"{model_name}: the continuous-batching engine runs tensor-parallel plans only; "
                f"pipeline_parallel={pipeline_parallel} needs the pipeline stages, which it does not "
                "drive yet (use get_model(...).generate() for pipelined models)")
        kwargs = dict(tensor_parallel=tensor_parallel, pipeline_parallel=1,
                      batch_size=num_slots, max_seq_len=max_seq_len)
    elif model_name.startswith("facebook/"):
        model_name = "jax/" + model_name[len("facebook/"):]
    m = get_model(model_name, path, dtype=dtype, dummy=dummy, seed=seed, **kwargs)
    params = m.fused_params if hasattr(m, "fused_params") else m.params  # no unfused copy
    slots = OPTSlots(m.config, params, num_slots=num_slots, max_seq_len=max_seq_len)
    if warmup:
        slots.warmup()
    return Engine(slots, max_queue=max_queue)

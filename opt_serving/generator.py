"""Text in, completions out: the backend the HTTP service and the batch runner call.

`Generator` tokenises prompts, turns `SamplingParams` into per-request engine settings, and turns the engine's
tokens back into text: incremental detokenisation (a multi-byte character split over tokens is held until it is
whole), stop strings (text is cut at the first one; a tail that could still become one is held back, so a stream
never leaks part of a stop string), echo of the prompt with its logprobs, OpenAI-style logprobs and offsets.

    gen = Generator(engine, tokenizer)
    async for delta in gen.stream("Hello", SamplingParams(max_tokens=8, stop=["\\n"])):   # in an event loop
        print(delta.text, end="")
    completion = await gen.complete("Hello", params)
    [[c0, c1]] = gen.complete_many(["Hello"], params, n=2, best_of=4)                    # blocking
    c = await gen.beam("Hello", params, num_beams=4)                # HF beam search, off the event loop

Conventions (OpenAI's legacy completions API):
  * `text_offset` counts characters into prompt text + completion text, also without echo.
  * `token_logprobs` are the model's log-softmax before temperature/penalties; `top_logprobs[i]` holds the
    `logprobs` most likely tokens plus the chosen one.
  * echo lists exactly the prompt the user sent: for a text prompt, the BOS the tokenizer adds (OPT's leading
    </s>) is not echoed, and the first echoed token has a real logprob (it is scored after that BOS); a prompt
    sent as token ids is echoed id for id, an explicit leading </s> included, and its first token has None.
    `prompt_tokens` (usage) counts what the model read, the added BOS included.
  * EOS is not part of `text`/`tokens`; tokens cut by a stop string are dropped, but `completion_tokens` (usage)
    counts every token the model generated, EOS and cut ones included; `cumulative_logprob` sums them all
    (best_of ranks by it).
  * `SamplingParams.score_tokens=False` leaves `token_logprobs` entries and `cumulative_logprob` None (unless
    `logprobs` or best_of > n needs them): an engine step where every request is plainly greedy and unscored
    may then skip the logits (the CPU's screened greedy head). The HTTP routes turn it off where their answer
    does not show the scores.
Beam search does not fit the engine's one-token-per-slot step: `beam()` runs the model's own jitted HF-style
`generate(num_beams=...)` on a single worker thread (one beam request at a time; the event loop stays free).
The engine's output callback runs on the engine thread; the per-request text state below runs there too, so a
stop string frees the slot before the next step, and finished deltas reach asyncio via call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import random
import threading
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from opt_serving.engine import (MAX_BAD_WORD_LEN, MAX_BAD_WORDS, MAX_TOP_LOGPROBS, Engine, EngineClosed, EngineOutput,
                                EngineRequest, QueueFull, SlotSettings, TokenInfo)
from opt_serving.packing import find_stop
from opt_serving.token_text import TokenTexts

Prompt = Union[str, Sequence[int]]
MAX_STOP_STRINGS = 4


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0              # 0 = off; vLLM's: tokens below min_p x the top probability are dropped
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None      # None: a fresh random seed per request
    stop: list[str] = dataclasses.field(default_factory=list)
    logprobs: Optional[int] = None  # 0-5 top alternatives per token; None = no top_logprobs
    # token_logprobs and cumulative_logprob (None when off, unless logprobs asks for them). Off, a step
    # where every request is plainly greedy can skip the logits (the CPU's screened greedy head)
    score_tokens: bool = True
    echo: bool = False
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)  # HF's bad_words_ids
    no_repeat_ngram_size: int = 0
    ignore_eos: bool = False
    # vLLM's extensions, with vLLM's meaning: more token ids that end the completion "stop" (as EOS does,
    # held back by min_tokens; EOS itself stays one unless ignore_eos); a stop string or stop token's text kept
    # at the end of the text; special tokens (</s>) written into the text instead of dropped
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_tokens must be an integer >= 0"),
            (self.max_tokens > 0 or self.echo, "max_tokens must be >= 1 (0 only with echo, to score a prompt)"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be between 0 and max_tokens"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p must be between 0 and 1"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be between -2 and 2"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be between -2 and 2"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"stop takes at most {MAX_STOP_STRINGS} strings"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (len(self.bad_words_ids) <= MAX_BAD_WORDS
             and all(0 < len(w) <= MAX_BAD_WORD_LEN for w in self.bad_words_ids),
             f"bad_words_ids takes at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_LEN} tokens"),
            (isinstance(self.no_repeat_ngram_size, int) and 0 <= self.no_repeat_ngram_size <= 8,
             "no_repeat_ngram_size must be between 0 and 8"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be token ids (integers >= 0)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class Delta:
    """A piece of one completion as it streams; the last one has finish_reason set.

    The lists run over the tokens whose text is in this delta (the echoed prompt's tokens in the first delta when
    echo is on). `prompt_tokens`, `completion_tokens` and `cumulative_logprob` are running totals."""
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    tokens: list[str] = dataclasses.field(default_factory=list)
    token_logprobs: list[Optional[float]] = dataclasses.field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = dataclasses.field(default_factory=list)  # None if not asked
    text_offset: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None     # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cumulative_logprob: Optional[float] = 0.0  # None when the tokens are not scored (score_tokens)


@dataclasses.dataclass
class Completion(Delta):
    """A whole completion: all deltas of one request joined (text includes the prompt when echo is on)."""

    @classmethod
    def join(cls, deltas: Sequence[Delta]) -> "Completion":
        c = cls()
        for d in deltas:
            c.text += d.text
            for f in ("token_ids", "tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(c, f).extend(getattr(d, f))
            c.finish_reason = d.finish_reason
            c.prompt_tokens, c.completion_tokens = d.prompt_tokens, d.completion_tokens
            c.cumulative_logprob = d.cumulative_logprob
        return c


class _Detokenizer:
    """Token ids -> text a few at a time, holding a multi-byte character until its last byte arrives."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] is decoded context, ids[read:] is pending

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        return self.flush() if final else self._advance(hold_partial=True)

    def flush(self) -> str:
        return self._advance(hold_partial=False)

    def _advance(self, hold_partial: bool) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or (hold_partial and after.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


class _RequestText:
    """One request's text state; `on_output` runs on the engine thread and returns True on a stop string."""

    def __init__(self, gen: "Generator", prompt_ids: list[int], prompt_text: str, params: SamplingParams,
                 settings: SlotSettings, sink: Callable[[Any], None], hidden: int = 0):
        self.gen, self.params, self.settings, self.sink = gen, params, settings, sink
        self.prompt_ids, self.base = prompt_ids, len(prompt_text)
        self.hidden = hidden  # leading prompt tokens the tokenizer added (BOS): read by the model, not echoed
        self.detok = _Detokenizer(gen.tokenizer, params.skip_special_tokens)
        self.text = ""       # completion text so far (cut at a stop string)
        self.safe = 0        # text[:safe] can no longer turn into a stop string
        self.sent = 0        # text[:sent] has been sent
        self.toks: list[tuple[TokenInfo, int, int]] = []  # kept tokens with their [start, end) in text
        self.n_sent = 0
        self.echo_pending = params.echo and not settings.prompt_logprobs  # echo without scores: no prompt output
        self.generated = 0
        self.cum_logprob = 0.0 if settings.logprob else None
        self.finished = False

    # ---- prompt echo ----
    def echo_delta(self, scores: Optional[list[TokenInfo]]) -> Delta:
        detok = _Detokenizer(self.gen.tokenizer, self.params.skip_special_tokens)
        d = Delta(prompt_tokens=len(self.prompt_ids))
        for i in range(self.hidden):  # context for the detokenizer, not echoed
            detok.add(self.prompt_ids[i])
        for i in range(self.hidden, len(self.prompt_ids)):
            tid = self.prompt_ids[i]
            d.text_offset.append(len(d.text))
            d.text += detok.add(tid, final=i == len(self.prompt_ids) - 1)
            info = scores[i] if scores is not None else TokenInfo(tid, None)
            self._append(d, info)
        return d

    def _append(self, d: Delta, tok: TokenInfo) -> None:
        d.token_ids.append(tok.id)
        d.tokens.append(self.gen.token_text(tok.id))
        d.token_logprobs.append(tok.logprob)
        n = self.params.logprobs
        if n is None or tok.logprob is None:
            d.top_logprobs.append(None)
        else:
            top = {self.gen.token_text(i): lp for i, lp in tok.top[:n]}
            top.setdefault(self.gen.token_text(tok.id), tok.logprob)
            d.top_logprobs.append(top)

    # ---- generated tokens (engine thread) ----
    def on_output(self, out: EngineOutput) -> bool:
        if self.finished:
            return True
        if out.error is not None:
            self.finished = True
            self.sink(out.error)
            return True
        if out.is_prompt:
            self.sink(self.echo_delta(out.tokens))
            return False
        if self.echo_pending:
            self.echo_pending = False
            self.sink(self.echo_delta(None))
        final = out.finish_reason is not None
        for tok in out.tokens:
            self.generated += 1
            if self.cum_logprob is not None:
                self.cum_logprob += tok.logprob or 0.0
            if (out.finish_reason == "stop" and tok.id in self.settings.stop_token_ids
                    and not self.params.include_stop_str_in_output):
                continue  # EOS (a stop token) ends the text, it is not part of it
            start = len(self.text)
            self.text += self.detok.add(tok.id)
            self.toks.append((tok, start, len(self.text)))
        if final:  # a character still incomplete at the end is emitted as it is
            tail = self.detok.flush()
            if tail and self.toks:
                tok, start, _ = self.toks[-1]
                self.text += tail
                self.toks[-1] = (tok, start, len(self.text))
        reason = out.finish_reason
        if self.params.stop:
            cut, self.safe = find_stop(self.text, self.params.stop, self.safe)
            if cut >= 0:
                reason = "stop"
                cut = self._stop_end(cut)
                self.text = self.text[:cut]
                self.toks = [t for t in self.toks if t[1] < cut]
        else:
            self.safe = len(self.text)
        if reason is not None:
            self.safe = len(self.text)
        self._send(reason)
        return reason is not None and not final

    def _stop_end(self, cut: int) -> int:
        """Where the text ends for a stop string found at `cut`: there, or after the stop string itself with
        include_stop_str_in_output (the first of `stop` that matches there, as vLLM checks them in order)."""
        if not self.params.include_stop_str_in_output:
            return cut
        return cut + next(len(s) for s in self.params.stop if self.text.startswith(s, cut))

    def _send(self, reason: Optional[str]) -> None:
        d = Delta(text=self.text[self.sent:self.safe], finish_reason=reason,
                  prompt_tokens=len(self.prompt_ids), completion_tokens=self.generated,
                  cumulative_logprob=self.cum_logprob)
        while self.n_sent < len(self.toks) and (reason is not None or self.toks[self.n_sent][2] <= self.safe):
            tok, start, _ = self.toks[self.n_sent]
            self._append(d, tok)
            d.text_offset.append(self.base + start)
            self.n_sent += 1
        self.sent = self.safe
        if reason is not None:
            self.finished = True
        if d.text or d.token_ids or reason is not None:
            self.sink(d)


class DeltaStream:
    """Async iterator over one request's deltas. `cancel()` (or `aclose()`) frees its engine slot."""

    def __init__(self, generator: "Generator"):
        self._gen = generator
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._req: Optional[EngineRequest] = None
        self._done = False

    def _sink(self, item) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> "DeltaStream":
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # the consumer was cancelled (client gone): free the slot
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            if self._req is not None:
                self._gen.engine.cancel(self._req)

    async def aclose(self) -> None:
        self.cancel()


class _Collector:
    """Blocking sink: joins one request's deltas and signals when it is done."""

    def __init__(self, on_done: Callable[[], None]):
        self.deltas: list[Delta] = []
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self._on_done = on_done

    def __call__(self, item) -> None:
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.deltas.append(item)
            if item.finish_reason is None:
                return
        self.done.set()
        self._on_done()

    def result(self) -> Completion:
        if self.error is not None:
            raise self.error
        return Completion.join(self.deltas)


class Generator:
    """Prompts -> completions over an engine (`engine.Engine` or the fake one)."""

    def __init__(self, engine: Engine, tokenizer, max_seq_len: Optional[int] = None,
                 model_name: str = "opt", model=None):
        """`model`: what `beam()` calls `generate(num_beams=...)` on; by default an `OPTModel` over the
        engine's own parameters (no second copy of the weights), when the engine's slot model has them."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_seq_len = min(max_seq_len or engine.max_seq_len, engine.max_seq_len)
        self.model_name = model_name
        self.eos_token_id = tokenizer.eos_token_id
        self._rng = random.Random()
        self._token_strs: dict[int, str] = {}
        self.token_text = TokenTexts(tokenizer)  # token id -> its own text, as logprobs show it
        self._model = model
        self._beam_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._beam_lock = threading.Lock()
        self._beam_pending = 0
        self._closed = False

    @classmethod
    def from_pretrained(cls, model_name: str, path=None, dtype: str = "float32", max_batch_size: Optional[int] = None,
                        max_seq_len: Optional[int] = None, max_queue: int = 256,
                        warmup: bool = True, dummy: bool = False, seed: int = 0,
                        tokenizer=None, **plan) -> "Generator":
        """Weights from a numpy folder (or its parent holding `<size>-np/`), the tokenizer from the same
        folder; `max_batch_size` decode slots (default 16). Compiles every shape before returning.
        `dummy`: random weights of the named size from `seed` instead (no `path`). `tokenizer`: a folder
        to take the tokenizer from instead (needed with `dummy` when the vocabulary is larger than the
        embedded model's). `plan`: an alpa/ model's tensor_parallel, pipeline_parallel, device_memory,
        micro_batches (engine.load_engine)."""
        from opt_serving.engine import load_engine
        from opt_serving.model.wrapper import resolve_numpy_folder
        from opt_serving.tokenizer import load_tokenizer, tokenizer_for_dummy
        if dummy:
            folder, tok = None, load_tokenizer(tokenizer_for_dummy(model_name, tokenizer))
        else:
            folder = resolve_numpy_folder(path, model_name)
            tok = load_tokenizer(folder if tokenizer is None else tokenizer)
        engine = load_engine(model_name, folder, dtype=dtype, num_slots=max_batch_size or 16,
                             max_seq_len=max_seq_len, max_queue=max_queue, warmup=warmup,
                             dummy=dummy, seed=seed, **plan)
        return cls(engine, tok, max_seq_len=max_seq_len, model_name=model_name)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_top_logprobs(self) -> int:
        return getattr(self.engine, "max_top_logprobs", MAX_TOP_LOGPROBS)

    @property
    def max_length(self) -> int:
        """Alias of max_seq_len: the most prompt + generated tokens of one request."""
        return self.max_seq_len

    # ---- tokens ----
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def encode(self, text: str) -> list[int]:
        """Text -> ids, with OPT's leading </s> (the tokenizer's add_bos_token)."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_str(self, token_id: int) -> str:
        """A token as the vocabulary spells it (byte-level BPE: "\\u0120north" for " north")."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.convert_ids_to_tokens(int(token_id))
        return s

    def prepare(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Check and tokenise a request (blocking; any thread, so a server can keep it off its event loop):
        the ids `stream(..., ids=)` takes. Raises ValueError like `stream()`."""
        params.validate()
        return self._prepare(prompt, params)

    # ---- streaming (call inside an event loop) ----
    def stream(self, prompt: Prompt, params: SamplingParams, ids: Optional[list[int]] = None) -> DeltaStream:
        """Start a request now and return its deltas. Raises at once: ValueError (bad params, empty prompt,
        prompt + max_tokens over max_seq_len, token id outside the vocabulary), engine.QueueFull.
        `ids`: the prompt as `prepare()` tokenised it (not done again)."""
        params.validate()
        ids = self._prepare(prompt, params) if ids is None else ids
        out = DeltaStream(self)
        out._req = self._start(prompt, params, out._sink, ids)
        return out

    async def complete(self, prompt: Prompt, params: SamplingParams) -> Completion:
        stream = self.stream(prompt, params)
        try:
            return Completion.join([d async for d in stream])
        finally:
            stream.cancel()

    async def complete_n(self, prompt: Prompt, params: SamplingParams, n: int = 1,
                         best_of: Optional[int] = None) -> list[Completion]:
        """`best_of` (default n) samples with distinct seeds, the n with the highest cumulative logprob."""
        best_of = _check_n(n, best_of)
        streams: list[DeltaStream] = []
        try:  # a later stream() that raises (QueueFull) must cancel the ones already queued
            for p in self.choice_params(params, best_of, n):
                streams.append(self.stream(prompt, p))
            done = await asyncio.gather(*(self._join(s) for s in streams))
        finally:
            for s in streams:
                s.cancel()
        return _best(done, n) if best_of > n else done

    @staticmethod
    async def _join(stream: DeltaStream) -> Completion:
        return Completion.join([d async for d in stream])

    # ---- beam search (the model's own generate(), one request at a time on a worker thread) ----
    def beam(self, prompt: Prompt, params: SamplingParams, num_beams: int,
             early_stopping: bool = False) -> "asyncio.Future[Completion]":
        """Start a beam search now (call inside an event loop); await the result. Uses max_tokens,
        min_tokens, repetition_penalty, no_repeat_ngram_size, bad_words_ids, stop and ignore_eos of `params`
        (sampling fields are ignored: beam search is deterministic). Raises at once like `stream()`:
        ValueError (bad params, prompt too long, no model to search with), QueueFull, EngineClosed.
        Cancelling the future drops a search that has not started (a running one finishes first)."""
        params.validate()
        if not (isinstance(num_beams, int) and num_beams >= 1):
            raise ValueError("num_beams must be an integer >= 1")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 for beam search")
        model = self.beam_model()
        ids = self._prepare(prompt, params)
        with self._beam_lock:
            if self._closed:
                raise EngineClosed("the generator is shut down")
            if self._beam_pending >= self.engine.max_queue:
                raise QueueFull(f"beam search queue is full ({self._beam_pending} waiting)")
            if self._beam_pool is None:
                # one worker: searches run one after another, each with the whole device
                self._beam_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="opt-beam")
            self._beam_pending += 1
            job = self._beam_pool.submit(self._run_beam, model, ids, params, num_beams, early_stopping)
        job.add_done_callback(self._beam_done)
        return asyncio.wrap_future(job)

    def _beam_done(self, _job) -> None:
        with self._beam_lock:
            self._beam_pending -= 1

    def beam_model(self):
        """The model beam search runs on; ValueError if this generator has none."""
        if self._model is None:
            make = getattr(self.engine.model, "generation_model", None)
            if make is None:
                raise ValueError(f"beam search (num_beams > 1) is not available for {self.model_name}: its "
                                 "engine has no model to run generate() on")
            self._model = make()
        return self._model

    def _run_beam(self, model, ids: list[int], params: SamplingParams, num_beams: int,
                  early_stopping: bool) -> Completion:
        eos = None if params.ignore_eos else self.eos_token_id
        out = model.generate(
            input_ids=np.asarray([ids], np.int32), do_sample=False, num_beams=num_beams,
            max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens or None,
            repetition_penalty=params.repetition_penalty, no_repeat_ngram_size=params.no_repeat_ngram_size,
            bad_words_ids=[list(w) for w in params.bad_words_ids] or None, early_stopping=early_stopping,
            eos_token_id=-1 if eos is None else eos)
        new = np.asarray(getattr(out, "sequences", out))[0, len(ids):].tolist()
        reason = "length"
        if eos is not None and eos in new:  # the best beam ended; generate() pads after its EOS
            new, reason = new[:new.index(eos)], "stop"
        c = Completion(text=self.decode(new), token_ids=new, tokens=[self.token_text(t) for t in new],
                       finish_reason=reason, prompt_tokens=len(ids),
                       completion_tokens=len(new) + (reason == "stop"))
        if params.stop:
            cut, _ = find_stop(c.text, params.stop)
            if cut >= 0:
                c.text, c.finish_reason = c.text[:cut], "stop"
        return c

    # ---- blocking (batch tool, notebooks; not on the event loop thread) ----
    def iter_complete(self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams]],
                      n: int = 1, best_of: Optional[int] = None) -> Iterator[tuple[int, list[Completion]]]:
        """Yield `(prompt_index, n completions)` as prompts finish (not in order). Everything is validated
        before anything runs; a full queue makes it wait rather than fail."""
        best_of = _check_n(n, best_of)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for p in plist:
            p.validate()
        prepared = [self._prepare(pr, p) for pr, p in zip(prompts, plist)]
        wake = threading.Condition()
        finished: list[int] = []
        collectors: dict[int, list[_Collector]] = {}

        def on_done(i: int) -> Callable[[], None]:
            def f() -> None:
                with wake:
                    if all(c.done.is_set() for c in collectors[i]):
                        finished.append(i)
                    wake.notify()
            return f

        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                # all of a prompt's collectors exist before any can finish
                collectors[i] = [_Collector(on_done(i)) for _ in range(best_of)]
                for cp, col in zip(self.choice_params(p, best_of, n), collectors[i]):
                    while True:
                        try:
                            self._start(prompt, cp, col, prepared[i])
                            break
                        except QueueFull:
                            with wake:
                                wake.wait(0.05)  # poll: the queue drains without telling us
                        yield from self._drain(finished, collectors, best_of, n)
                yield from self._drain(finished, collectors, best_of, n)
            while collectors:
                with wake:
                    if not finished:
                        wake.wait()
                yield from self._drain(finished, collectors, best_of, n)
        finally:  # the caller stopped early: stop what is still running
            for cols in collectors.values():
                for c in cols:
                    if getattr(c, "req", None) is not None and not c.done.is_set():
                        self.engine.cancel(c.req)

    @staticmethod
    def _drain(finished: list[int], collectors: dict[int, list[_Collector]], best_of: int, n: int):
        while finished:
            i = finished.pop(0)
            results = [c.result() for c in collectors.pop(i)]
            yield i, (_best(results, n) if best_of > n else results)

    def complete_many(self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams]],
                      n: int = 1, best_of: Optional[int] = None) -> list[list[Completion]]:
        """Blocking: n completions per prompt, in prompt order."""
        out: list[Optional[list[Completion]]] = [None] * len(prompts)
        for i, completions in self.iter_complete(prompts, params, n=n, best_of=best_of):
            out[i] = completions
        return out  # type: ignore[return-value]

    # ---- shared ----
    def choice_params(self, params: SamplingParams, count: int, n: Optional[int] = None) -> list[SamplingParams]:
        """`count` copies with distinct seeds: choice 0 keeps `seed`, the others derive from it. When the best
        `n` < count are kept, they are ranked by cumulative_logprob: the tokens are scored."""
        if n is not None and n < count:
            params = params.replace(score_tokens=True)
        if params.seed is None:
            return [params.replace(seed=self._rng.getrandbits(31)) for _ in range(count)]
        # OpenAI seeds are any int64; SeedSequence takes only non-negative entropy
        entropy = params.seed % 2 ** 64
        seeds = [params.seed] + [int(s) for s in np.random.SeedSequence(entropy).generate_state(count)[1:]
                                 & 0x7FFFFFFF]
        return [params.replace(seed=s) for s in seeds]

    def stats(self) -> dict:
        """Engine counters for metrics: queue_length, running, num_slots, steps, tokens_per_step, ..."""
        s = self.engine.stats()
        return {**dataclasses.asdict(s), "tokens_per_step": s.tokens_per_step}

    def check_health(self) -> None:
        """Raise RuntimeError saying why this generator cannot serve (closed; the engine's thread dead or
        stuck; the slot model's own check): what /health and Ray Serve's replica health check call."""
        if self._closed:
            raise RuntimeError("generator closed")
        self.engine.check_health()

    def close(self) -> None:
        with self._beam_lock:
            self._closed = True
            pool = self._beam_pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    @functools.cached_property
    def max_token_chars(self) -> Optional[int]:
        """The most characters one token can stand for (its bytes, in byte-level BPE); None if unknown."""
        texts, most = self.token_text, 1
        for i in range(len(self.tokenizer)):
            data = texts.token_bytes(i)
            if data is None and not texts.is_special(i):
                return None  # not byte-level: no bound known
            most = max(most, len(data) if data is not None else len(texts(i)))
        return most

    def _refuse_surely_too_long(self, prompt: str, params: SamplingParams) -> None:
        """A text that cannot fit whatever it tokenises to is refused before tokenising (which would cost
        seconds for megabytes): each token covers at most max_token_chars characters."""
        room = self.max_seq_len - params.max_tokens
        most = self.max_token_chars
        if most is not None and len(prompt) > most * room:
            raise ValueError(f"this model's maximum context length is {self.max_seq_len} tokens, but the prompt "
                             f"has {len(prompt)} characters, more than {room} tokens (with max_tokens "
                             f"{params.max_tokens}) can hold; it was not tokenised")

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        most = self.engine.max_top_logprobs
        if params.logprobs is not None and params.logprobs > most:
            raise ValueError(f"logprobs: at most {most} alternatives per token with this model, got {params.logprobs}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self._refuse_surely_too_long(prompt, params)
            ids = self.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("prompt is empty")
            bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.engine.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})")
        if params.min_tokens and len(self._stop_ids(params)) > 1:
            # the slot model holds back one stop token (sampling.held_back); another could not be kept out
            raise ValueError("stop_token_ids: with min_tokens, only one stop token is supported (EOS, or one "
                             "stop_token_ids entry with ignore_eos)")
        total = len(ids) + params.max_tokens
        if total > self.max_seq_len:
            raise ValueError(f"this model's maximum context length is {self.max_seq_len} tokens, but the prompt "
                             f"has {len(ids)} tokens and max_tokens is {params.max_tokens} ({total} in total)")
        return ids

    def _added_tokens(self, prompt: Prompt, ids: list[int]) -> int:
        """How many leading ids the tokenizer added to a text prompt (OPT's BOS); 0 for token-id prompts."""
        if not isinstance(prompt, str):
            return 0
        plain = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        k = len(ids) - len(plain)
        return k if k > 0 and ids[k:] == plain else 0

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The token ids that finish a request "stop": EOS (unless ignore_eos) first, since the slot model
        holds back stop_token_ids[0] until min_tokens, then stop_token_ids."""
        eos = () if params.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys([*eos, *params.stop_token_ids]))

    def _settings(self, params: SamplingParams) -> SlotSettings:
        stop_ids = self._stop_ids(params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        return SlotSettings(
            max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=float(params.temperature),
            top_k=params.top_k, top_p=float(params.top_p), min_p=float(params.min_p),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty), seed=seed, stop_token_ids=stop_ids,
            bad_words_ids=tuple(tuple(w) for w in params.bad_words_ids),
            no_repeat_ngram_size=params.no_repeat_ngram_size,
            prompt_logprobs=params.echo and params.logprobs is not None,
            logprob=params.score_tokens or params.logprobs is not None,
            top_logprobs=bool(params.logprobs))

    def _start(self, prompt: Prompt, params: SamplingParams, sink: Callable[[Any], None],
               ids: Optional[list[int]] = None) -> EngineRequest:
        params.validate()
        if ids is None:
            ids = self._prepare(prompt, params)
        settings = self._settings(params)
        hidden = self._added_tokens(prompt, ids) if params.echo else 0
        state = _RequestText(self, ids, self.decode(ids), params, settings, sink, hidden)
        req = self.engine.submit(ids, settings, state.on_output)
        if isinstance(sink, _Collector):
            sink.req = req  # type: ignore[attr-defined]
        return req


def _check_n(n: int, best_of: Optional[int]) -> int:
    best_of = n if best_of is None else best_of
    if n < 1:
        raise ValueError("n must be >= 1")
    if best_of < n:
        raise ValueError(f"best_of ({best_of}) must be >= n ({n})")
    return best_of


def _best(completions: list[Completion], n: int) -> list[Completion]:
    """The n with the highest cumulative logprob, best first (stable for ties)."""
    return sorted(completions, key=lambda c: -c.cumulative_logprob)[:n]

"""A completion's text as the engine's tokens arrive, and where its pieces go.

`RequestText` holds one request's text state on the engine thread: incremental detokenisation (a multi-byte
character split over tokens is held until it is whole), stop strings (text is cut at the first one; a tail
that could still become one is held back, so a stream never leaks part of a stop string), echo of the prompt
with its scores, OpenAI-style logprobs and offsets. It runs on the engine thread so a stop string frees the slot
before the next step; its deltas go to a sink: `DeltaStream` (asyncio, through its loop's `Mailbox`) or
`Collector` (blocking callers).
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

from opt_serving.engine.scheduler import EngineOutput, EngineRequest, SlotSettings, TokenInfo
from opt_serving.text.packing import find_stop
from opt_serving.text.request import SamplingParams
from opt_serving.text.tokenizer import text_decoder


@dataclasses.dataclass
class Delta:
    """A piece of one completion as it streams; the last one has finish_reason set.

    The lists run over the tokens whose text is in this delta (the echoed prompt's tokens in the first delta when
    echo is on). `prompt_tokens`, `completion_tokens` and `cumulative_logprob` are running totals;
    `cached_tokens` is how many prompt tokens the prefill reused from the prefix cache.
    `prompt_logprobs` (vLLM's, in the first delta when asked): per prompt token None for the first, then
    {token id: (logprob, rank, its text)} for the token itself and the top alternatives asked for.
    `prompt_token_ids` (in the first delta only): the prompt as the model read it (tokenised, truncated).
    `output_token_ids`: the tokens the model generated, in order, EOS or a stop token that ended the completion
    included, as are tokens a stop string cut from the text (vLLM's token_ids: what an RL trainer scores); the
    echoed prompt's are in `token_ids`, not here. A token's id may come in a later delta than its text."""
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
    prompt_logprobs: Optional[list[Optional[dict[int, tuple[float, int, str]]]]] = None
    cached_tokens: int = 0
    prompt_token_ids: Optional[list[int]] = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Completion(Delta):
    """A whole completion: all deltas of one request joined (text includes the prompt when echo is on)."""

    @classmethod
    def join(cls, deltas: Sequence[Delta]) -> "Completion":
        c = cls()
        for d in deltas:
            c.text += d.text
            for f in ("token_ids", "tokens", "token_logprobs", "top_logprobs", "text_offset", "output_token_ids"):
                getattr(c, f).extend(getattr(d, f))
            c.finish_reason = d.finish_reason
            c.prompt_tokens, c.completion_tokens = d.prompt_tokens, d.completion_tokens
            c.cached_tokens = d.cached_tokens
            c.cumulative_logprob = d.cumulative_logprob
            if d.prompt_logprobs is not None:
                c.prompt_logprobs = d.prompt_logprobs
            if d.prompt_token_ids is not None:
                c.prompt_token_ids = d.prompt_token_ids
        return c


class Detokenizer:
    """Token ids -> text a few at a time, holding a multi-byte character until its last byte arrives."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._decode = text_decoder(tokenizer, skip_special_tokens)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] is decoded context, ids[read:] is pending

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


class RequestText:
    """One request's text state; `on_output` runs on the engine thread and returns True on a stop string."""

    def __init__(self, tokenizer, token_text: Callable[[int], str], prompt_ids: list[int], prompt_text: str,
                 params: SamplingParams, settings: SlotSettings, sink: Callable[[Any], None], hidden: int = 0):
        """`token_text`: a token id's own text, as logprobs show it (token_text.TokenTexts)."""
        self.tokenizer, self.token_text = tokenizer, token_text
        self.params, self.settings, self.sink = params, settings, sink
        self.prompt_ids, self.base = prompt_ids, len(prompt_text)
        self.hidden = hidden  # leading prompt tokens the tokenizer added (BOS): echoed as tokens, not as text
        self.detok = Detokenizer(tokenizer, params.skip_special_tokens)
        self.text = ""       # completion text so far (cut at a stop string)
        self.safe = 0        # text[:safe] can no longer turn into a stop string
        self.sent = 0        # text[:sent] has been sent
        self.toks: list[tuple[TokenInfo, int, int]] = []  # kept tokens with their [start, end) in text
        self.n_sent = 0
        # echo without prompt scores: the engine sends no prompt output
        self.echo_pending = params.echo and not settings.prompt_logprobs
        self.generated = 0
        self.cached = 0      # prompt tokens the prefill reused (the engine's first output says)
        self.cum_logprob = 0.0 if settings.logprob else None
        self.finished = False
        self.started = False  # a delta has gone out (the first carries the prompt's ids)
        self.output_ids: list[int] = []  # generated ids not sent yet

    # ---- prompt echo ----
    def echo_delta(self, scores: Optional[list[TokenInfo]]) -> Delta:
        """The echoed prompt: every token the model read, its first (OPT's </s>) with no logprob as OpenAI and
        vLLM list it; the tokens the tokenizer added (`hidden`) are not part of the text."""
        detok = Detokenizer(self.tokenizer, self.params.skip_special_tokens)
        d = Delta(prompt_tokens=len(self.prompt_ids), cached_tokens=self.cached)
        for i, tid in enumerate(self.prompt_ids):
            d.text_offset.append(len(d.text))
            piece = detok.add(tid, final=i == len(self.prompt_ids) - 1)
            if i >= self.hidden:
                d.text += piece
            self._append(d, scores[i] if scores is not None else TokenInfo(tid, None))
        return d

    def prompt_scores(self, scores: list[TokenInfo]) -> list[Optional[dict[int, tuple[float, int, str]]]]:
        """vLLM's prompt_logprobs: None for the first token, then each token's (logprob, rank, text) and its
        `prompt_logprobs` best alternatives' (ranked in order)."""
        k, text = self.params.prompt_logprobs or 0, self.token_text
        out: list[Optional[dict[int, tuple[float, int, str]]]] = [None]
        for info in scores[1:]:
            entry = {info.id: (info.logprob, info.rank, text(info.id))}
            for rank, (tid, lp) in enumerate(info.top[:k], 1):
                entry.setdefault(tid, (lp, rank, text(tid)))
            out.append(entry)
        return out

    def _append(self, d: Delta, tok: TokenInfo) -> None:
        d.token_ids.append(tok.id)
        d.tokens.append(self.token_text(tok.id))
        d.token_logprobs.append(tok.logprob)
        n = self.params.logprobs
        if n is None or tok.logprob is None:
            d.top_logprobs.append(None)
        else:
            top = {self.token_text(i): lp for i, lp in tok.top[:n]}
            top.setdefault(self.token_text(tok.id), tok.logprob)
            d.top_logprobs.append(top)

    # ---- generated tokens (engine thread) ----
    def on_output(self, out: EngineOutput) -> bool:
        if self.finished:
            return True
        if out.error is not None:
            self.finished = True
            self.sink(out.error)
            return True
        if out.cached_tokens is not None:
            self.cached = out.cached_tokens
        if out.is_prompt:
            d = (self.echo_delta(out.tokens) if self.params.echo
                 else Delta(prompt_tokens=len(self.prompt_ids), cached_tokens=self.cached))
            if self.params.prompt_logprobs is not None:
                d.prompt_logprobs = self.prompt_scores(out.tokens)
            self._emit(d)
            return False
        if self.echo_pending:
            self.echo_pending = False
            self._emit(self.echo_delta(None))
        final = out.finish_reason is not None
        cut = -1
        for tok in out.tokens:  # (several when the engine takes several steps a call)
            self.generated += 1
            self.output_ids.append(tok.id)
            if self.cum_logprob is not None:
                self.cum_logprob += tok.logprob or 0.0
            if (out.finish_reason == "stop" and tok.id in self.settings.stop_token_ids
                    and not self.params.include_stop_str_in_output):
                continue  # EOS (a stop token) ends the text, it is not part of it
            start = len(self.text)
            self.text += self.detok.add(tok.id)
            self.toks.append((tok, start, len(self.text)))
            if self.params.stop:  # the tokens after the one completing a stop string are not generated
                cut, self.safe = find_stop(self.text, self.params.stop, self.safe)
                if cut >= 0:
                    break
        if final and cut < 0:  # a character still incomplete at the end is emitted as it is
            tail = self.detok.flush()
            if tail and self.toks:
                tok, start, _ = self.toks[-1]
                self.text += tail
                self.toks[-1] = (tok, start, len(self.text))
                if self.params.stop:  # (the text before it was checked token by token above)
                    cut, self.safe = find_stop(self.text, self.params.stop, self.safe)
        reason = out.finish_reason
        if self.params.stop:
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
                  cumulative_logprob=self.cum_logprob, cached_tokens=self.cached)
        while self.n_sent < len(self.toks) and (reason is not None or self.toks[self.n_sent][2] <= self.safe):
            tok, start, _ = self.toks[self.n_sent]
            self._append(d, tok)
            d.text_offset.append(self.base + start)
            self.n_sent += 1
        self.sent = self.safe
        if reason is not None:
            self.finished = True
        if d.text or d.token_ids or reason is not None:
            d.output_token_ids, self.output_ids = self.output_ids, []
            self._emit(d)

    def _emit(self, d: Delta) -> None:
        if not self.started:
            self.started = True
            d.prompt_token_ids = list(self.prompt_ids)
        self.sink(d)


class Mailbox:
    """What the engine thread hands one event loop's streams, delivered in one wake-up of the loop: a step's
    deltas for every stream on the loop cost one `call_soon_threadsafe` (one write to its self-pipe, one turn of
    the loop), where one each woke the loop up to once a stream, on the engine thread's path to its next step,
    with the loop's thread taking the interpreter lock between them. `for_loop` gives a loop's one mailbox."""
    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        # (weakly: the table's value must not keep its key, a finished loop, alive; a stream holds its loop)
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "Mailbox":
        with cls._made:
            box = cls._of_loop.get(loop)
            if box is None:
                box = cls._of_loop[loop] = cls(loop)
            return box

    def put(self, queue: asyncio.Queue, item) -> None:  # any thread
        with self._lock:
            wake = not self._items  # (a wake-up already on its way delivers this item too)
            self._items.append((queue, item))
        loop = self._loop()
        if wake and loop is not None:
            loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # the loop's thread; each queue's items stay in the order they were put
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


class DeltaStream:
    """Async iterator over one request's deltas. `cancel()` (or `aclose()`) frees its engine slot;
    `expire_at(when)` ends it with a TimeoutError at that time of its loop's clock."""

    def __init__(self, engine):
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._mailbox = Mailbox.for_loop(self._loop)
        self._req: Optional[EngineRequest] = None
        self._done = False
        self._expiry: Optional[asyncio.TimerHandle] = None

    def _sink(self, item) -> None:  # engine thread
        self._mailbox.put(self._queue, item)

    def expire_at(self, when: float) -> None:
        """A deadline as one timer (not a timeout around each wait): at `when` (loop.time()) the stream fails with
        TimeoutError, after the deltas that came before it; cancel() and the stream's end drop the timer."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:  # the loop's thread: the engine request stops, the reader gets the error next
        self._expiry = None
        if not self._done:
            if self._req is not None:
                self._engine.cancel(self._req)
            self._queue.put_nowait(TimeoutError("request timed out"))

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
            self._end()
            raise item
        if item.finish_reason is not None:
            self._end()
        return item

    def _end(self) -> None:
        self._done = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def cancel(self) -> None:
        if not self._done:
            self._end()
            if self._req is not None:
                self._engine.cancel(self._req)

    async def aclose(self) -> None:
        self.cancel()


class Collector:
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


def best(completions: list[Completion], n: int) -> list[Completion]:
    """The n with the highest cumulative logprob, best first (stable for ties)."""
    return sorted(completions, key=lambda c: -c.cumulative_logprob)[:n]

"""What every route does with the generator: sampling parameters -> engine requests, all started before the
answer begins (so a full queue or a too-long prompt is still a 4xx), joined or merged as they stream, and
cancelled when the client leaves or the request times out.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import Response

from opt_serving.errors import InvalidRequest, NotFound
from opt_serving.text.chat import ChatTemplate
from opt_serving.text.generator import Completion, SamplingParams
from opt_serving.service import protocol as P
from opt_serving.service.errors import ClientGone, as_http_errors
from opt_serving.service.metrics import ServiceMetrics

Job = tuple[Any, Any]  # (prompt, generator.SamplingParams)


class Service:
    """The generator plus what every route needs: sampling-parameter mapping, concurrency, metrics."""

    def __init__(self, generator, model_name: str | Sequence[str] | None = None, request_timeout: float = 600.0,
                 max_logprobs: int = P.MAX_LOGPROBS, chat_template: Optional[str] = None, lora_updates: bool = False):
        """`model_name`: the name (or names, vLLM's --served-model-name) requests may call the model by; the
        first is the one answers give when a request names none. Default: the generator's. `chat_template`: the
        Jinja template chat messages are rendered with (None: the tokenizer's own, if it has one). `lora_updates`:
        LoRA adapters may be loaded and unloaded while serving (routes_lora.py)."""
        self.g = generator
        self.SamplingParams = SamplingParams
        names = [model_name] if isinstance(model_name, str) else list(model_name or [])
        self.model_names = [n for n in names if n] or [getattr(generator, "model_name", None) or "opt"]
        self.model_name = self.model_names[0]
        self.max_seq_len = int(generator.max_seq_len)
        self.request_timeout = request_timeout
        # what the server answers for: its configured limit, within the alternatives the engine computes
        self.max_logprobs = min(max_logprobs, getattr(generator, "max_top_logprobs", max_logprobs))
        self.metrics = ServiceMetrics(generator.stats)
        self.chat = ChatTemplate(generator.tokenizer, chat_template)
        self.lora_updates = lora_updates

    def served_name(self, name: Optional[str]) -> str:
        """The name an answer gives for a request naming `name` (None: the first served name); NotFound (404)
        for a model not served here, as OpenAI and vLLM answer."""
        if name is None:
            return self.model_name
        if name not in self.model_names and name not in self.lora_names():
            raise NotFound(f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name

    def lora_names(self) -> list[str]:
        """The LoRA adapters served, each a model a request may name (vLLM's shape)."""
        names = getattr(self.g, "lora_names", None)
        return [] if names is None else names()

    def lora_of(self, name: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's `model` names (None: the base model, by one of its names or none)."""
        return None if name is None or name in self.model_names else name

    def check_logprobs(self, logprobs: Optional[int], param: str = "logprobs") -> Optional[int]:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise InvalidRequest(f"{param}: at most {self.max_logprobs} alternatives per token on this server, "
                                 f"got {logprobs}", param=param)
        return logprobs

    def jobs(self, prompts: list, count: int, n: Optional[int] = None, **params) -> list[Job]:
        """(prompt, params) per prompt and sample; samples of one prompt get distinct seeds the way the
        generator's offline `complete_n` derives them, so HTTP and offline results agree (the best `n` of
        `count` are ranked by their scores). Which tokens are scored is the generator's decision: in all three
        APIs the answer shows scores exactly when the request sets `logprobs` (metaseq's always does)."""
        base = self.SamplingParams(**params)
        with as_http_errors():
            base.validate()  # before anything is queued
        return [(p, cp) for p in prompts for cp in self.g.choice_params(base, count, n)]

    async def start(self, jobs: list[Job]) -> list:
        """Start every job now (so a full queue or a too-long prompt is an HTTP error, not a broken stream);
        if one cannot start, the ones already started are cancelled. The prompts are checked and tokenised
        on a worker thread: a long one would otherwise hold up every other request on this event loop."""
        with as_http_errors():
            prepared = await asyncio.to_thread(lambda: [self.g.prepare(p, params) for p, params in jobs])
            streams = []
            try:
                for (prompt, params), ids in zip(jobs, prepared):
                    streams.append(self.g.stream(prompt, params, ids=ids))
            except BaseException:
                for st in streams:
                    st.cancel()
                raise
        return streams

    async def complete_all(self, streams: list, endpoint: str, per_prompt: int = 1) -> list:
        """Join every stream into a Completion, timed for the metrics as `endpoint`; a failure or a timeout
        cancels them all. `per_prompt`: consecutive streams sharing one prompt (counted once)."""
        timer = self.metrics.timer(endpoint)

        async def join(i: int, st):
            deltas = []
            async for d in st:
                timer.tokens(d.completion_tokens - (deltas[-1].completion_tokens if deltas else 0), i)
                deltas.append(d)
            return Completion.join(deltas)
        try:
            async with asyncio.timeout(self.request_timeout):
                outs = await asyncio.gather(*(join(i, st) for i, st in enumerate(streams)))
            timer.finish(prompt_tokens(outs, per_prompt))
            return outs
        finally:
            for st in streams:
                st.cancel()

    async def merged(self, streams: list) -> AsyncIterator[tuple[int, Any]]:
        """Yield (stream index, delta) as deltas of any stream arrive; at the request's deadline the streams end
        with a TimeoutError. Closing this iterator (client gone) cancels every stream, which frees their engine
        slots."""
        # the deadline is one timer a stream (DeltaStream.expire_at): a timeout around each wait cost a task and
        # a timer a token; asyncio.timeout() would fire in whatever the consumer is awaiting between our yields
        # (sending to the client) and surface as a bare cancellation
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        for st in streams:
            st.expire_at(deadline)
        if len(streams) == 1:  # (the usual request: its deltas as they arrive, no task and queue between)
            try:
                async for delta in streams[0]:
                    yield 0, delta
            finally:
                streams[0].cancel()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, st) -> None:
            try:
                async for delta in st:
                    queue.put_nowait((i, delta, None))
                queue.put_nowait((i, None, None))
            except Exception as e:
                queue.put_nowait((i, None, e))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, delta, err = await queue.get()
                if err is not None:
                    raise err
                if delta is None:
                    remaining -= 1
                else:
                    yield i, delta
        finally:
            for st in streams:
                st.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def answer(self, request: Request, jobs: list[Job], work: Callable[[list], Awaitable[Any]]):
        """Start the jobs and answer with `await work(streams)`, engine errors mapped to HTTP ones; a client
        that disconnects first cancels the work (and with it the engine requests)."""
        streams = await self.start(jobs)
        return await until_done_or_gone(request, work(streams), streams)


def greedy_if_no_top_p(temperature: float, top_p: float) -> tuple[float, float]:
    """(temperature, top_p) to sample with: top_p 0 leaves nothing but the most likely token."""
    return (0.0, 1.0) if top_p == 0.0 else (temperature, top_p)


def prompt_tokens(outs: list, per_prompt: int = 1) -> int:
    """Usage's prompt tokens: the `per_prompt` candidates of one prompt share it."""
    return sum(c.prompt_tokens for c in outs[::per_prompt])


def cached_tokens(outs: list, per_prompt: int = 1) -> int:
    """Usage's cached prompt tokens, counted as its prompt tokens are: each prompt's first candidate's."""
    return sum(c.cached_tokens for c in outs[::per_prompt])


def ranked(outs: list, best_of: int, n: int) -> Iterator[tuple[int, Any]]:
    """(choice index, completion): of each prompt's `best_of` candidates (consecutive in `outs`), the `n`
    with the highest total logprob (OpenAI's ranking), in order."""
    for i in range(0, len(outs), best_of):
        cands = outs[i:i + best_of]
        if len(cands) > n:
            cands = sorted(cands, key=lambda c: -float(c.cumulative_logprob))[:n]
        for j, c in enumerate(cands):
            yield i // best_of * n + j, c


async def until_done_or_gone(request: Request, coro: Awaitable, handles: list):
    """Await `coro` as the response, engine errors mapped; a client that disconnects first cancels it.
    The handles (engine streams, beam futures) are cancelled however it ends."""
    try:
        with as_http_errors():
            return await _cancel_on_disconnect(request, coro)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; recorded in the metrics
    finally:
        for h in handles:
            h.cancel()


async def _cancel_on_disconnect(request: Request, coro: Awaitable):
    """Await `coro`, cancelling it if the client disconnects first (Starlette does not do this for
    non-streaming routes; under Ray Serve the replica also cancels on disconnect)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server that cannot tell us: just wait for the answer
            await asyncio.Event().wait()

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves (e.g. by Ray Serve): so is the work
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone()

"""The HTTP service: FastAPI routes over a `Generator`, and the Ray Serve deployment that hosts them.

`create_app(generator)` is plain FastAPI (tests run it in-process against the fake engine);
`build_app(args)` is the Ray Serve application builder behind `serve run opt_serving.service:app model=... path=...`
and `opt-serving serve`. Request flow: pydantic validation (protocol.py) -> one generator stream per
(prompt, sample), all started before answering (so a full queue or a too-long prompt is still a 4xx) -> a JSON
body, or server-sent events ending `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from opt_serving.engine import EngineClosed, QueueFull
from opt_serving.runner.types import StageDied
from opt_serving.service import protocol as P
from opt_serving.service.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from opt_serving.service.metrics import ServiceMetrics

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered in OpenAI's shape with a given status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def json(self) -> dict:
        return P.error_json(self.message, self.type, self.param, self.code)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _engine_error(e: BaseException) -> ApiError | None:
    """Generator/engine exceptions -> HTTP errors; None for anything else (a bug: 500)."""
    if isinstance(e, QueueFull):
        return ApiError(429, f"server busy: {e}; retry later", "rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineClosed):
        return ApiError(503, f"server shutting down: {e}", "server_error", code="shutting_down")
    if isinstance(e, StageDied):  # the replica's health check fails too: Serve rebuilds it with its stages
        return ApiError(503, f"model unavailable: {e}", "server_error", code="stage_died",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return ApiError(504, "request timed out", "timeout_error", code="timeout")
    if isinstance(e, ValueError):  # bad prompt for this model: too long, token id outside the vocabulary, ...
        msg = str(e)
        code = "context_length_exceeded" if "context length" in msg else None
        return ApiError(400, msg, param="prompt" if "prompt" in msg else leading_field(msg), code=code)
    return None


def leading_field(message: str) -> str | None:
    """The request field an error message starts with ("min_tokens must be ...", "stop: ..."), if any."""
    word = message.split(" ", 1)[0].rstrip(":")
    known = set(P.CompletionRequest.model_fields) | set(P.MetaseqRequest.model_fields) | set(
        P.GenerateRequest.model_fields)
    return word if word in known else None


def _unwrap(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


@contextlib.contextmanager
def _as_http_errors():
    """Engine refusals raised inside (queue full, too long, closing, timeout) leave as their HTTP errors."""
    try:
        yield
    except Exception as e:
        mapped = _engine_error(_unwrap(e))
        if mapped is None:
            raise
        raise mapped from e


async def _until_done_or_gone(request, coro, handles):
    """Await `coro` as the response, engine errors mapped; a client that disconnects first cancels it.
    The handles (engine streams, beam futures) are cancelled however it ends."""
    try:
        with _as_http_errors():
            return await _cancel_on_disconnect(request, coro)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; recorded in the metrics
    finally:
        for h in handles:
            h.cancel()


# ---------------------------------------------------------------------------------------------------------
# Talking to the generator
# ---------------------------------------------------------------------------------------------------------

class Service:
    """The generator plus what every route needs: sampling-parameter mapping, concurrency, metrics."""

    def __init__(self, generator, model_name: str | None = None, request_timeout: float = 600.0,
                 max_logprobs: int = P.MAX_LOGPROBS):
        from opt_serving.generator import SamplingParams
        self.g = generator
        self.SamplingParams = SamplingParams
        self.model_name = model_name or getattr(generator, "model_name", None) or "opt"
        self.max_seq_len = int(generator.max_seq_len)
        self.request_timeout = request_timeout
        # what the server answers for: its configured limit, within the alternatives the engine computes
        self.max_logprobs = min(max_logprobs, getattr(generator, "max_top_logprobs", max_logprobs))
        self.metrics = ServiceMetrics(generator.stats)

    def check_logprobs(self, logprobs: Optional[int]) -> Optional[int]:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise ApiError(400, f"logprobs: at most {self.max_logprobs} alternatives per token on this server, "
                                f"got {logprobs}", param="logprobs")
        return logprobs

    def jobs(self, prompts: list, count: int, n: Optional[int] = None, **params) -> list[tuple[Any, Any]]:
        """(prompt, params) per prompt and sample; samples of one prompt get distinct seeds the way the
        generator's offline `complete_n` derives them, so HTTP and offline results agree (the best `n` of
        `count` are ranked by their scores)."""
        base = self.SamplingParams(**params)
        try:
            base.validate()  # before anything is queued
        except ValueError as e:
            raise ApiError(400, str(e), param=leading_field(str(e))) from None
        return [(p, cp) for p in prompts for cp in self.g.choice_params(base, count, n)]

    async def start(self, jobs: list[tuple[Any, Any]]) -> list:
        """Start every job now (so a full queue or a too-long prompt is an HTTP error, not a broken stream);
        if one cannot start, the ones already started are cancelled. The prompts are checked and tokenised
        on a worker thread: a long one would otherwise hold up every other request on this event loop."""
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

    async def complete_all(self, streams: list, timer) -> list:
        """Join every stream into a Completion; a failure or a timeout cancels them all."""
        from opt_serving.generator import Completion

        async def join(i: int, st):
            deltas = []
            async for d in st:
                timer.tokens(d.completion_tokens - (deltas[-1].completion_tokens if deltas else 0), i)
                deltas.append(d)
            return Completion.join(deltas)
        try:
            async with asyncio.timeout(self.request_timeout):
                return await asyncio.gather(*(join(i, st) for i, st in enumerate(streams)))
        finally:
            for st in streams:
                st.cancel()

    async def merged(self, streams: list) -> AsyncIterator[tuple[int, Any]]:
        """Yield (stream index, delta) as deltas of any stream arrive. Closing this iterator (client gone)
        cancels every stream, which frees their engine slots."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, st) -> None:
            try:
                async for delta in st:
                    queue.put_nowait((i, delta, None))
                queue.put_nowait((i, None, None))
            except Exception as e:
                queue.put_nowait((i, None, e))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
        # a deadline checked at each wait, not asyncio.timeout(): that would fire in whatever the consumer
        # is awaiting between our yields (sending to the client) and surface as a bare cancellation
        deadline = time.monotonic() + self.request_timeout
        try:
            remaining = len(tasks)
            while remaining:
                i, delta, err = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0))
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


def _rank(cands: list, n: int) -> list:
    """best_of: keep the n candidates with the highest total logprob (OpenAI's ranking)."""
    if len(cands) <= n:
        return cands
    return sorted(cands, key=lambda c: -float(c.cumulative_logprob))[:n]


def _logprobs(c, want: bool) -> Optional[P.Logprobs]:
    if not want:
        return None
    return P.Logprobs(tokens=list(c.tokens), token_logprobs=list(c.token_logprobs),
                      top_logprobs=list(c.top_logprobs) if c.top_logprobs is not None else [],
                      text_offset=list(c.text_offset))


async def _cancel_on_disconnect(request: Request, coro):
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


class _CountRequests:
    """ASGI middleware counting answers per API and status (a pure ASGI wrapper: Starlette's
    BaseHTTPMiddleware would get between a streaming response and the client's disconnect)."""
    ENDPOINTS = {"/v1/completions": "completions", "/completions": "metaseq", "/generate": "generate"}

    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        endpoint = self.ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        status = 499  # nothing was sent: the client went away first

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()


# ---------------------------------------------------------------------------------------------------------
# The FastAPI app
# ---------------------------------------------------------------------------------------------------------

def create_app(generator, *, model_name: str | None = None, api_keys: Sequence[str] = (),
               request_timeout: float = 600.0, close_generator: bool = False,
               max_logprobs: int = P.MAX_LOGPROBS, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """FastAPI app serving `generator`. `api_keys`: if given, POST routes and /v1/models need
    `Authorization: Bearer <one of them>`. `close_generator`: close it when the app shuts down.
    `max_logprobs`: the most top alternatives per token a request may ask for (vLLM's --max-logprobs; the
    engine's model gives at most generator.max_top_logprobs). `max_body_bytes`: larger request bodies are a 413,
    refused before they are read."""
    svc = Service(generator, model_name, request_timeout, max_logprobs)
    keys = [k for k in api_keys if k]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if close_generator:
            generator.close()

    app = FastAPI(title="opt_serving", version="0.1.0", lifespan=lifespan,
                  description="OPT language models: OpenAI-, metaseq- and GPT-J-API-compatible completions.",
                  responses={400: {"model": P.ErrorResponse}, 401: {"model": P.ErrorResponse},
                             429: {"model": P.ErrorResponse}})
    app.state.service = svc
    # before anything reads the body; inside the counting, so refusals show in the metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(_CountRequests, metrics=svc.metrics)
    page = (STATIC / "index.html").read_text()

    # ---- errors: always OpenAI's JSON shape ----
    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return JSONResponse(e.json(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        elif not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            msg = "request body must be a JSON object (send Content-Type: application/json)"
        else:
            msg = first["msg"].removeprefix("Value error, ")
            if loc:
                msg = f"{'.'.join(loc)}: {msg}"
        return JSONResponse(P.error_json(msg, param=loc[0] if loc else leading_field(msg)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        return JSONResponse(P.error_json(str(e.detail), type="invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_req, e: Exception):
        log.exception("internal error")
        return JSONResponse(P.error_json(f"internal error: {type(e).__name__}", type="server_error"),
                            status_code=500)

    async def check_key(request: Request) -> None:
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
            raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                           "authentication_error", code="invalid_api_key")

    auth = [Depends(check_key)]

    async def start(jobs) -> list:
        """Start the jobs' engine requests, mapping refusals (queue full, too long) to HTTP errors."""
        with _as_http_errors():
            return await svc.start(jobs)

    async def run(request: Request, work, jobs):
        """Start the jobs and await `work(streams)`, mapping engine errors to HTTP ones; a client that
        disconnects first cancels the work (and with it the engine requests)."""
        streams = await start(jobs)
        return await _until_done_or_gone(request, work(streams), streams)

    # ---- pages and probes ----
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    @app.get("/health", responses={503: {"description": "the engine is dead or stuck; the reason is given"}})
    async def health():
        check = getattr(generator, "check_health", None)
        if check is not None:
            try:  # off the event loop: a slot model's own check may ask remote stages
                await asyncio.to_thread(check)
            except RuntimeError as e:
                return JSONResponse({"status": "unhealthy", "model": svc.model_name, "reason": str(e)},
                                    status_code=503)
        return {"status": "ok", "model": svc.model_name}

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        body, ctype = svc.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models", response_model=P.ModelList, dependencies=auth)
    async def models():
        return P.ModelList(data=[P.ModelCard(id=svc.model_name, max_model_len=svc.max_seq_len)])

    # ---- OpenAI ----
    @app.post("/v1/completions", response_model=P.CompletionResponse, dependencies=auth,
              responses={200: {"content": {"text/event-stream": {}}}})
    async def completions(req: P.CompletionRequest, request: Request):
        n = req.n or 1
        best_of = req.best_of or n
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if top_p == 0.0:  # nothing left to sample from but the most likely token
            temperature, top_p = 0.0, 1.0
        prompts = P.normalize_prompt(req.prompt)
        # the tokens' scores only where the answer shows them (logprobs) or best_of ranks by them
        jobs = svc.jobs(prompts, best_of, n, max_tokens=16 if req.max_tokens is None else req.max_tokens,
                        temperature=temperature, top_p=top_p, presence_penalty=req.presence_penalty or 0.0,
                        frequency_penalty=req.frequency_penalty or 0.0, seed=req.seed, stop=req.stops,
                        logprobs=svc.check_logprobs(req.logprobs), echo=bool(req.echo), score_tokens=False,
                        **req.extensions())
        if req.stream:
            return _stream_openai(svc, req, await start(jobs))

        async def work(streams):
            timer = svc.metrics.timer("completions")
            outs = await svc.complete_all(streams, timer)
            choices, completion_tokens, prompt_tokens = [], 0, 0
            for i in range(len(prompts)):
                cands = outs[i * best_of:(i + 1) * best_of]
                completion_tokens += sum(c.completion_tokens for c in cands)
                prompt_tokens += cands[0].prompt_tokens
                for j, c in enumerate(_rank(cands, n)):
                    choices.append(P.CompletionChoice(text=c.text, index=i * n + j, finish_reason=c.finish_reason,
                                                      logprobs=_logprobs(c, req.logprobs is not None)))
            timer.finish(prompt_tokens)
            return P.CompletionResponse(model=svc.model_name, choices=choices,
                                        usage=P.Usage(prompt_tokens=prompt_tokens,
                                                      completion_tokens=completion_tokens,
                                                      total_tokens=prompt_tokens + completion_tokens))

        return await run(request, work, jobs)

    # ---- metaseq / Alpa ----
    @app.post("/completions", response_model=P.MetaseqResponse, dependencies=auth)
    async def metaseq_completions(req: P.MetaseqRequest, request: Request):
        best_of = req.best_of or req.n
        temperature, top_p = req.temperature, req.top_p
        if top_p == 0.0:
            temperature, top_p = 0.0, 1.0
        prompts = P.normalize_prompt(req.prompt)
        jobs = svc.jobs(prompts, best_of, req.n, max_tokens=req.max_tokens, min_tokens=req.min_tokens,
                        temperature=temperature, top_p=top_p, seed=req.seed, stop=P._stop_list(req.stop),
                        logprobs=req.logprobs, echo=req.echo)

        async def work(streams):
            timer = svc.metrics.timer("metaseq")
            outs = await svc.complete_all(streams, timer)
            choices = []
            for i in range(len(prompts)):
                cands = outs[i * best_of:(i + 1) * best_of]
                for j, c in enumerate(_rank(cands, req.n)):
                    lp = _logprobs(c, True)
                    choices.append(P.MetaseqChoice(
                        text=c.text, index=i * req.n + j, finish_reason=c.finish_reason,
                        logprobs=P.MetaseqLogprobs(**lp.model_dump(), finish_reason=c.finish_reason)))
            timer.finish(sum(c.prompt_tokens for c in outs[::best_of]))
            return P.MetaseqResponse(model=svc.model_name, choices=choices)

        return await run(request, work, jobs)

    # ---- GPT-J REST API ----
    @app.post("/generate", response_model=P.GenerateResponse, dependencies=auth)
    async def gptj_generate(req: P.GenerateRequest, request: Request):
        sample = req.do_sample and req.temperature > 0
        jobs = svc.jobs(list(req.prompt), 1, max_tokens=req.max_length, min_tokens=req.min_length,
                        temperature=req.temperature if sample else 0.0, top_k=int(req.top_k) if sample else 0,
                        top_p=req.top_p if sample else 1.0, repetition_penalty=req.repetition_penalty,
                        seed=None if req.seed == -1 else req.seed,
                        stop=[req.end_sequence] if req.end_sequence else [],
                        bad_words_ids=_bad_words_ids(generator, req.bad_words), score_tokens=False)

        def answer(outs) -> P.GenerateResponse:
            texts = []
            for prompt, c in zip(req.prompt, outs):
                text = prompt + c.text  # like decoding Hugging Face's generate() output: prompt included
                if req.return_prompt:
                    at = text.find(req.return_prompt)
                    text = text[at:] if at >= 0 else text
                texts.append(text)
            return P.GenerateResponse(gen_text=texts)

        if req.num_beams > 1:  # do_sample=false: beam search, outside the decode slots
            return await beam_search(request, jobs, req.num_beams, req.early_stop, answer)

        async def work(streams):
            timer = svc.metrics.timer("generate")
            outs = await svc.complete_all(streams, timer)
            timer.finish(sum(c.prompt_tokens for c in outs))
            return answer(outs)

        return await run(request, work, jobs)

    async def beam_search(request: Request, jobs, num_beams: int, early_stopping: bool, answer):
        """Every prompt's beam search queued at once (a refusal is a 4xx and cancels the ones queued before
        it), then awaited; a client that leaves drops the searches not yet started."""
        futures = []
        try:
            with _as_http_errors():
                for prompt, params in jobs:
                    futures.append(generator.beam(prompt, params, num_beams, early_stopping=early_stopping))
        except Exception:
            for f in futures:
                f.cancel()
            raise

        async def work():
            timer = svc.metrics.timer("generate")
            outs = []
            async with asyncio.timeout(svc.request_timeout):
                for i, f in enumerate(futures):  # in order: they run one after another anyway
                    outs.append(await f)
                    timer.tokens(outs[-1].completion_tokens, i)
            timer.finish(sum(c.prompt_tokens for c in outs))
            return answer(outs)
        return await _until_done_or_gone(request, work(), futures)

    return app


def _bad_words_ids(generator, words: Sequence[str]) -> list[list[int]]:
    """GPT-J API's bad_words -> token id sequences, with and without a leading space (BPE spells them apart)."""
    out: list[list[int]] = []
    for w in words:
        for variant in (w, " " + w.lstrip()):
            ids = list(generator.tokenizer(variant, add_special_tokens=False)["input_ids"])
            if ids and ids not in out:
                out.append(ids)
    return out


def _stream_openai(svc: Service, req: P.CompletionRequest, streams: list) -> StreamingResponse:
    """Server-sent events: one chunk per delta of any choice, the usage chunk if asked, then [DONE].
    Streaming requires best_of == n, so stream i is choice i."""
    cid, created = P._completion_id(), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_logprobs = req.logprobs is not None

    def chunk(choices: list[P.CompletionChoice], usage: P.Usage | None = None) -> str:
        body = P.CompletionResponse(id=cid, created=created, model=svc.model_name, choices=choices, usage=usage)
        return f"data: {body.model_dump_json()}\n\n"

    async def events() -> AsyncIterator[str]:
        timer = svc.metrics.timer("completions")
        generated = [0] * len(streams)   # running completion_tokens per stream
        prompt_tokens = [0] * len(streams)
        merged = svc.merged(streams)
        try:
            async for i, d in merged:
                timer.tokens(d.completion_tokens - generated[i], i)
                generated[i], prompt_tokens[i] = d.completion_tokens, d.prompt_tokens
                lp = None
                if want_logprobs:
                    lp = P.Logprobs(tokens=list(d.tokens), token_logprobs=list(d.token_logprobs),
                                    top_logprobs=list(d.top_logprobs), text_offset=list(d.text_offset))
                yield chunk([P.CompletionChoice(text=d.text, index=i, logprobs=lp, finish_reason=d.finish_reason)])
            n = req.n or 1
            p_total = sum(prompt_tokens[::n])  # the n samples of a prompt share its prompt
            timer.finish(p_total)
            if include_usage:
                yield chunk([], P.Usage(prompt_tokens=p_total, completion_tokens=sum(generated),
                                        total_tokens=p_total + sum(generated)))
        except Exception as e:  # after the 200: report in the stream (client gone is a CancelledError instead)
            mapped = _engine_error(_unwrap(e)) or ApiError(500, f"internal error: {type(e).__name__}",
                                                           "server_error")
            if mapped.status == 500:
                log.exception("stream failed")
            yield f"data: {json.dumps(mapped.json())}\n\n"
        finally:
            await merged.aclose()
            for st in streams:
                st.cancel()
            timer.finish()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------------------------------
# Ray Serve
# ---------------------------------------------------------------------------------------------------------

class ServeArgs(BaseModel):
    """Arguments of the application builder (`serve run opt_serving.service:app model=... path=...`);
    strings from the command line are converted (lax mode). An argument not listed here is an error
    naming it (a misspelt `pipeline_paralel` never leaves a deployment silently unpipelined)."""
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None          # None: the embedded tiny model
    path: Optional[str] = None
    dummy: bool = False                  # random weights of the named size (no path)
    seed: int = 0                        # of the random weights
    tokenizer: Optional[str] = None      # tokenizer folder, instead of the weights folder's / the embedded one
    dtype: str = "auto"                  # float16 on GPUs, float32 on CPUs
    max_batch_size: int = 16
    max_seq_len: Optional[int] = None
    max_queue: int = 256
    request_timeout: float = 600.0
    api_keys: list[str] | str = []       # a list, or comma separated
    num_replicas: Optional[int] = None  # None: 1, or what serve_config.yaml's autoscaling_config decides
    num_cpus: float = 1.0                # per replica
    graceful_shutdown_timeout_s: float = 10.0
    # alpa/ models: the plan (left out: the planner's choice for the Ray cluster)
    tensor_parallel: Optional[int] = None
    pipeline_parallel: Optional[int] = None
    device_memory: Optional[str] = None  # what each device may hold ("16GB"): CPU nodes, GPUs Ray does not name
    micro_batches: Optional[int] = None  # decode slot groups of a pipelined plan (default pp)
    health_check_period_s: float = 5.0
    max_logprobs: int = P.MAX_LOGPROBS   # vLLM's --max-logprobs
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def key_list(self) -> list[str]:
        keys = self.api_keys.split(",") if isinstance(self.api_keys, str) else self.api_keys
        return [k.strip() for k in keys if k.strip()]

    def plan_args(self) -> dict:
        """What load_engine takes about the plan (alpa/ models only)."""
        if not (self.model or "").startswith("alpa/"):
            return {}
        return dict(tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel,
                    device_memory=self.device_memory, micro_batches=self.micro_batches)


def check_model_args(args: ServeArgs) -> None:
    """The model arguments' own errors (ValueError, naming the builder argument and the CLI flag), found
    before anything loads or Ray starts."""
    if args.model == "opt-fake":
        return
    if args.dummy:
        if args.model is None:
            raise ValueError("dummy (--dummy, random weights) needs a model name for the size (--model), "
                             "e.g. jax/opt-125m")
        if args.path is not None:
            raise ValueError("give either path (--path, a weights folder) or dummy (--dummy, random weights), "
                             "not both")
        from opt_serving.tokenizer import tokenizer_for_dummy
        tokenizer_for_dummy(args.model, args.tokenizer)  # a large vocabulary needs a tokenizer folder
    elif args.path is None:
        from opt_serving.tokenizer import EMBEDDED_NAMES
        if args.model is not None and args.model not in EMBEDDED_NAMES:
            raise ValueError(f"{args.model}: give path (--path, the numpy weights folder) or dummy (--dummy, "
                             "random weights)")
        if args.tokenizer is not None:
            raise ValueError("tokenizer (--tokenizer) goes with path or dummy; the embedded model has its own")
    elif args.model is None:
        raise ValueError("give model (--model NAME, e.g. facebook/opt-125m) together with path (--path)")


def build_generator(args: ServeArgs):
    """The generator a replica serves: the named model from `path` (or random weights of its size with
    `dummy`), or the embedded tiny one."""
    if args.model == "opt-fake":  # the hand-checkable fake engine (tests, demos of the HTTP side)
        from opt_serving.testing.fake_engine import fake_generator
        return fake_generator(num_slots=args.max_batch_size, max_seq_len=args.max_seq_len or 256,
                              max_queue=args.max_queue)
    from opt_serving.generator import Generator
    check_model_args(args)
    model, path = args.model, args.path
    if path is None and not args.dummy:
        from opt_serving.embedded import ensure_embedded_model
        path, model = str(ensure_embedded_model()), "jax/opt-tiny"
    return Generator.from_pretrained(model, path, dtype=args.dtype, max_batch_size=args.max_batch_size,
                                     max_seq_len=args.max_seq_len, max_queue=args.max_queue,
                                     dummy=args.dummy, seed=args.seed, tokenizer=args.tokenizer, **args.plan_args())


def _placement(args: ServeArgs) -> dict:
    """Deployment options. An `alpa/` model is planned here, for the Ray cluster this process joins
    (address="auto"; one is started when none runs, as `serve run` would), and the replica's placement
    group holds what the plan needs: its own bundle (with the plan's tp GPUs when pp = 1), or one bundle
    per pipeline stage with the replica in the first, so the stages belong to the replica and live and
    die with it. The plan's
    degrees go to the replica, which plans its layer split for the same cluster."""
    own = {"ray_actor_options": {"num_cpus": args.num_cpus}}
    if not (args.model or "").startswith("alpa/"):
        return own
    from opt_serving.parallel import backend
    from opt_serving.runner.load import resolve_dtype
    args.dtype = resolve_dtype(args.dtype, cluster=True)  # the cluster's GPUs decide "auto", not this process's
    # the plan needs only the config: the folder's, or the preset's when there is no folder (yet)
    plan, _, _ = backend.plan_model(args.model, args.path, args.dtype, dummy=args.dummy or args.path is None,
                                    tensor_parallel=args.tensor_parallel,
                                    pipeline_parallel=args.pipeline_parallel, device_memory=args.device_memory,
                                    batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    args.tensor_parallel, args.pipeline_parallel = plan.tp, plan.pp
    import ray
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    if plan.pp == 1:
        if not gpus:  # CPU: the replica's process makes its own tp host devices
            env = {"env_vars": {"XLA_FLAGS": f"--xla_force_host_platform_device_count={plan.tp}"}}
            return {"ray_actor_options": {"num_cpus": args.num_cpus, "runtime_env": env}} if plan.tp > 1 else own
        return {"ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": plan.tp},
                "placement_group_bundles": [{"CPU": args.num_cpus, "GPU": float(plan.tp)}],
                "placement_group_strategy": "STRICT_PACK"}
    # one bundle per stage, the replica in stage 0's (a bundle lies on one node, so a stage's tp devices
    # do too); CPU nodes are the planner's devices: one stage a node where there are enough of them
    from opt_serving.parallel.pipeline import stage_bundles
    bundles, strategy = stage_bundles(plan, gpus, extra_cpus=args.num_cpus)
    return {"ray_actor_options": {"num_cpus": args.num_cpus},
            "placement_group_bundles": bundles, "placement_group_strategy": strategy}


class _ReuseAddrSockets:
    """The `socket` module, except that the sockets it makes have SO_REUSEADDR set (see below)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def socket(self, *args, **kwargs):
        sock = self._module.socket(*args, **kwargs)
        sock.setsockopt(self._module.SOL_SOCKET, self._module.SO_REUSEADDR, 1)
        return sock


def reuse_replica_port_after_crash() -> bool:
    """Under direct ingress the replica binds its HTTP port itself (Ray Serve's
    `http_util.start_asgi_http_server`, the only socket that module makes), without SO_REUSEADDR. When a
    replica dies with connections open (SIGKILL, OOM), the kernel closes them and each lingers in TIME_WAIT
    on that port for 60 s; until then the replacement's bind fails (EADDRINUSE), Serve gives up on it and
    starts another, which loads the model again: the deployment served again only ~70 s after a kill
    instead of ~20 s (tiny model, 2-core CPU). SO_REUSEADDR, which uvicorn sets on its own sockets, lets the
    bind pass TIME_WAIT connections and still fails while another process listens on the port. Called in
    the replica's process, before Serve binds. Returns False where Serve's module is not there to adjust."""
    try:
        from ray.serve._private import http_util
    except ImportError:
        return False
    if not isinstance(http_util.socket, _ReuseAddrSockets):
        http_util.socket = _ReuseAddrSockets(http_util.socket)
    return True


def build_app(args: ServeArgs | dict | None = None):
    """Ray Serve application builder: `opt_serving.service:app`."""
    from ray import serve

    args = args if isinstance(args, ServeArgs) else ServeArgs(**(args or {}))

    @serve.ingress()
    class OPTServer:
        def __init__(self, serve_args: dict):
            reuse_replica_port_after_crash()  # before Serve binds the port, after this constructor
            self.args = ServeArgs(**serve_args)
            self.generator = build_generator(self.args)
            # what is loaded by now (the model, its compiled steps, Ray, FastAPI) lives as long as the replica:
            # frozen, a full collection no longer walks it while holding the GIL (one took 0.24 s of a 15 s
            # engine run, stalling the steps and every stream)
            gc.collect()
            gc.freeze()

        def __serve_build_asgi_app__(self):
            return create_app(self.generator, model_name=self.args.model, api_keys=self.args.key_list(),
                              request_timeout=self.args.request_timeout, close_generator=True,
                              max_logprobs=self.args.max_logprobs, max_body_bytes=self.args.max_body_bytes)

        def check_health(self):
            """Serve replaces the replica when this raises: a dead or stuck engine, a dead pipeline stage."""
            self.generator.check_health()

    replicas = {} if args.num_replicas is None else {"num_replicas": args.num_replicas}
    placement = _placement(args)  # plans alpa/ models, fixing their degrees in args
    deployment = serve.deployment(
        OPTServer, name="OPTServer", **replicas,
        # every waiting request must reach the engine's own bounded queue (which answers 429), not Serve's
        max_ongoing_requests=args.max_queue + args.max_batch_size,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        health_check_period_s=args.health_check_period_s, **placement)
    return deployment.bind(args.model_dump())

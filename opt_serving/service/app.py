"""The HTTP service: `create_app(generator)`, a plain FastAPI app (no Ray; tests run it in-process against the
fake engine). The Ray Serve deployment that hosts it is deployment.py.

Request flow: a broken read taken as a disconnect, draining an unread body after an early answer, body size
limit (limits.py) -> pydantic validation (protocol.py) -> the API's router
(routes_openai.py, routes_chat.py, routes_metaseq.py, routes_gptj.py) -> one generator stream per (prompt, sample), all
started before answering (serving.py) -> a JSON body, or server-sent events ending `data: [DONE]` (sse.py).
Errors, wherever raised, are answered in OpenAI's shape with the status errors.py gives their type.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from opt_serving.service import protocol as P
from opt_serving.service import routes_chat, routes_gptj, routes_lora, routes_metaseq, routes_openai, routes_probes
from opt_serving.service.errors import install_error_handlers
from opt_serving.service.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit, DisconnectOnReceiveFailure, DrainUnreadBody
from opt_serving.service.metrics import CountRequests
from opt_serving.service.serving import Service

STATIC = Path(__file__).parent / "static"


class _App(FastAPI):
    """FastAPI with limits.py's connection wrappers outside everything, Starlette's own 500 answer included
    (middleware added with add_middleware sits inside that one): every early answer on every route reaches the
    client (DrainUnreadBody), and a broken read is a disconnect, not a 500 (DisconnectOnReceiveFailure)."""

    def build_middleware_stack(self):
        return DisconnectOnReceiveFailure(DrainUnreadBody(super().build_middleware_stack()))


def create_app(generator, *, model_name: str | Sequence[str] | None = None, api_keys: Sequence[str] = (),
               request_timeout: float = 600.0, close_generator: bool = False,
               max_logprobs: int = P.MAX_LOGPROBS, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_template: str | None = None, lora_runtime_updates: bool = False) -> FastAPI:
    """FastAPI app serving `generator` under `model_name` (a name, or several as vLLM's --served-model-name: the
    first is the one answers give; default: the generator's). `api_keys`: if given, POST routes and /v1/models need
    `Authorization: Bearer <one of them>`. `close_generator`: close it when the app shuts down.
    `max_logprobs`: the most top alternatives per token a request may ask for (vLLM's --max-logprobs; the
    engine's model gives at most generator.max_top_logprobs). `max_body_bytes`: larger request bodies are a 413,
    refused before they are parsed (and then discarded, so every client reads the 413). `chat_template`: the
    Jinja template /v1/chat/completions renders messages with (text/chat.py; None: the tokenizer's own, and a
    tokenizer without one answers chat requests 400 naming --chat-template). `lora_runtime_updates`: LoRA
    adapters may be loaded and unloaded while serving (routes_lora.py, vLLM's runtime updating)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if close_generator:
            generator.close()

    app = _App(title="opt_serving", version="0.1.0", lifespan=lifespan,
                  description="OPT language models: OpenAI-, metaseq- and GPT-J-API-compatible completions.",
                  responses={400: {"model": P.ErrorResponse}, 401: {"model": P.ErrorResponse},
                             404: {"model": P.ErrorResponse}, 429: {"model": P.ErrorResponse}})
    app.state.service = svc = Service(generator, model_name, request_timeout, max_logprobs, chat_template,
                                      lora_runtime_updates)
    app.state.api_keys = [k for k in api_keys if k]
    # before anything reads the body; inside the counting, so refusals show in the metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(CountRequests, metrics=svc.metrics)
    install_error_handlers(app)

    page = (STATIC / "index.html").read_text()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    for router in (routes_probes.router, routes_openai.router, routes_chat.router, routes_lora.router,
                   routes_metaseq.router, routes_gptj.router):
        app.include_router(router)
    return app

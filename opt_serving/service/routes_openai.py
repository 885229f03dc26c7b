"""OpenAI's legacy completions API: `POST /v1/completions` (JSON, or server-sent events with `stream`) and
`GET /v1/models`, as the `openai` client calls them; and vLLM's `POST /tokenize` and `POST /detokenize` beside
them. A request naming a model this server does not serve (by none of its --served-model-name names, nor a LoRA
adapter's) is a 404; one naming a LoRA adapter runs with it (vLLM's way), and /v1/models lists each adapter with
its `parent`."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncGenerator

from fastapi import APIRouter, Depends, Request

from opt_serving.service import choices
from opt_serving.service import protocol as P
from opt_serving.service.deps import AUTH, service
from opt_serving.service.errors import as_http_errors
from opt_serving.service.serving import Service, cached_tokens, prompt_tokens, ranked, until_done_or_gone
from opt_serving.service.sse import sse_response

router = APIRouter(dependencies=AUTH)


@router.get("/v1/models", response_model=P.ModelList)
async def models(svc: Service = Depends(service)):
    cards = [P.ModelCard(id=name, root=name, max_model_len=svc.max_seq_len) for name in svc.model_names]
    cards += [P.ModelCard(id=name, root=svc.g.lora_path(name), parent=svc.model_name, max_model_len=svc.max_seq_len)
              for name in svc.lora_names()]
    return P.ModelList(data=cards)


@router.post("/v1/completions", response_model=P.CompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
async def completions(req: P.CompletionRequest, request: Request, svc: Service = Depends(service)):
    model = svc.served_name(req.model)
    n = req.n or 1
    best_of = req.best_of or n
    params = choices.sampling(svc, req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs,
                              echo=bool(req.echo))
    streams = await choices.start(svc, req, P.normalize_prompt(req.prompt), params, best_of)
    if req.stream:
        return sse_response(_chunks(svc, req, model, streams))

    async def work():
        outs = await svc.complete_all(streams, "completions", best_of)
        return P.CompletionResponse(model=model, choices=[_choice(req, k, c) for k, c in ranked(outs, best_of, n)],
                                    usage=P.usage(prompt_tokens(outs, best_of), sum(c.completion_tokens for c in outs),
                                                  cached_tokens(outs, best_of)))

    return await until_done_or_gone(request, work(), streams)


def _choice(req: P.CompletionRequest, index: int, d, prompt_logprobs: bool = True) -> P.CompletionChoice:
    """A completion (or, streaming, a delta) as choice `index`."""
    return P.CompletionChoice(text=d.text, index=index, finish_reason=d.finish_reason,
                              logprobs=P.Logprobs.of(d) if req.logprobs is not None else None,
                              prompt_logprobs=P.prompt_logprobs_of(d.prompt_logprobs) if prompt_logprobs else None,
                              token_ids=choices.token_ids(req, d), prompt_token_ids=choices.prompt_token_ids(req, d))


async def _chunks(svc: Service, req: P.CompletionRequest, model: str,
                  streams: list) -> AsyncGenerator[P.CompletionResponse, None]:
    """One chunk per delta of any choice (with that choice's usage so far where stream_options asks for it on
    every chunk), then the usage chunk if asked. Streaming requires best_of == n, so stream i is choice i."""
    cid, created = P._completion_id(), int(time.time())
    final_usage, every_chunk = req.usage_options
    tally = choices.Tally(len(streams), req.n or 1)
    async for i, d in choices.streamed(svc, streams, "completions", tally):
        yield P.CompletionResponse(id=cid, created=created, model=model, choices=[_choice(req, i, d, False)],
                                   usage=tally.choice(i) if every_chunk else None)
    if final_usage:
        yield P.CompletionResponse(id=cid, created=created, model=model, choices=[], usage=tally.total())


@router.post("/tokenize", response_model=P.TokenizeResponse)
async def tokenize(req: P.TokenizeRequest, svc: Service = Depends(service)):
    """vLLM's: a text prompt -> its token ids (OPT's leading </s> included unless add_special_tokens is false)."""
    svc.served_name(req.model)
    with as_http_errors():  # off the event loop: a long text takes a while
        ids = await asyncio.to_thread(svc.g.tokenize, req.prompt, req.add_special_tokens)
    strs = [svc.g.token_text(i) for i in ids] if req.return_token_strs else None
    return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=svc.max_seq_len, token_strs=strs)


@router.post("/detokenize", response_model=P.DetokenizeResponse)
async def detokenize(req: P.DetokenizeRequest, svc: Service = Depends(service)):
    """vLLM's: token ids -> their text, special tokens written out (as vLLM decodes them)."""
    svc.served_name(req.model)
    with as_http_errors():
        return P.DetokenizeResponse(prompt=await asyncio.to_thread(svc.g.detokenize, req.tokens))

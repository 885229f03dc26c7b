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

from opt_serving.service import protocol as P
from opt_serving.service.deps import AUTH, service
from opt_serving.service.errors import as_http_errors
from opt_serving.service.serving import Service, cached_tokens, greedy_if_no_top_p, prompt_tokens, ranked
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
    jobs = svc.jobs(P.normalize_prompt(req.prompt), best_of, n, **_sampling(req, svc))
    if req.stream:
        return sse_response(_chunks(svc, req, model, await svc.start(jobs)))

    async def work(streams):
        outs = await svc.complete_all(streams, "completions", best_of)
        choices = [P.CompletionChoice(text=c.text, index=k, finish_reason=c.finish_reason,
                                      logprobs=P.Logprobs.of(c) if req.logprobs is not None else None,
                                      prompt_logprobs=P.prompt_logprobs_of(c.prompt_logprobs))
                   for k, c in ranked(outs, best_of, n)]
        return P.CompletionResponse(model=model, choices=choices,
                                    usage=_usage(prompt_tokens(outs, best_of),
                                                 sum(c.completion_tokens for c in outs), cached_tokens(outs, best_of)))

    return await svc.answer(request, jobs, work)


def _sampling(req: P.CompletionRequest, svc: Service) -> dict:
    """The request's generator SamplingParams fields (OpenAI's nulls meaning the defaults)."""
    temperature, top_p = greedy_if_no_top_p(1.0 if req.temperature is None else req.temperature,
                                            1.0 if req.top_p is None else req.top_p)
    svc.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    return dict(max_tokens=16 if req.max_tokens is None else req.max_tokens, temperature=temperature, top_p=top_p,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                seed=req.seed, stop=req.stops, logprobs=svc.check_logprobs(req.logprobs), echo=bool(req.echo),
                lora=svc.lora_of(req.model), **req.extensions())


def _usage(prompt: int, completion: int, cached: int) -> P.Usage:
    return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


async def _chunks(svc: Service, req: P.CompletionRequest, model: str,
                  streams: list) -> AsyncGenerator[P.CompletionResponse, None]:
    """One chunk per delta of any choice, then the usage chunk if asked. Streaming requires best_of == n,
    so stream i is choice i."""
    cid, created = P._completion_id(), int(time.time())

    def chunk(choices: list[P.CompletionChoice], usage: P.Usage | None = None) -> P.CompletionResponse:
        return P.CompletionResponse(id=cid, created=created, model=model, choices=choices, usage=usage)

    timer = svc.metrics.timer("completions")
    generated = [0] * len(streams)   # running completion_tokens per stream
    prompt, cached = [0] * len(streams), [0] * len(streams)
    merged = svc.merged(streams)
    try:
        async for i, d in merged:
            timer.tokens(d.completion_tokens - generated[i], i)
            generated[i], prompt[i], cached[i] = d.completion_tokens, d.prompt_tokens, d.cached_tokens
            lp = P.Logprobs.of(d) if req.logprobs is not None else None
            yield chunk([P.CompletionChoice(text=d.text, index=i, logprobs=lp, finish_reason=d.finish_reason)])
        p_total = sum(prompt[::req.n or 1])  # the n samples of a prompt share its prompt
        timer.finish(p_total)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(p_total, sum(generated), sum(cached[::req.n or 1])))
    finally:
        await merged.aclose()
        for st in streams:
            st.cancel()
        timer.finish()


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

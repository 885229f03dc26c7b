"""OpenAI's chat completions, `POST /v1/chat/completions` (JSON, or `chat.completion.chunk` server-sent events with
`stream`), as the `openai` client and vLLM answer it. The messages are rendered by the chat template
(text/chat.py: `--chat-template`, else the tokenizer's own; none is a 400 naming `--chat-template`) into one
prompt, which then goes the way a /v1/completions prompt goes (choices.py): the same sampling fields, beam search,
structured output, usage and token ids."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncGenerator

from fastapi import APIRouter, Depends, Request

from opt_serving.service import choices
from opt_serving.service import protocol as P
from opt_serving.service import protocol_chat as C
from opt_serving.service.deps import AUTH, service
from opt_serving.service.errors import as_http_errors
from opt_serving.service.serving import Service, cached_tokens, prompt_tokens, until_done_or_gone
from opt_serving.service.sse import sse_response

router = APIRouter(dependencies=AUTH)


@router.post("/v1/chat/completions", response_model=C.ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
async def chat_completions(req: C.ChatCompletionRequest, request: Request, svc: Service = Depends(service)):
    model = svc.served_name(req.model)
    with as_http_errors():  # the template renders and the text tokenises off the event loop
        ids = await asyncio.to_thread(lambda: svc.chat.prompt_ids(**req.template_args()))
    params = choices.sampling(svc, req, _max_tokens(svc, req, len(ids)), req.logprobs_asked)
    n = req.n or 1
    streams = await choices.start(svc, req, [ids], params, n)
    if req.stream:
        return sse_response(_chunks(svc, req, model, streams))

    async def work():
        outs = await svc.complete_all(streams, "chat", n)
        return C.ChatCompletionResponse(
            model=model, choices=[_choice(req, i, c) for i, c in enumerate(outs)],
            usage=P.usage(prompt_tokens(outs, n), sum(c.completion_tokens for c in outs), cached_tokens(outs, n)),
            prompt_logprobs=P.prompt_logprobs_of(outs[0].prompt_logprobs),
            prompt_token_ids=choices.prompt_token_ids(req, outs[0]))

    return await until_done_or_gone(request, work(), streams)


def _max_tokens(svc: Service, req: C.ChatCompletionRequest, prompt_len: int) -> int:
    """max_completion_tokens (or max_tokens); neither: what the context leaves after the prompt (as truncated), as
    OpenAI and vLLM give. At least 1: a prompt that fills the context is refused as too long."""
    if req.asked_max_tokens is not None:
        return req.asked_max_tokens
    keep = req.truncate_prompt_tokens
    if keep is not None:
        prompt_len = min(prompt_len, svc.max_seq_len if keep == -1 else keep)
    return max(svc.max_seq_len - prompt_len, 1)


def _choice(req: C.ChatCompletionRequest, index: int, c) -> C.ChatChoice:
    return C.ChatChoice(index=index, message=C.AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                        logprobs=_logprobs(req, c), token_ids=choices.token_ids(req, c))


def _logprobs(req: C.ChatCompletionRequest, d):
    return C.ChoiceLogprobs.of(d, req.top_logprobs or 0) if req.logprobs else None


async def _chunks(svc: Service, req: C.ChatCompletionRequest, model: str,
                  streams: list) -> AsyncGenerator[C.ChatCompletionChunk, None]:
    """Each choice's role, as its first chunk (the prompt's token ids on the very first, where asked), once the
    first delta arrives; then a chunk per delta of any choice; then the usage chunk if asked. With
    continuous_usage_stats every chunk carries its choice's usage so far."""
    cid, created = C._chat_id(), int(time.time())
    final_usage, every_chunk = req.usage_options
    tally = choices.Tally(len(streams), req.n or 1)

    def chunk(choice: C.ChatChunkChoice, usage=None, prompt_ids=None) -> C.ChatCompletionChunk:
        return C.ChatCompletionChunk(id=cid, created=created, model=model, choices=[choice], usage=usage,
                                     prompt_token_ids=prompt_ids)

    started = False
    async for i, d in choices.streamed(svc, streams, "chat", tally):
        if not started:  # (the first delta of any choice carries the prompt as the model read it)
            started = True
            for j in range(len(streams)):
                yield chunk(C.ChatChunkChoice(index=j, delta=C.ChatDelta(role="assistant", content="")),
                            P.usage(d.prompt_tokens, 0, d.cached_tokens) if every_chunk else None,
                            choices.prompt_token_ids(req, d) if j == 0 else None)
        yield chunk(C.ChatChunkChoice(index=i, delta=C.ChatDelta(content=d.text), logprobs=_logprobs(req, d),
                                      finish_reason=d.finish_reason, token_ids=choices.token_ids(req, d)),
                    tally.choice(i) if every_chunk else None)
    if final_usage:
        yield C.ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=tally.total())

"""The GPT-J REST API (GPT-API): `POST /generate`, answered with `{"gen_text": [...]}`; `do_sample=false`
with `num_beams > 1` is beam search, run by the generator outside the decode slots."""
from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from fastapi import APIRouter, Depends, Request

from opt_serving.service import protocol as P
from opt_serving.service.deps import AUTH, service
from opt_serving.service.errors import as_http_errors
from opt_serving.service.serving import Job, Service, prompt_tokens, until_done_or_gone

router = APIRouter(dependencies=AUTH)


@router.post("/generate", response_model=P.GenerateResponse)
async def generate(req: P.GenerateRequest, request: Request, svc: Service = Depends(service)):
    jobs = svc.jobs(list(req.prompt), 1, **_sampling(req, svc.g))

    def answer(outs: list) -> P.GenerateResponse:
        return P.GenerateResponse(gen_text=[_gen_text(req, prompt, c.text) for prompt, c in zip(req.prompt, outs)])

    if req.num_beams > 1:  # do_sample=false (protocol.py refuses beam sampling)
        return await _beam_search(svc, request, jobs, req, answer)

    async def work(streams):
        return answer(await svc.complete_all(streams, "generate"))

    return await svc.answer(request, jobs, work)


def _sampling(req: P.GenerateRequest, generator) -> dict:
    """The request's generator SamplingParams fields; lengths count new tokens, seed -1 is a random one."""
    sample = req.do_sample and req.temperature > 0
    return dict(max_tokens=req.max_length, min_tokens=req.min_length,
                temperature=req.temperature if sample else 0.0, top_k=int(req.top_k) if sample else 0,
                top_p=req.top_p if sample else 1.0, repetition_penalty=req.repetition_penalty,
                seed=None if req.seed == -1 else req.seed, stop=[req.end_sequence] if req.end_sequence else [],
                bad_words_ids=bad_words_ids(generator, req.bad_words), structured=req.structured())


def _gen_text(req: P.GenerateRequest, prompt: str, completion: str) -> str:
    """Like decoding Hugging Face's generate() output: the prompt included, from `return_prompt` on if given."""
    text = prompt + completion
    if req.return_prompt:
        at = text.find(req.return_prompt)
        text = text[at:] if at >= 0 else text
    return text


def bad_words_ids(generator, words: Sequence[str]) -> list[list[int]]:
    """GPT-J API's bad_words -> token id sequences, with and without a leading space (BPE spells them apart)."""
    out: list[list[int]] = []
    for w in words:
        for variant in (w, " " + w.lstrip()):
            ids = list(generator.tokenizer(variant, add_special_tokens=False)["input_ids"])
            if ids and ids not in out:
                out.append(ids)
    return out


async def _beam_search(svc: Service, request: Request, jobs: list[Job], req: P.GenerateRequest,
                       answer: Callable[[list], P.GenerateResponse]):
    """Every prompt's beam search queued at once, or none (a refusal is a 4xx: over the beam budget, 429
    while other searches hold it, 400 when larger than all of it), then awaited; a client that leaves or a
    timeout drops the searches not yet started and stops the running one before its next step."""
    with as_http_errors():
        futures = svc.g.beams(jobs, req.num_beams, early_stopping=req.early_stop)

    async def work():
        timer = svc.metrics.timer("generate")
        outs = []
        async with asyncio.timeout(svc.request_timeout):
            for i, f in enumerate(futures):  # in order: they run one after another anyway
                outs.append(await f)
                timer.tokens(outs[-1].completion_tokens, i)
        timer.finish(prompt_tokens(outs))
        return answer(outs)

    return await until_done_or_gone(request, work(), futures)

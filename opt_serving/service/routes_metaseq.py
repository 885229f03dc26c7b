"""metaseq's / Alpa's completions API: `POST /completions`, OpenAI-like choices that always carry logprobs
(finish_reason inside them too, where metaseq's clients read it)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from opt_serving.service import protocol as P
from opt_serving.service.deps import AUTH, service
from opt_serving.service.serving import Service, greedy_if_no_top_p, ranked

router = APIRouter(dependencies=AUTH)


@router.post("/completions", response_model=P.MetaseqResponse)
async def completions(req: P.MetaseqRequest, request: Request, svc: Service = Depends(service)):
    best_of = req.best_of or req.n
    temperature, top_p = greedy_if_no_top_p(req.temperature, req.top_p)
    jobs = svc.jobs(P.normalize_prompt(req.prompt), best_of, req.n, max_tokens=req.max_tokens,
                    min_tokens=req.min_tokens, temperature=temperature, top_p=top_p, seed=req.seed,
                    stop=P._stop_list(req.stop), logprobs=req.logprobs, echo=req.echo,
                    structured=req.structured())

    async def work(streams):
        outs = await svc.complete_all(streams, "metaseq", best_of)
        choices = [P.MetaseqChoice(text=c.text, index=k, finish_reason=c.finish_reason,
                                   logprobs=P.MetaseqLogprobs.of(c, finish_reason=c.finish_reason))
                   for k, c in ranked(outs, best_of, req.n)]
        return P.MetaseqResponse(model=svc.model_name, choices=choices)

    return await svc.answer(request, jobs, work)

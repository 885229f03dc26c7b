"""Probes, open without an API key: `GET /health` (what load balancers and Serve's replica check ask) and
`GET /metrics` (Prometheus)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from opt_serving.service.deps import service
from opt_serving.service.serving import Service

router = APIRouter()


@router.get("/health", responses={503: {"description": "the engine is dead or stuck; the reason is given"}})
async def health(svc: Service = Depends(service)):
    check = getattr(svc.g, "check_health", None)
    if check is not None:
        try:  # off the event loop: a slot model's own check may ask remote stages
            await asyncio.to_thread(check)
        except RuntimeError as e:
            return JSONResponse({"status": "unhealthy", "model": svc.model_name, "reason": str(e)},
                                status_code=503)
    return {"status": "ok", "model": svc.model_name}


@router.get("/metrics", include_in_schema=False)
async def metrics(svc: Service = Depends(service)):
    body, ctype = svc.metrics.render()
    return Response(body, media_type=ctype)

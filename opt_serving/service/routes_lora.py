"""vLLM's run-time LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, answered
as vLLM answers them (a plain-text success line; OpenAI's error shape otherwise). Open only where the server
was started with --enable-lora-runtime-updates (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING); a 404 otherwise. The
adapter is read and converted on a worker thread: running streams never wait for it (its first request puts it
on the device between two steps). The served adapters are models `/v1/models` lists (with their `parent`) and
a request's `model` names (routes_openai.py)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from opt_serving.errors import InvalidRequest, NotFound
from opt_serving.service import protocol as P
from opt_serving.service.deps import AUTH, service
from opt_serving.service.errors import as_http_errors
from opt_serving.service.serving import Service

router = APIRouter(dependencies=AUTH)


def _updates_allowed(svc: Service) -> None:
    if not svc.lora_updates:
        raise NotFound("loading and unloading LoRA adapters at run time is off: start the server with "
                       "--enable-lora-runtime-updates", code="not_found")


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(req: P.LoadLoraAdapterRequest, svc: Service = Depends(service)):
    with as_http_errors():
        _updates_allowed(svc)
        if req.lora_name in svc.model_names:
            raise InvalidRequest(f"'{req.lora_name}' is a name of the base model", param="lora_name")
        await asyncio.to_thread(svc.g.load_lora, req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(req: P.UnloadLoraAdapterRequest, svc: Service = Depends(service)):
    with as_http_errors():
        _updates_allowed(svc)
        svc.g.unload_lora(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

"""FastAPI dependencies the routers share: the app's `Service`, and the API key check."""
from __future__ import annotations

import hmac

from fastapi import Depends, Request

from opt_serving.service.errors import ApiError
from opt_serving.service.serving import Service


def service(request: Request) -> Service:
    return request.app.state.service


async def check_key(request: Request) -> None:
    """With API keys configured (app.state.api_keys), a request needs `Authorization: Bearer <one of them>`."""
    keys = request.app.state.api_keys
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                       "authentication_error", code="invalid_api_key")


AUTH = [Depends(check_key)]

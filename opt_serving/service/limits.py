"""A request body size limit (413), enforced before the body is read, parsed or tokenised.

A body larger than any request could use (64 prompts filling the longest context come to well under a megabyte)
is refused from its Content-Length without reading it; a chunked body is counted as it arrives and refused once
it passes the limit. TGI's --payload-limit does the same (2 MB by default).
"""
from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from opt_serving.service import protocol as P

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def _message(limit: int) -> str:
    return f"request body is larger than this server's limit of {limit} bytes (max_body_bytes)"


class BodyTooLarge(HTTPException):
    """Raised while the body is read: an HTTPException, so FastAPI's body parsing lets it through to the
    app's error handler (any other exception there becomes a 400)."""

    def __init__(self, limit: int):
        super().__init__(413, _message(limit))


class BodyLimit:
    """Pure ASGI middleware: 413 in OpenAI's error shape for HTTP bodies over `limit` bytes."""

    def __init__(self, app, limit: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)  # never read
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def noting_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, counted_receive, noting_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps(P.error_json(_message(self.limit), code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

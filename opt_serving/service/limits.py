"""A request body size limit (413), enforced before the body is parsed or tokenised, and the draining that
lets every client read an answer sent before the body was read.

A body larger than any request could use (64 prompts filling the longest context come to well under a megabyte)
is refused from its Content-Length before any of it is parsed; a chunked body is counted as it arrives and
refused once it passes the limit. TGI's --payload-limit does the same (2 MB by default).

An answer sent while the client is still sending its body (413, or a 401 / 404 / 500 sent before the route read
it) reaches only clients that read while they send (curl, requests, httpx). Python's urllib and http.client
send the whole body first: if the server closes with unread bytes, the kernel resets the connection and they see
"Connection reset by peer" instead of the status. `DrainUnreadBody` does what nginx's lingering close does: it
sends the answer at once, then reads and discards the rest of the body (at most DRAIN_MAX_BYTES, for at most
DRAIN_MAX_S, each read within DRAIN_IDLE_S) before the connection is closed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.exceptions import HTTPException

from opt_serving.service import protocol as P

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# what an answered request's unread body may cost to discard; nginx lingers up to 30 s, 5 s per read
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_MAX_S = 30.0
DRAIN_IDLE_S = 5.0


def _message(limit: int) -> str:
    return f"request body is larger than this server's limit of {limit} bytes (max_body_bytes)"


class BodyTooLarge(HTTPException):
    """Raised while the body is read: an HTTPException, so FastAPI's body parsing lets it through to the
    app's error handler (any other exception there becomes a 400)."""

    def __init__(self, limit: int):
        super().__init__(413, _message(limit))


class BodyLimit:
    """Pure ASGI middleware: 413 in OpenAI's error shape for HTTP bodies over `limit` bytes (the body is left
    unparsed; DrainUnreadBody, outside, discards it after the answer)."""

    def __init__(self, app, limit: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)  # never parsed
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


def _has_body(headers: dict) -> bool:
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0").strip() not in (b"0", b"")


class DrainUnreadBody:
    """Pure ASGI middleware, outermost: when an answer ends before the request body was read to its end, the
    answer is sent, then the rest of the body is read and discarded (bounded: DRAIN_MAX_BYTES, DRAIN_MAX_S,
    DRAIN_IDLE_S), and only then is the response finished (and a `Connection: close` connection closed), so a
    client that sends its whole body before reading gets the status, not a reset. Not when the client asked
    `Expect: 100-continue` and nothing was read: it is waiting for our word and sends no body after a refusal
    (reading would make the server send "100 Continue" after the answer)."""

    def __init__(self, app, max_bytes: int = DRAIN_MAX_BYTES, max_s: float = DRAIN_MAX_S,
                 idle_s: float = DRAIN_IDLE_S):
        self.app, self.max_bytes, self.max_s, self.idle_s = app, max_bytes, max_s, idle_s

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or []) if scope["type"] == "http" else {}
        if not _has_body(headers):
            return await self.app(scope, receive, send)
        waits_for_continue = b"100-continue" in headers.get(b"expect", b"").lower()
        read_any = ended = False

        async def tracked_receive():
            nonlocal read_any, ended
            message = await receive()
            if message["type"] == "http.request":
                read_any = True
                ended = not message.get("more_body", False)
            else:  # http.disconnect: nothing more will come
                ended = True
            return message

        async def lingering_send(message):
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if last and not ended and not (waits_for_continue and not read_any):
                await send({**message, "more_body": True})  # the answer leaves now, in full
                await self._drain(tracked_receive)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app(scope, tracked_receive, lingering_send)

    async def _drain(self, receive) -> None:
        """Read and discard the body until it ends or a bound is reached (the connection is then closed with
        bytes unread, as before: only a client sending more than the bounds allow sees a reset)."""
        seen, deadline = 0, time.monotonic() + self.max_s
        while seen <= self.max_bytes:
            wait = min(self.idle_s, deadline - time.monotonic())
            if wait <= 0:
                return
            try:
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            seen += len(message.get("body", b""))


class DisconnectOnReceiveFailure:
    """Pure ASGI middleware, outermost: a `receive()` that raises (the connection to the client is broken
    below the app: Serve's proxy died) reads as `http.disconnect`, now and on every later call."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        broken = False

        async def receive_or_disconnect():
            nonlocal broken
            if not broken:
                try:
                    return await receive()
                except Exception as e:  # (not a cancellation: that is a BaseException)
                    broken = True
                    log.warning("reading the request failed (%s: %s); taken as the client disconnecting",
                                type(e).__name__, e)
            return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)

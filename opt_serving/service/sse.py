"""Server-sent events: `data: <json>` events, then `data: [DONE]`.

Once the 200 has gone out, a failure can only be told in the stream: it becomes one error event (OpenAI's
error shape, the same status mapping as a plain answer) before [DONE]. A client that leaves is a
cancellation instead, and gets nothing more.
"""
from __future__ import annotations

import json
import logging
from typing import AsyncGenerator, AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from opt_serving.service.errors import internal_error, to_api_error, unwrap

log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def event(body: BaseModel | dict) -> str:
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return f"data: {data}\n\n"


def sse_response(events: AsyncGenerator[BaseModel, None]) -> StreamingResponse:
    """Stream `events` as server-sent events. However the stream ends (done, failed, or the client gone),
    `events` is closed, so its own cleanup (cancelling its engine requests) runs."""

    async def body() -> AsyncIterator[str]:
        try:
            async for item in events:
                yield event(item)
        except Exception as e:  # after the 200: reported in the stream
            mapped = to_api_error(unwrap(e))
            if mapped is None:
                log.exception("stream failed")
                mapped = internal_error(e)
            yield event(mapped.json())
        finally:
            await events.aclose()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

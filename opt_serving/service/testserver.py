"""Run an ASGI app with uvicorn on 127.0.0.1 in a background thread (tests, notebooks).

    with serve_in_thread(create_app(generator)) as url:
        requests.post(url + "/v1/completions", json=...)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from opt_serving.service.ports import free_port

__all__ = ["free_port", "serve_in_thread"]


@contextlib.contextmanager
def serve_in_thread(app, port: int | None = None) -> Iterator[str]:
    """Yields the base URL once the server accepts connections; stops it on exit."""
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn failed to start")
            thread.join(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)

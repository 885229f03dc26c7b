"""The HTTP service. `app` is the Ray Serve application builder: `serve run opt_serving.service:app model=... path=...`.

`create_app(generator)` gives the plain FastAPI app (no Ray), e.g. for tests against the fake engine.
"""
from opt_serving.service.app import create_app
from opt_serving.service.deployment import ServeArgs, build_app

app = build_app  # after the imports above: the submodule `app` must not take this name back

__all__ = ["app", "build_app", "create_app", "ServeArgs"]

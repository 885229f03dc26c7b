"""Typed errors, raised where a request is refused and mapped to HTTP statuses in one place
(service/errors.py). This module imports nothing of ours: every layer may raise these.

    InvalidRequest          a request this server will never answer as asked (HTTP 400)
      ContextLengthExceeded the prompt (+ the tokens asked for) does not fit the model's context
    NotFound                what the request names is not here, e.g. a model this server does not serve (HTTP 404)
    Overloaded              no room now; the same request may succeed later (HTTP 429)
    Unavailable             the model cannot answer now: shutting down, a dead worker (HTTP 503)
"""
from __future__ import annotations

from typing import Optional


class OPTServingError(Exception):
    """Base of the errors a client can be told about."""


class InvalidRequest(OPTServingError, ValueError):
    """A request that cannot be answered as asked. `param` names the request field at fault (None when it
    is the request as a whole); `code` is a short machine-readable reason (OpenAI's error `code`)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt and the tokens asked for, exceed the model's context."""

    def __init__(self, message: str, param: Optional[str] = "prompt"):
        super().__init__(message, param=param, code="context_length_exceeded")


class NotFound(OPTServingError, LookupError):
    """What a request names (a model) is not served here; `param` names the field, `code` OpenAI's reason."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


class Overloaded(OPTServingError, RuntimeError):
    """Refused for lack of room (a full queue); retrying later may succeed."""
    code = "queue_full"


class Unavailable(OPTServingError, RuntimeError):
    """The model cannot answer now (shutting down, a worker died); `code` says which."""
    code = "unavailable"


class MissingExtra(ImportError):
    """A feature needs a package that is an optional extra of this project (e.g. torch for .pt checkpoints)."""


def require(module: str, extra: str, what: str):
    """Import `module`, which `what` needs and the `extra` installs: MissingExtra saying what to install
    where it is absent."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{what} needs {module}, which is not installed: pip install 'opt_serving[{extra}]' "
                           f"(make setup installs it)") from None

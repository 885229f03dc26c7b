"""A free TCP port on this machine (for the Serve proxy that direct ingress leaves idle, and test servers)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice); another process may still take it first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

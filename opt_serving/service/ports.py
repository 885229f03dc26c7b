"""This machine's TCP ports: a free one (for the Serve proxy that direct ingress leaves idle, and test servers), and
what holds one that is taken (`opt-serving serve` says so before starting a Ray that would fail to bind it)."""
from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray gives its workers ports 10002-19999 by default (`ray start --min-worker-port/--max-worker-port`)
ABOVE_RAY_WORKERS = 20000
LINUX_EPHEMERAL = (32768, 60999)  # where /proc does not say


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ephemeral ports: the local ends it gives outgoing connections, and binding port 0."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return LINUX_EPHEMERAL


def free_port() -> int:
    """A port nothing is bound to now, chosen at random between Ray's worker ports and the ephemeral range where
    there is room (otherwise the kernel's choice). A port from the ephemeral range, which binding port 0 gives,
    is also what the kernel picks for the local end of an outgoing connection: on a machine running Ray (many
    connections a second) one can take it in the seconds before the server it was chosen for binds it, and
    that server fails to start. Another process may still take a port chosen here first."""
    low, _ = ephemeral_ports()
    if low - ABOVE_RAY_WORKERS >= 1000:
        rng = random.Random()  # seeded from the OS: processes choosing at once choose apart
        for _ in range(100):
            port = rng.randrange(ABOVE_RAY_WORKERS, low)
            if bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bindable(port: int) -> bool:
    """Whether a server could bind `port` on every address now (nothing bound to it on any)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def port_holder(host: str, port: int) -> str | None:
    """None when `port` can be bound on `host`; else what holds it: the listening process (pid and command
    line) where it can be found, or a plain description."""
    bind_host = "" if host in ("0.0.0.0", "::") else host
    with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no holder
        try:
            s.bind((bind_host, port))
            return None
        except OSError as e:
            reason = e.strerror or str(e)
    try:
        import psutil
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                cmd = " ".join(psutil.Process(c.pid).cmdline())
                return f"process {c.pid} ({cmd[:160]})"
    except (psutil.Error, OSError):
        pass
    return f"another process ({reason})"

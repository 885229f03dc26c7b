"""Which Ray cluster to join, decided in seconds: never a head that is gone.

`ray.init(address="auto")` (and `ray.init()`, which reads the same file) trusts Ray's address file,
`ray_current_cluster` under Ray's temp folder, written by the last `ray start --head`. A cluster killed hard
(the machine rebooted, `kill -9`, a container stopped) leaves it behind, and Ray then retries the dead head's
GCS for minutes without a word. Here every address is checked first with a plain TCP connection to its GCS
port (a refused or unanswered connection within `timeout_s`): an explicit address (`RAY_ADDRESS`, a
command's `--ray-address`) that does not answer is an error naming it; a stale file is skipped, saying so,
and the caller starts a Ray of its own.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Found:
    address: Optional[str]   # a GCS address that answers, or None: start a Ray of our own
    note: str = ""           # what was skipped and why (an address file naming a dead head)


def answers(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at `address` ("host:port", Ray's GCS)."""
    host, _, port = address.strip().rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def address_file() -> str:
    """Ray's own address file (`ray_current_cluster` under its temp folder)."""
    from ray._common.utils import get_ray_address_file
    return get_ray_address_file(None)


def _file_address() -> Optional[str]:
    try:
        with open(address_file()) as f:
            return f.read().strip() or None
    except OSError:
        return None


def find_cluster(address: Optional[str] = None, timeout_s: float = CONNECT_TIMEOUT_S) -> Found:
    """The Ray cluster to join, as ray.init() picks it, but only one that answers.

    `address` (a command's --ray-address; else $RAY_ADDRESS): explicit, so one that does not answer is a
    ConnectionError naming it ("local": None). Without one: the cluster of the last `ray start --head` on this
    machine (Ray's address file) when its GCS answers, else None (start a Ray of our own), with a note saying
    what was skipped. A Ray another program started for itself (ray.init()) writes no address file and is
    never joined (address="auto" would join any it finds)."""
    explicit = address if address not in (None, "", "auto") else os.environ.get("RAY_ADDRESS") or None
    if explicit == "auto":
        explicit = None
    if explicit == "local":
        return Found(None)
    if explicit is not None:
        if "://" in explicit:  # ray:// (Ray Client) and http:// (jobs): Ray's own checks apply
            return Found(explicit)
        if not answers(explicit, timeout_s):
            raise ConnectionError(
                f"no Ray cluster answers at {explicit} (from {'--ray-address' if address else 'RAY_ADDRESS'}); "
                "start it (`ray start --head`), give the address of one that runs, or 'local' for a Ray of "
                "this process's own")
        return Found(explicit)
    note = ""
    in_file = _file_address()
    if in_file is not None:
        if answers(in_file, timeout_s):
            return Found(in_file)
        note = (f"Ray's address file {address_file()} names a head at {in_file} that does not answer (a cluster "
                "stopped without `ray stop`?): ignored")
    return Found(None, note)


def init(address: Optional[str] = None, start: bool = True, **local_kwargs):
    """ray.init on the cluster find_cluster picks; with none, a new local Ray (`local_kwargs` for it) when
    `start`. Returns (whether Ray is now initialised, whether this call started a local Ray). Says on the log
    what it skipped and that it started its own."""
    import ray
    if ray.is_initialized():
        return True, False
    found = find_cluster(address)
    if found.address is not None:
        if found.note:
            log.warning("%s; joining the Ray cluster at %s", found.note, found.address)
        ray.init(address=found.address, **{k: v for k, v in local_kwargs.items() if k in _JOIN_KWARGS})
        return True, False
    if not start:
        if found.note:
            log.warning("%s", found.note)
        return False, False
    if found.note:
        log.warning("%s; starting a Ray of this process's own", found.note)
    ray.init(address="local", **local_kwargs)
    return True, True


# what ray.init takes when joining a cluster (the rest only configures a Ray started here)
_JOIN_KWARGS = ("logging_level", "log_to_driver", "namespace", "runtime_env")

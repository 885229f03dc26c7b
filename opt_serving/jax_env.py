"""JAX's device settings for each kind of process, as the environment variables JAX reads when it starts its
GPU client (so they must be in place before a process's first JAX computation; they mean nothing on a CPU).

By default JAX takes 75% of every GPU it sees at its first computation. Two kinds of process run here:
- one that only plans or routes (the `opt-serving` command, the replica that drives pipeline stages, a
  notebook driving them) takes no device memory ahead of need: `route_only()`;
- one that runs the model (a replica with its GPUs, a pipeline stage) takes the share of each of its GPUs the
  planner counted on, `1 - headroom` of the device (the planner's `DEFAULT_HEADROOM`, 0.1), times the share of
  the GPU it reserved: `runs_model(gpus)`; one that reserved no GPU sees none (`JAX_PLATFORMS=cpu`), so it never
  lands on a GPU that Ray gave to another.
A user's own setting of any of these variables wins.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, MutableMapping

XLA_FLAGS = "XLA_FLAGS"
HOST_DEVICES = "--xla_force_host_platform_device_count"
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
PLATFORMS = "JAX_PLATFORMS"
DEFAULT_HEADROOM = 0.1  # the planner's: the fraction of a device's memory it leaves to the runtime


def route_only() -> dict[str, str]:
    """A process that plans or routes: GPU memory taken as needed (little), never 75% up front."""
    return {PREALLOCATE: "false"}


def runs_model(gpus: float, headroom: float = DEFAULT_HEADROOM) -> dict[str, str]:
    """A process that runs the model on `gpus` GPUs (a fraction: a share of one): the memory the planner
    counted on; with none, the CPU only."""
    if gpus <= 0:
        return {PLATFORMS: "cpu"}
    return {MEM_FRACTION: f"{(1 - headroom) * min(gpus, 1.0):.3f}"}


def host_devices(n: int, user: Mapping[str, str] = os.environ) -> dict[str, str]:
    """XLA_FLAGS for a CPU process that makes `n` host devices: the user's other XLA flags kept (a device count
    they gave is replaced)."""
    kept = [f for f in user.get(XLA_FLAGS, "").split() if not f.startswith(HOST_DEVICES)]
    return {XLA_FLAGS: " ".join(kept + [f"{HOST_DEVICES}={n}"])}


def keep_users(env: Mapping[str, str], user: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env` with the user's own values where they set them (for another process's runtime environment)."""
    return {k: user.get(k, v) for k, v in env.items()}


def apply(env: Mapping[str, str], environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set `env` in this process where the user has not. False when JAX has already started its backends here
    (then the settings come too late for this process)."""
    for k, v in env.items():
        environ.setdefault(k, v)
    return not started()


def started() -> bool:
    """Has this process started JAX's backends (after which its memory settings are fixed)?"""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # another JAX's internals: assume it may have
        return True

"""How a pipeline's stages hand hidden states on: through Ray object refs, or one Ray Compiled Graph (handoff.py);
which of the two a pipeline uses and why, and what a hand-off through object refs costs (the cost model's
`handoff_latency_s`).
"""
from __future__ import annotations

import time

import numpy as np

HANDOFFS = ("auto", "cgraph", "refs")


def choose_handoff(handoff: str, nodes: int, gpus: bool) -> tuple[str, str]:
    """The hand-off a pipeline uses ("cgraph" or "refs") and why, for the `handoff` asked, the nodes its stages
    lie on and whether they run on GPUs. `auto` is object refs, the one measured faster: across nodes Ray 2.60's
    raylet failed a check (experimental_mutable_object_provider.cc) at a compiled graph's first write, and on CPU
    stages a compiled graph's stage waiting for its input polls its channel, taking CPU from the stages' kernels
    (the pipelined decode loop ran 0.74-0.76x as fast as with refs on one CPU node, benchmark/README.md). On one
    node of GPUs a compiled graph was never measured: `handoff="cgraph"` asks for it."""
    if handoff != "auto":
        return handoff, f"asked for (handoff={handoff!r})"
    if nodes > 1:
        return "refs", f"the stages span {nodes} nodes, where compiled graphs are not used (handoff='auto')"
    if not gpus:
        return "refs", ("the stages run on CPUs, where a compiled graph's waiting stages poll and slow the others' "
                        "kernels (handoff='auto')")
    return "refs", ("a compiled graph on GPUs is not measured yet (handoff='auto'; handoff='cgraph' asks for "
                    "one)")


class _Echo:
    def echo(self, x):
        return x


def measure_handoff_latency(repeat: int = 30, nbytes: int = 4096) -> float:
    """Seconds one stage-to-stage hand-off costs through Ray (actor call + object ref), for
    calibrating the cost model's `handoff_latency_s`. Needs ray.init() first."""
    import ray
    a, b = ray.remote(num_cpus=0)(_Echo).remote(), ray.remote(num_cpus=0)(_Echo).remote()
    x = np.zeros(nbytes // 4, np.float32)
    ray.get(b.echo.remote(a.echo.remote(x)))          # start both workers
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ray.get(b.echo.remote(a.echo.remote(x)))
        times.append(time.perf_counter() - t0)
    for actor in (a, b):
        ray.kill(actor)
    # two calls in the chain: the hand-off between them plus the final return
    return float(np.median(times)) / 2

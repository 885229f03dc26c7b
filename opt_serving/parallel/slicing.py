"""Alpa's inter-operator dynamic programme: contiguous layers into pipeline stages.

A solver on its own: candidate.py builds the cost and memory tables this solves over; planner re-exports it.
"""
from __future__ import annotations

import numpy as np


def slice_layers(cost_of: np.ndarray, mem_of: np.ndarray, limit: float) -> tuple[float, list[int]] | None:
    """Contiguous split of L layers into S stages minimising the slowest stage.

    cost_of[s, n] / mem_of[s, n]: time / per-device bytes of stage s holding n layers
    (n = 0..L; stages differ: the first also embeds, the last also computes logits, and the
    hand-off after a stage depends on which node the next one sits on). Alpa's inter-operator
    DP minimises sum(stage) + (M - 1) * max(stage); with layer costs that add up, the sum is
    the same for every split, so that is the min-max split solved here. Returns
    (max stage cost, layers per stage), or None when no split fits in memory.
    """
    S, L1 = cost_of.shape
    L = L1 - 1
    inf = np.inf
    # f[j]: best max-cost placing the first j layers in the stages so far
    f = np.full(L + 1, inf)
    f[0] = 0.0
    choice = np.zeros((S, L + 1), dtype=np.int64)
    for s in range(S):
        g = np.full(L + 1, inf)
        for j in range(1, L + 1):
            i = np.arange(j)                          # previous boundary
            n = j - i                                 # layers in stage s
            c = np.maximum(f[i], cost_of[s, n])
            c[mem_of[s, n] > limit] = inf
            k = int(np.argmin(c))
            g[j], choice[s, j] = c[k], k
        f = g
    if not np.isfinite(f[L]):
        return None
    split, j = [], L
    for s in range(S - 1, -1, -1):
        i = int(choice[s, j])
        split.append(j - i)
        j = i
    return float(f[L]), split[::-1]

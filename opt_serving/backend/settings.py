"""The backend's environment switches, read in one place into one value (`BackendSettings.from_env()`)."""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """What the environment asks of the CPU fast paths and the host-side helpers:

    kernels      OPT_SERVING_ONEDNN: "0" turns the CPU kernels off (plain XLA everywhere; the extension
                 is not even loaded)
    bf16_screen  OPT_SERVING_BF16_SCREEN: "0" turns the screened (int8 or bfloat16) greedy head off (greedy steps
                 make the float32 logits)
    cpu_threads  OPT_SERVING_CPU_THREADS: the kernels' threads (default: every CPU this process may run on)
    cext         OPT_SERVING_NO_CEXT: "1" makes packing.py keep its pure-Python versions
    bf16_fma_rows  OPT_SERVING_BF16_FMA_ROWS: bfloat16 products of at least that many rows widen the weights
                 and multiply with float32 FMAs (csrc/products.cc, bf16_fma); 0 never. Default: 8 on Intel
                 CPUs without AMX (their bfloat16 dot products run no faster than float32 FMAs), else never
    s8_vnni_rows  OPT_SERVING_S8_VNNI_ROWS: int8 products of at least that many rows run our VNNI kernel
                 (csrc/products.cc, s8_vnni: the same numbers as oneDNN's, its work handed out as the threads
                 free up); 0 never (oneDNN's kernel). Default: 8

    OPT_SERVING_NO_AVX512 is read by csrc/attention.cc itself (the decode attention's portable code), and
    OPT_SERVING_PIN_THREADS by csrc/common.cc: "0" leaves the kernels' team unpinned (by default each of its
    threads holds one CPU of the process's). OPT_SERVING_KEEP_HEAP is read by backend/cpu/heap.py: "0" leaves
    glibc's malloc thresholds as they are.
    """
    kernels: bool = True
    bf16_screen: bool = True
    cpu_threads: Optional[int] = None
    cext: bool = True
    bf16_fma_rows: Optional[int] = None
    s8_vnni_rows: Optional[int] = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "BackendSettings":
        threads = env.get("OPT_SERVING_CPU_THREADS")
        return cls(kernels=env.get("OPT_SERVING_ONEDNN", "1") != "0",
                   bf16_screen=env.get("OPT_SERVING_BF16_SCREEN", "1") != "0",
                   cpu_threads=max(1, int(threads)) if threads else None,
                   cext=env.get("OPT_SERVING_NO_CEXT") != "1",
                   bf16_fma_rows=max(0, int(env["OPT_SERVING_BF16_FMA_ROWS"]))
                   if env.get("OPT_SERVING_BF16_FMA_ROWS") else None,
                   s8_vnni_rows=max(0, int(env["OPT_SERVING_S8_VNNI_ROWS"]))
                   if env.get("OPT_SERVING_S8_VNNI_ROWS") else None)

    def threads(self) -> int:
        """The kernels' threads: `cpu_threads`, else every CPU this process may run on, as XLA's own pool
        does. OMP_NUM_THREADS is not followed: Ray sets it to a worker's CPU reservation (1 for a Serve
        replica), which would leave the products on one core beside XLA on all."""
        if self.cpu_threads:
            return self.cpu_threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

"""Every `OPT_SERVING_*` environment switch, read in one place into one value (`Settings.from_env()`).

The ground floor (no other opt_serving import): the backend reads it where a model is loaded, packing.py at its
import, xla_cache.enable() before the first compile, model/embedded.py for its cache folder and the service's command
line for API keys. docs/operating.md lists the switches; a new one is a field here and a row there.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, MutableMapping, Optional

PREFIX = "OPT_SERVING_"
OFF = ("0", "off", "false", "none")  # OPT_SERVING_COMPILE_CACHE's values that turn the cache off
SPIN = "GOMP_SPINCOUNT"  # libgomp's: how long an idle worker of the kernels' team spins before it sleeps
KERNEL_SPIN = "30000"  # ~0.3 ms: through the gaps between a step's kernel calls, not through the host's turn
spin_in_time = True  # False: a libgomp had loaded before openmp_defaults set KERNEL_SPIN (it kept its own)


def _rows(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    return max(0, int(value)) if value else None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the environment asks of this process (each field: its variable, what it does, its default):

    kernels      OPT_SERVING_ONEDNN: "0" turns the CPU kernels off (plain XLA everywhere; the extension
                 is not even loaded)
    bf16_screen  OPT_SERVING_BF16_SCREEN: "0" turns the screened (int8 or bfloat16) greedy head off (greedy steps
                 make the float32 logits)
    cpu_threads  OPT_SERVING_CPU_THREADS: the kernels' threads (default: every CPU this process may run on)
    cext         OPT_SERVING_NO_CEXT: "1" makes packing.py keep its pure-Python versions
    bf16_fma_rows  OPT_SERVING_BF16_FMA_ROWS: bfloat16 products of at least that many rows widen the weights
                 and multiply with float32 FMAs (csrc/products_bf16.cc, bf16_fma); 0 never. Default: 8 on Intel
                 CPUs without AMX (their bfloat16 dot products run no faster than float32 FMAs), else never
    f32_tile_rows  OPT_SERVING_F32_TILE_ROWS: float32 products of 9 to that many rows run our tiled kernel
                 (csrc/products_f32.cc, f32_tiles: the weights streamed while the rows' tiles compute); 0 never
                 (oneDNN's kernel). Default with AVX-512: 48 on AMD CPUs, 96 on others; never without it
    s8_vnni_rows  OPT_SERVING_S8_VNNI_ROWS: int8 products of at least that many rows run our VNNI kernel
                 (csrc/products_s8.cc, s8_vnni: the same numbers as oneDNN's, its work handed out as the threads
                 free up); 0 never (oneDNN's kernel). Default: 1 (every int8 product it can read)
    keep_heap    OPT_SERVING_KEEP_HEAP: "0" leaves glibc's malloc thresholds as they are (backend/cpu/heap.py)
    compile_cache  OPT_SERVING_COMPILE_CACHE: the folder compiled steps are kept in between starts, "" for the
                 default one, None where "0"/"off" turned it off (xla_cache.py)
    cache_dir    OPT_SERVING_CACHE: where the embedded tiny model is built (default ~/.cache/opt_serving)
    api_keys     OPT_SERVING_API_KEYS: the keys the server accepts besides --api-key (comma separated)
    pin_threads  OPT_SERVING_PIN_THREADS: "0" leaves the kernels' team unpinned (by default each of its threads
                 holds one CPU of the process's)
    avx512       OPT_SERVING_NO_AVX512 (any value): the portable code of the decode attention and of the
                 screened head's passes over the vocabulary
    amx          OPT_SERVING_NO_AMX (any value): a prompt's attention over a bfloat16 cache on the AVX-512 tiles
                 where the CPU has AMX (csrc/ragged_attention_amx.cc)

    The last three are read by the C++ extension itself too (csrc/common.cc's pin_team, common.h's use_avx512 and
    ragged_attention_amx.cc's use_amx, once, when the kernels first run), from the same variables: these fields say
    what it will read.
    """
    kernels: bool = True
    bf16_screen: bool = True
    cpu_threads: Optional[int] = None
    cext: bool = True
    bf16_fma_rows: Optional[int] = None
    s8_vnni_rows: Optional[int] = None
    f32_tile_rows: Optional[int] = None
    keep_heap: bool = True
    compile_cache: Optional[str] = ""
    cache_dir: Optional[Path] = None
    api_keys: tuple[str, ...] = ()
    pin_threads: bool = True
    avx512: bool = True
    amx: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        threads = env.get(PREFIX + "CPU_THREADS")
        cache = env.get(PREFIX + "COMPILE_CACHE", "").strip()
        return cls(kernels=env.get(PREFIX + "ONEDNN", "1") != "0",
                   bf16_screen=env.get(PREFIX + "BF16_SCREEN", "1") != "0",
                   cpu_threads=max(1, int(threads)) if threads else None,
                   cext=env.get(PREFIX + "NO_CEXT") != "1",
                   bf16_fma_rows=_rows(env, PREFIX + "BF16_FMA_ROWS"),
                   s8_vnni_rows=_rows(env, PREFIX + "S8_VNNI_ROWS"),
                   f32_tile_rows=_rows(env, PREFIX + "F32_TILE_ROWS"),
                   keep_heap=env.get(PREFIX + "KEEP_HEAP", "1") != "0",
                   compile_cache=None if cache.lower() in OFF else cache,
                   cache_dir=Path(env[PREFIX + "CACHE"]) if env.get(PREFIX + "CACHE") else None,
                   api_keys=tuple(k for k in env.get(PREFIX + "API_KEYS", "").split(",") if k),
                   pin_threads=env.get(PREFIX + "PIN_THREADS") != "0",
                   avx512=PREFIX + "NO_AVX512" not in env,
                   amx=PREFIX + "NO_AMX" not in env)

    def threads(self) -> int:
        """The kernels' threads: `cpu_threads`, else every CPU this process may run on, as XLA's own pool
        does. OMP_NUM_THREADS is not followed: Ray sets it to a worker's CPU reservation (1 for a Serve
        replica), which would leave the products on one core beside XLA on all."""
        if self.cpu_threads:
            return self.cpu_threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def openmp_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    """Set the kernels' libgomp spin (`KERNEL_SPIN`) unless the environment has one; `spin_in_time` turns False
    where that comes too late: a libgomp is already loaded in this process, and libgomp reads its variables once,
    when it loads. opt_serving's first import calls it, since torch brings its own libgomp under the same name
    (the kernels then use that one) and transformers imports torch with any tokenizer. With libgomp's own
    default (300000 rounds) the team's worker, pinned to its CPU, spun through the host's turn between two
    decode steps and held that CPU from the engine's and the HTTP threads while the other CPU sat idle."""
    global spin_in_time
    if SPIN not in env:  # (else the user's own, in the environment a libgomp read or will read)
        env[SPIN] = KERNEL_SPIN
        spin_in_time = not libgomp_loaded()


def libgomp_loaded() -> bool:
    """Whether this process has a libgomp mapped (Linux; False where /proc cannot say)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False

"""The CPU kernels' extension (opt_serving/_cpu_kernels.so, built by build.sh): loaded once, its C entry
points typed for ctypes, its XLA FFI targets registered for the CPU platform, its threads set."""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Optional

import jax

from opt_serving import settings as switches
from opt_serving.settings import KERNEL_SPIN, SPIN, Settings

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parents[2] / "_cpu_kernels.so"
MATMUL, ARGMAX, ATTENTION, GREEDY_HEAD = "opt_onednn_matmul", "opt_argmax", "opt_decode_attention", "opt_greedy_head"
MATMUL_LOWP, GREEDY_HEAD8 = "opt_onednn_matmul_lowp", "opt_greedy_head8"
RAGGED_ATTENTION, LAYER_NORM = "opt_ragged_attention", "opt_layer_norm"


@functools.cache
def _load() -> Optional[ctypes.CDLL]:
    if not LIBRARY.exists():
        return None
    # the team worker's spin (settings.openmp_defaults), set at opt_serving's import; a libgomp loaded before
    # that (torch imported first) kept its own default, which the user is told of
    if not switches.spin_in_time:
        log.warning("a libgomp was loaded before opt_serving was imported (torch imported first?): the CPU "
                    "kernels' threads spin with libgomp's default, which slows serving; import opt_serving first "
                    "or start Python with %s=%s", SPIN, KERNEL_SPIN)
    try:
        lib = ctypes.CDLL(str(LIBRARY))
    except OSError:  # built against a oneDNN that is gone: the plain XLA path still works
        return None
    lib.opt_onednn_packed_bytes.restype = ctypes.c_int64
    lib.opt_onednn_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    for fn in (lib.opt_onednn_pack, lib.opt_onednn_unpack):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.opt_onednn_packed_bytes_as.restype = ctypes.c_int64
    lib.opt_onednn_packed_bytes_as.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.opt_onednn_pack_as.restype = ctypes.c_int
    lib.opt_onednn_pack_as.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_void_p]
    lib.opt_onednn_unpack_as.restype = ctypes.c_int
    lib.opt_onednn_unpack_as.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                         ctypes.c_void_p]
    lib.opt_head_packed_bytes.restype = ctypes.c_int64
    lib.opt_head_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.opt_head_pack.restype = ctypes.c_int
    lib.opt_head_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.opt_head8_pack.restype = ctypes.c_int
    lib.opt_head8_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4
    lib.opt_cpu_kernels_set_threads.argtypes = [ctypes.c_int]
    lib.opt_bf16_fma_rows.restype = ctypes.c_int64
    lib.opt_bf16_fma_rows.argtypes = [ctypes.c_int64]
    lib.opt_s8_vnni_rows.restype = ctypes.c_int64
    lib.opt_s8_vnni_rows.argtypes = [ctypes.c_int64]
    lib.opt_s8_row_levels.restype = ctypes.c_int
    lib.opt_s8_row_levels.argtypes = []
    lib.opt_f32_tile_rows.restype = ctypes.c_int64
    lib.opt_f32_tile_rows.argtypes = [ctypes.c_int64]
    for fn in (lib.opt_bf16_fma_reads, lib.opt_s8_vnni_reads):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int64, ctypes.c_int64]
    settings = Settings.from_env()
    lib.opt_cpu_kernels_set_threads(settings.threads())
    lib.opt_bf16_fma_rows(-1 if settings.bf16_fma_rows is None else settings.bf16_fma_rows)
    lib.opt_s8_vnni_rows(-1 if settings.s8_vnni_rows is None else settings.s8_vnni_rows)
    lib.opt_f32_tile_rows(-1 if settings.f32_tile_rows is None else settings.f32_tile_rows)
    for target, fn in ((MATMUL, lib.OptOnednnMatmul), (MATMUL_LOWP, lib.OptOnednnMatmulLowp), (ARGMAX, lib.OptArgmax),
                       (ATTENTION, lib.OptDecodeAttention), (GREEDY_HEAD, lib.OptGreedyHead),
                       (GREEDY_HEAD8, lib.OptGreedyHead8), (RAGGED_ATTENTION, lib.OptRaggedAttention),
                       (LAYER_NORM, lib.OptLayerNorm)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
    return lib


def load(threads: Optional[int] = None) -> Optional[ctypes.CDLL]:
    """The extension, None where it is not built or does not load; with `threads`, its kernels run that many
    from now on (else every CPU this process may run on)."""
    lib = _load()
    if lib is not None and threads:
        lib.opt_cpu_kernels_set_threads(threads)
    return lib


def lib() -> ctypes.CDLL:
    """The extension, for code that cannot run without it (packing, and tracing a kernel call)."""
    loaded = _load()
    if loaded is None:
        raise RuntimeError(f"the CPU kernels' extension is not available ({LIBRARY} not built, or not loadable)")
    return loaded

"""The benchmarks, grouped by what they measure (benchmark/README.md, "Scripts"). Every script runs by its path,
`python benchmark/FOLDER/SCRIPT.py`, and first puts the checkout on sys.path, so the shared helpers import as
`benchmark.common`, `benchmark.harness`, `benchmark.machine_bounds`, and opt_serving is this checkout's."""
try:  # opt_serving's OpenMP settings before any script's torch: its libgomp, which our kernels share, reads them once
    import opt_serving  # noqa: F401
except ImportError:  # (a peer-only script run where opt_serving is not)
    pass

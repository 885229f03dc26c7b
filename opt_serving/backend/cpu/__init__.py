"""The CPU kernels (XLA FFI custom calls in opt_serving/csrc/, built into _cpu_kernels.so), by kind: `_lib` loads them,
`products` (matrix products on packed weights), `attention` (a decode step's attention), `head` (argmax and
the screened greedy head), `norm` (layer norm). The `Backend` (opt_serving/backend) decides where they run."""

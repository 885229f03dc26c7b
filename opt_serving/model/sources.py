"""Where a model's tensors come from, one at a time, and the param tree built from them a piece at a time.

A source gives each checkpoint tensor (metaseq key, torch `[out, in]` layout) placed where it will live:
- `FolderSource`: the numpy folder, memory-mapped; each device copies only its own slice of each file.
- `RandomSource`: random weights drawn from a seed (`dummy=True`). Each tensor is drawn from a key of its own,
  derived from the seed and the tensor's name, with JAX's counter-based generator (threefry), each row and
  block of 32 columns from a key of its own (`Drawn`): a weight's numbers are a function of (seed, name, row,
  column) alone, so any subset of the model (a pipeline stage's layers, a tensor-parallel device's slice)
  draws the same numbers the whole model has, each device drawing only its own slice, a bounded chunk at a
  time. The same seed gives the same model whatever the plan. An embedding for one CPU device is drawn into a
  temporary file and mapped (`file_backed`), so that, as from a folder, only the rows looked up are read in.

`tree_parts` walks a model (or the subset `names`) in checkpoint order and yields its Flax tree a top-level
group at a time (the tensors outside the layers, then one layer after another), so a caller can put each
group in its runtime layout and drop it before the next is read (model/layout.py: load_runtime_params): a
process then holds its runtime params plus one layer, never its share twice.
"""
from __future__ import annotations

import functools
import mmap
import os
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.model import quantize as quantization
from opt_serving.model import weights

# where a Flax-tree path goes: a Sharding (a device, a mesh's split), or None for the default device
ShardingOf = Callable[[tuple], Optional[jax.sharding.Sharding]]

DUMMY_STD = 0.02  # OPT's own init scale for its weights


class FolderSource:
    """A numpy folder's tensors, memory-mapped (`quantize="int8"`: its weights as int8, read as they are from
    a quantized folder or quantized a block of rows at a time from a float one)."""

    def __init__(self, folder: str | os.PathLike, quantize: Optional[str] = None):
        self.folder = Path(folder)
        self.quantize = quantization.check_choice(quantize)
        self._on_disk: Optional[str] = None  # read where the tensors are read (a stage's node), not where made

    @property
    def on_disk(self) -> Optional[str]:
        """The folder's own quantization: "int8" for a quantized folder, None for a float one."""
        if self._on_disk is None:
            self._on_disk = quantization.folder_quantization(self.folder) or ""
        return self._on_disk or None

    def __repr__(self) -> str:
        return f"FolderSource({str(self.folder)!r})"

    def place(self, name: str, shape, sharding, dtype) -> jax.Array:
        """The tensor in the Flax layout ([in, out] for kernels), on `sharding`: each device copies its slice
        of the memory-mapped file (a transposed view), so no host copy of the whole tensor is made."""
        _, transpose = weights.flax_path(name)
        if self.on_disk and not self.quantize:
            raise ValueError(f"{self.folder} holds int8 weights: load it with quantize='int8' (--quantize int8)")
        src = weights.load_checked(self.folder, name, shape)
        host = src.T if transpose else src
        return put(host, sharding, dtype)

    def int8(self, name: str, shape) -> tuple[np.ndarray, np.ndarray]:
        return quantization.load_weight(self.folder, name, shape, bool(self.on_disk))


class RandomSource:
    """Random weights from `seed` (see the module docstring): normal(0, std) matrices (the embeddings among
    them), zero biases, unit layer-norm weights."""

    def __init__(self, seed: int = 0, std: float = DUMMY_STD):
        self.seed, self.std = int(seed), float(std)

    def __repr__(self) -> str:
        return f"RandomSource(seed={self.seed}, std={self.std})"

    def place(self, name: str, shape, sharding, dtype) -> jax.Array:
        """The tensor in the Flax layout, on `sharding`: each device draws only the rows (and blocks of
        columns) of its own slice, a bounded chunk at a time."""
        _, transpose = weights.flax_path(name)
        shape = tuple(shape)
        flax_shape = shape[::-1] if transpose else shape
        np_dtype = np.dtype(jnp.dtype(dtype))
        constant = constant_value(name)
        if constant is not None:
            return put(np.full(flax_shape, constant, np_dtype), sharding, dtype)
        drawn = Drawn(tensor_key(self.seed, name), shape, self.std, np_dtype)
        if not transpose and drawn.nbytes >= FILE_BACKED_BYTES and _one_cpu(sharding):
            return put(file_backed(drawn), sharding, dtype)

        def piece(idx):  # idx: the device's slice of the Flax-layout array
            rows, cols = (idx[1], idx[0]) if transpose else (idx[0], idx[1])
            block = drawn[rows, cols]
            return np.ascontiguousarray(block.T) if transpose else block
        if sharding is None:
            return jax.device_put(piece((slice(None), slice(None))))
        return jax.make_array_from_callback(flax_shape, sharding, piece)

    def host(self, name: str, shape) -> np.ndarray:
        """The tensor in the checkpoint layout as float32 numpy, whole."""
        constant = constant_value(name)
        if constant is not None:
            return np.full(shape, constant, np.float32)
        return Drawn(tensor_key(self.seed, name), tuple(shape), self.std)[:, :]

    def int8(self, name: str, shape) -> tuple[np.ndarray, np.ndarray]:
        """The weight quantized as model/quantize.py quantizes a float model, drawn a block of rows at a time
        (a row's scale needs all of the row): never the float tensor whole."""
        return quantization.quantize_rows(Drawn(tensor_key(self.seed, name), tuple(shape), self.std))


def constant_value(name: str) -> Optional[float]:
    """Biases are zero and layer-norm weights one in a random model; None for a drawn tensor."""
    if name.endswith(".bias"):
        return 0.0
    if name.endswith("layer_norm.weight"):
        return 1.0
    return None


def tensor_key(seed: int, name: str) -> jax.Array:
    """The key a random tensor is drawn from: the seed's, folded with the name's CRC-32 (the same in every
    process, unlike Python's hash)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), np.uint32(zlib.crc32(name.encode())))


# A random matrix [R, C] (checkpoint layout) is drawn as blocks: element (r, c) is entry c % COLUMN_BLOCK of
# normal(fold_in(fold_in(tensor key, r), c // COLUMN_BLOCK), (COLUMN_BLOCK,)). Any rectangle is then drawn by
# itself, a bounded chunk of rows at a time (a whole-tensor draw needed three times the tensor in temporaries:
# 2.5 GB for OPT-6.7B's embedding), and a tensor-parallel device splitting the columns draws only the blocks
# of its own (the split is a multiple of 32 columns in every OPT size at tp <= 8).
COLUMN_BLOCK = 32
CHUNK_ELEMENTS = 1 << 20  # drawn per call


# A drawn matrix kept as it is drawn (not transposed: the embeddings), of at least this many bytes, going to one
# CPU device, is drawn into a temporary file and memory-mapped, as a folder's file is: XLA's CPU client aliases
# the mapping, so only the pages read are resident (a pipeline's first stage looks up a few rows of the embedding
# a step; drawn into memory, all of OPT-1.3b's 0.41 GB float32 embedding was, where a folder's was not).
FILE_BACKED_BYTES = 16 << 20


def file_backed(drawn: "Drawn") -> np.ndarray:
    """The whole matrix, drawn a chunk of rows at a time into a file with no name (TMPDIR's, gone once the
    mapping is) and mapped read-only: written through the file, not the mapping, so none of it is this process's
    memory until read."""
    rows = max(1, CHUNK_ELEMENTS // drawn.shape[1])
    with tempfile.TemporaryFile() as f:  # (the mapping keeps its own handle on the file)
        for r in range(0, drawn.shape[0], rows):
            f.write(drawn[r:r + rows, :].tobytes())
        f.flush()
        mapped = mmap.mmap(f.fileno(), drawn.nbytes, prot=mmap.PROT_READ)
    mapped.madvise(mmap.MADV_RANDOM)  # rows are looked up here and there: no read-ahead around each
    return np.frombuffer(mapped, drawn.dtype).reshape(drawn.shape)


def _one_cpu(sharding) -> bool:
    """Does `sharding` (None: the default device) put the whole array on one CPU device?"""
    devices = [jax.devices()[0]] if sharding is None else list(sharding.device_set)
    return len(devices) == 1 and devices[0].platform == "cpu"


class Drawn:
    """A random matrix by rows and columns (see COLUMN_BLOCK), drawn only where indexed: `drawn[rows, cols]`
    (slices, step 1) -> numpy [rows, cols] in `dtype`. Indexing by a slice of rows alone takes whole rows (as
    quantize_rows reads a weight, a block of rows at a time)."""

    def __init__(self, key, shape: tuple, std: float, dtype=np.float32):
        if len(shape) != 2:
            raise ValueError(f"random matrices are 2-D, got shape {shape}")
        self.key, self.shape, self.std, self.dtype = key, tuple(shape), float(std), np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    def __getitem__(self, idx) -> np.ndarray:
        rows, cols = idx if isinstance(idx, tuple) else (idx, slice(None))
        r0, r1, rs = rows.indices(self.shape[0])
        c0, c1, cs = cols.indices(self.shape[1])
        if rs != 1 or cs != 1:
            raise IndexError("a random matrix is drawn by contiguous slices")
        b0, b1 = c0 // COLUMN_BLOCK, -(-c1 // COLUMN_BLOCK)
        out = np.empty((max(r1 - r0, 0), max(c1 - c0, 0)), self.dtype)
        if out.size == 0:
            return out
        n = max(1, CHUNK_ELEMENTS // ((b1 - b0) * COLUMN_BLOCK))
        fn = _draw_block_fn(n, b1 - b0, self.dtype.name)
        skip = c0 - b0 * COLUMN_BLOCK
        for r in range(r0, r1, n):
            block = np.asarray(fn(self.key, np.uint32(r), np.uint32(b0), np.float32(self.std)))
            take = min(n, r1 - r)
            out[r - r0:r - r0 + take] = block[:take, skip:skip + c1 - c0]
        return out


# A draw computes much for one small program: it is compiled at XLA's full optimization whatever XLA_FLAGS ask of
# other programs (the test suite compiles the rest at XLA's cheapest, where a model's draws ran several times slower)
_DRAW_COMPILE = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}


@functools.lru_cache(maxsize=64)
def _draw_block_fn(rows: int, blocks: int, dtype: str):
    """A jitted draw of `rows` rows from row r0, `blocks` column blocks from block b0 (see COLUMN_BLOCK):
    one compile per chunk shape and dtype, shared by every tensor of that width."""
    def draw(key, r0, b0, std):
        def block(r, b):
            return jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, r), b), (COLUMN_BLOCK,), jnp.float32)
        rs = r0 + jnp.arange(rows, dtype=jnp.uint32)
        bs = b0 + jnp.arange(blocks, dtype=jnp.uint32)
        x = jax.vmap(lambda r: jax.vmap(lambda b: block(r, b))(bs))(rs)  # [rows, blocks, COLUMN_BLOCK]
        return (x.reshape(rows, blocks * COLUMN_BLOCK) * std).astype(dtype)
    return jax.jit(draw, compiler_options=_DRAW_COMPILE)


def _transposed(host) -> bool:
    """Is `host` a numpy matrix whose transpose is contiguous (a transposed view of a file or an array)?"""
    return (isinstance(host, np.ndarray) and host.ndim == 2 and not host.flags.c_contiguous
            and host.T.flags.c_contiguous)


_transpose = jax.jit(jnp.transpose)


def put(host, sharding, dtype=None) -> jax.Array:
    """A host array (a memory-mapped view, a transposed view) on `sharding`, each device copying only its
    slice, cast to `dtype` as it is copied; None: the default device."""
    cast = np.dtype(jnp.dtype(dtype)) if dtype is not None else host.dtype
    if sharding is None:
        if _transposed(host):  # a checkpoint's [out, in] as [in, out]: copied as it lies, turned by XLA (tiled,
            return _transpose(jax.device_put(np.asarray(host.T, dtype=cast)))  # several times numpy's strided copy)
        return jax.device_put(np.ascontiguousarray(host, dtype=cast))
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda idx: np.ascontiguousarray(host[idx], dtype=cast))


def tree_parts(source, cfg, names: Optional[Iterable[str]] = None, sharding_of: Optional[ShardingOf] = None,
               dtype=jnp.float32, quantize: Optional[str] = None) -> Iterator[dict]:
    """The Flax param tree of `names` (default: the whole model) from `source`, a top-level group at a time:
    first the tensors outside the layers (one dict), then each layer's (`{"layers_i": ...}`), in the
    checkpoint's order. `sharding_of(path)`: where each array goes (default: this process's first device).
    `quantize="int8"`: model/quantize.py's tree (qkernel + scale; the tied head's int8 copy beside the
    embedding)."""
    quantize = quantization.check_choice(quantize)
    quantized = set(quantization.quantized_names(cfg)) if quantize else set()
    wanted = None if names is None else set(names)
    where = sharding_of or (lambda path: None)
    np_dtype = np.dtype(jnp.dtype(dtype))
    part: dict = {}
    group = None
    for name, shape in weights.param_shapes(cfg).items():
        if wanted is not None and name not in wanted:
            continue
        this = _group(name)
        if part and this != group:
            yield part
            part = {}
        group = this
        if name in quantized:
            for path, host in quantization.tree_entries(name, *source.int8(name, shape), np_dtype):
                weights.set_path(part, path, put(host, where(path)))
            continue
        path, _ = weights.flax_path(name)
        weights.set_path(part, path, source.place(name, shape, where(path), dtype))
    if part:
        yield part


def _group(name: str) -> str:
    """The top-level entry of the Flax tree a checkpoint tensor belongs to, for grouping: its layer, or
    "globals"."""
    return f"layers_{name.split('.')[2]}" if name.startswith(weights.LAYER_PREFIX.split("{")[0]) else "globals"


def merged(parts: Iterable[dict]) -> dict:
    tree: dict = {}
    for part in parts:
        tree.update(part)
    return tree


def save_random_folder(folder: str | os.PathLike, cfg, seed: int = 0, std: float = DUMMY_STD) -> Path:
    """Write RandomSource(seed, std)'s tensors as a float32 numpy folder (model/weights.py's layout), one tensor
    at a time, config.json last (a folder cut short is never taken for a whole one): it loads as the same
    model `dummy=True` draws from that seed (benchmarks of big models without downloads)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = RandomSource(seed, std)
    for name, shape in weights.param_shapes(cfg).items():
        weights.save_array(folder / name, source.host(name, shape))
    cfg.save_hf_json(folder)
    return folder

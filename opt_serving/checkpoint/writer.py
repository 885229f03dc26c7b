"""Streaming writer for the numpy folder: pieces of source tensors go straight to their place.

Each output file is created up front as an `.npy` header plus its full (sparse) size, then
filled piece by piece (pwrite for contiguous runs, a short-lived memmap for the column
blocks of row-parallel weights), so no parameter is ever assembled in memory. Work goes
into `<output>.partial/`; a unit (the globals, or one decoder layer) is marked done only
after all its files are complete, and the folder is renamed into place at the very end.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import torch

from opt_serving.config import OPTConfig
from opt_serving.checkpoint import layout
from opt_serving.checkpoint.formats import CheckpointError

DTYPES = {"float16": (torch.float16, np.dtype(np.float16), torch.int16),
          "float32": (torch.float32, np.dtype(np.float32), torch.int32),
          "bfloat16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16), torch.int16)}
# elements converted at a time: bounds the temporary copies whatever the layer size
CHUNK = 1 << 20
PROGRESS = ".progress"


class _Out:
    """One output .npy file being filled; tracks how many elements have arrived."""

    def __init__(self, path: Path, shape: tuple[int, ...], np_dtype: np.dtype):
        self.path, self.shape = path, tuple(shape)
        self.numel = int(np.prod(shape))
        self.itemsize = np_dtype.itemsize
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": np.lib.format.dtype_to_descr(np_dtype), "fortran_order": False,
                    "shape": self.shape})
            self.data_offset = f.tell()
            f.truncate(self.data_offset + self.numel * self.itemsize)
        self.fd = os.open(path, os.O_RDWR)
        self.written = 0
        self.verified = 0

    def write(self, elem_offset: int, raw: np.ndarray) -> None:
        buf = memoryview(np.ascontiguousarray(raw)).cast("B")
        pos = self.data_offset + elem_offset * self.itemsize
        while buf:  # pwrite may write less than asked (e.g. a nearly full disk)
            n = os.pwrite(self.fd, buf, pos)
            if n == 0:
                raise OSError(f"could not write to {self.path} (disk full?)")
            buf, pos = buf[n:], pos + n
        self.written += raw.size

    def read(self, elem_offset: int, n: int, raw_dtype) -> np.ndarray:
        data = os.pread(self.fd, n * self.itemsize, self.data_offset + elem_offset * self.itemsize)
        return np.frombuffer(data, dtype=raw_dtype)

    def write_cols(self, col0: int, local_cols: int, flat_offset: int, raw: np.ndarray) -> None:
        """Place local elements [flat_offset, +n) of a [rows, local_cols] block at column col0."""
        rows, cols = self.shape
        view = np.memmap(self.path, dtype=raw.dtype, mode="r+", offset=self.data_offset,
                         shape=(rows, cols))
        pos, n = flat_offset, raw.size
        done = 0
        while done < n:
            r, c = divmod(pos, local_cols)
            take = min(local_cols - c, n - done)
            if c == 0 and n - done >= local_cols:  # a run of whole rows in one assignment
                k = (n - done) // local_cols
                view[r:r + k, col0:col0 + local_cols] = raw[done:done + k * local_cols].reshape(k, local_cols)
                take = k * local_cols
            else:
                view[r, col0 + c:col0 + c + take] = raw[done:done + take]
            done += take
            pos += take
        # unmap now, so the dirty pages leave this process's RSS; no msync: the kernel
        # writes them back on its own schedule, as it does for pwrite
        del view
        self.written += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class UnitWriter:
    """Receives the pieces of one unit from every part and places them, Megatron-glued."""

    def __init__(self, folder: Path, cfg: OPTConfig, unit: str, num_parts: int, dtype: str):
        self.torch_dtype, self.np_dtype, self.raw_torch = DTYPES[dtype]
        self.num_parts = num_parts
        self.shapes = layout.unit_shapes(cfg, unit)
        self.outs = {k: _Out(folder / k, s, self.np_dtype) for k, s in self.shapes.items()}

    @property
    def bytes(self) -> int:
        return sum(o.written * o.itemsize for o in self.outs.values())

    def _raw(self, t: torch.Tensor) -> np.ndarray:
        # convert in torch (it knows bfloat16), then hand numpy the bits as integers
        return t.to(self.torch_dtype).contiguous().view(self.raw_torch).numpy()

    def put(self, key: str, part: int, offset: int, flat: torch.Tensor, source: Path,
            release: Callable[[], None] | None = None) -> None:
        """Local elements [offset, offset+len) of source `key` in model-parallel `part`.

        `release`, if given, is called after each chunk to drop the source's mapped pages,
        so even a whole-model singleton file never has more than a chunk resident."""
        for start in range(0, flat.numel(), CHUNK):
            raw = self._raw(flat[start:start + CHUNK])
            self._place(key, part, offset + start, raw, source)
            if release is not None:
                release()

    def _place(self, key, part, off, raw, source):
        r = layout.rule(key)
        if r == layout.QKV:
            names = layout.qkv_outputs(key)
            third = self.outs[names[0]].numel // self.num_parts
            done = 0
            while done < raw.size:  # a piece may straddle the K|V or V|Q boundary
                t, within = divmod(off + done, third)
                take = min(third - within, raw.size - done)
                self.outs[names[t]].write(part * third + within, raw[done:done + take])
                done += take
            return
        out = self.outs[key]
        if r == layout.ROWS:
            out.write(part * (out.numel // self.num_parts) + off, raw)
        elif r == layout.COLS:
            local_cols = out.shape[1] // self.num_parts
            out.write_cols(part * local_cols, local_cols, off, raw)
        elif part == 0:
            out.write(off, raw)
        else:  # replicated: every part must hold the same values as part 0
            if not np.array_equal(out.read(off, raw.size, raw.dtype), raw):
                raise CheckpointError(f"{source}: {key} differs from model-parallel part 0, "
                                      f"but Megatron replicates it (is this part from another model?)")
            out.verified += raw.size

    def close(self) -> None:
        for out in self.outs.values():
            out.close()

    def finish(self) -> None:
        self.close()
        for key, out in self.outs.items():
            want_verified = out.numel * (self.num_parts - 1) if layout.rule(key) == layout.REPLICATED else 0
            if out.written != out.numel or out.verified != want_verified:
                raise CheckpointError(f"{key}: received {out.written} of {out.numel} elements "
                                      f"from the inputs; the checkpoint is incomplete")


class OutputFolder:
    """`<output>.partial/` with per-unit done markers; renamed to `<output>` when complete."""

    def __init__(self, output: Path, fingerprint: dict, overwrite: bool = False):
        self.output = Path(output)
        if self.output.exists() and not overwrite:
            raise CheckpointError(f"output {self.output} already exists; pass --overwrite to replace it")
        self.tmp = self.output.with_name(self.output.name + ".partial")
        self.progress = self.tmp / PROGRESS
        stamp = self.progress / "source.json"
        self.resumed = False
        if self.tmp.exists():
            if stamp.exists() and json.loads(stamp.read_text()) == fingerprint:
                self.resumed = True
            else:  # left by a run on other inputs or settings: its layers are no use here
                shutil.rmtree(self.tmp)
        self.progress.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(fingerprint, indent=1, sort_keys=True))

    def done(self, unit: str) -> bool:
        return (self.progress / unit).exists()

    def mark_done(self, unit: str) -> None:
        (self.progress / unit).write_text("done\n")

    def commit(self, cfg: OPTConfig) -> None:
        cfg.save_hf_json(self.tmp / "config.json")
        shutil.rmtree(self.progress)
        if self.output.exists():
            shutil.rmtree(self.output)
        os.replace(self.tmp, self.output)

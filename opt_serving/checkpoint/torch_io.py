"""Opening .pt checkpoints safely and lazily.

`torch.load(mmap=True, weights_only=True)`: tensors stay on disk until touched, and
unpickling is limited to tensors, containers and the few config classes real metaseq
checkpoints hold. Touched pages of a memory map count towards this process's RSS until
unmapped, so after each layer `release()` tells the kernel to drop them (they are clean,
file-backed pages; a later read faults them back in from the file).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

from opt_serving.checkpoint.formats import CheckpointError

# what real OPT checkpoints pickle besides tensors: metaseq/fairseq configs are an
# argparse.Namespace (older ones) or plain dicts; shard metadata holds torch.Size.
torch.serialization.add_safe_globals([argparse.Namespace, torch.Size])

_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class MappedFile:
    """One loaded .pt file: `data` is the unpickled dict, its tensors memory-mapped."""

    def __init__(self, path: Path, data: dict, mapped: bool):
        self.path, self.data = path, data
        self._range = None
        if mapped and _libc is not None:
            spans = [(t.untyped_storage().data_ptr(),
                      t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                     for t in _tensors(data) if t.untyped_storage().nbytes()]
            if spans:
                self._range = _file_mapping(path, min(s for s, _ in spans), max(e for _, e in spans))

    def release(self) -> None:
        """Drop this file's resident pages from the process (Linux; no-op elsewhere)."""
        if self._range is not None:
            start, end = self._range
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _file_mapping(path: Path, lo: int, hi: int) -> tuple[int, int] | None:
    """The kernel's mapping of `path` that holds [lo, hi), from /proc/self/maps.

    Only such a mapping is ever madvised: dropping pages of anything else (heap memory)
    would destroy data, so when in doubt (no /proc, tensors outside the file) do nothing.
    """
    target = str(Path(path).resolve())
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= lo and hi <= end:
                return start, end
    return None


def load_pt(path: Path) -> MappedFile:
    """Memory-map one .pt file; a truncated, corrupt or unsafe file raises CheckpointError naming it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"missing checkpoint file {path}")
    mapped = True
    try:
        try:
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "_use_new_zipfile_serialization" not in str(e):
                raise
            # pre-1.6 torch.save format (old pytorch_model.bin): cannot be mapped, read it whole
            obj, mapped = torch.load(path, map_location="cpu", weights_only=True), False
    except Exception as e:  # zip, pickle and allow-list errors all mean: unusable file
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise CheckpointError(f"cannot read {path} (truncated or corrupt?): {first}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict checkpoint, found {type(obj).__name__}")
    return MappedFile(path, obj, mapped)

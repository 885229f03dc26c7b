"""md5 manifests in metaseq's format (`shard,md5sum` CSV, as opt175b_md5sum_shards.csv)."""
from __future__ import annotations

import csv
import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from opt_serving.checkpoint.formats import CheckpointError

_BLOCK = 1 << 24


def read_md5_csv(path: str | Path) -> dict[str, str]:
    """{file name: md5 hex} from a `shard,md5sum` CSV."""
    path = Path(path)
    try:
        rows = list(csv.reader(path.read_text().splitlines()))
    except FileNotFoundError:
        raise CheckpointError(f"md5 file {path} does not exist") from None
    if not rows or [c.strip() for c in rows[0]] != ["shard", "md5sum"]:
        raise CheckpointError(f"{path}: expected the header 'shard,md5sum'")
    sums = {}
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != 2 or len(row[1].strip()) != 32:
            raise CheckpointError(f"{path}:{lineno}: expected '<file name>,<32 hex digits>', got {row}")
        sums[row[0].strip()] = row[1].strip().lower()
    return sums


def md5_of(path: Path, progress: tqdm | None = None) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)  # hashlib drops the GIL on large blocks, so threads overlap
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


def verify(files: list[Path], csv_path: str | Path, workers: int = 4) -> None:
    """Every input is listed with a matching md5 and every listed file is present."""
    sums = read_md5_csv(csv_path)
    names = {f.name: f for f in files}
    for name in sums:
        if name not in names:
            folder = files[0].parent if files else Path(".")
            raise CheckpointError(f"missing {folder / name}: listed in {csv_path} but not among the inputs")
    for f in files:
        if f.name not in sums:
            raise CheckpointError(f"{f} is not listed in {csv_path}")
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="md5") as bar, \
            ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda f: md5_of(f, bar), files))
    for f, got in zip(files, digests):
        if got != sums[f.name]:
            raise CheckpointError(f"md5 mismatch for {f}: {got}, expected {sums[f.name]} "
                                  f"(corrupt or incomplete download)")


def write_md5_csv(files: list[Path], csv_path: str | Path) -> None:
    """The manifest for `files`, in the same format (lexical order, as metaseq's)."""
    lines = ["shard,md5sum"] + [f"{f.name},{md5_of(f)}" for f in sorted(files, key=lambda f: f.name)]
    Path(csv_path).write_text("\n".join(lines) + "\n")

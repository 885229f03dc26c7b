"""Checkpoint -> numpy folder, one unit (the globals, then each decoder layer) at a time.

Order of work: detect the format, verify md5s, open and check every input (keys, shapes,
shard metadata, padding), then stream unit by unit into `<output>.partial/`, skipping
units a previous interrupted run finished, and rename into place at the end.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from opt_serving.config import OPTConfig, get_config
from opt_serving.checkpoint import layout, md5
from opt_serving.checkpoint.formats import CheckpointError, Detected, detect
from opt_serving.checkpoint.hf import HfReader
from opt_serving.checkpoint.metaseq import FsdpReader, UnflattenedReader
from opt_serving.checkpoint.tokenizer import copy_tokenizer, tokenizer_files
from opt_serving.checkpoint.writer import DTYPES, OutputFolder, UnitWriter
from opt_serving.model import quantize as quantization

READERS = {"metaseq-fsdp": FsdpReader, "metaseq-mp-parts": UnflattenedReader,
           "metaseq-singleton": UnflattenedReader, "hf": HfReader}


@dataclasses.dataclass
class ConvertResult:
    output: Path
    config: OPTConfig
    format: str
    units_converted: int
    units_skipped: int
    bytes_written: int
    seconds: float


def open_reader(detected: Detected, override: OPTConfig | None = None):
    return READERS[detected.format](detected, override)


def _override(config: str | None) -> OPTConfig | None:
    """--config: a preset name ('175b', 'opt-2.7b') or a config.json path."""
    if config is None:
        return None
    if Path(config).exists():
        return OPTConfig.from_hf_json(config)
    try:
        return get_config(config)
    except ValueError as e:
        raise CheckpointError(f"--config {config!r}: neither a file nor a preset ({e})") from None


def convert(input: str | Path, output: str | Path, format: str = "auto", dtype: str = "float16",
            md5_csv: str | Path | None = None, tokenizer: str | Path | None = None,
            config: str | None = None, overwrite: bool = False, quantize: str | None = None,
            log: Callable[[str], None] = print, progress: bool = True) -> ConvertResult:
    """Convert a checkpoint to the numpy folder at `output`; raises CheckpointError on bad input.
    `quantize="int8"`: every weight matrix stored as int8 with a scale per output channel
    (model/quantize.py), each unit quantized before it counts as done."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    try:
        quantize = quantization.check_choice(quantize)
    except ValueError as e:
        raise CheckpointError(f"--quantize: {e}") from None
    t0 = time.perf_counter()
    detected = detect(str(input), format)
    log(f"found {detected.describe()}")
    if tokenizer is not None:
        tokenizer_files(tokenizer)  # fail now, not after hours of conversion
    if md5_csv is not None:
        md5.verify(detected.all_files, md5_csv)
        log(f"md5 verified for {len(detected.all_files)} file(s) against {md5_csv}")
    reader = open_reader(detected, _override(config))
    if getattr(reader, "note", None):
        log(reader.note)
    cfg = reader.config
    log(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
        f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}, {cfg.num_params() / 1e6:.1f}M parameters -> {dtype}")
    fingerprint = {"format": detected.format, "dtype": dtype, "quantize": quantize, "config": cfg.to_hf_dict(),
                   "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                             for f in detected.all_files]}
    folder = OutputFolder(Path(output), fingerprint, overwrite)
    todo = [u for u in layout.units(cfg) if not folder.done(u)]
    if folder.resumed:
        log(f"resuming {folder.tmp}: {len(layout.units(cfg)) - len(todo)} unit(s) already done")
    written = 0
    quantized = set(quantization.quantized_names(cfg)) if quantize else set()
    for unit in tqdm(todo, desc="convert", unit="layer", disable=not progress):
        writer = UnitWriter(folder.tmp, cfg, unit, reader.num_parts, dtype)
        try:
            reader.read_unit(unit, writer)
        finally:
            reader.release()
            writer.close()
        writer.finish()
        if quantize:
            for name in sorted(set(layout.unit_shapes(cfg, unit)) & quantized):
                quantization.quantize_file(folder.tmp, name)
        folder.mark_done(unit)
        written += writer.bytes
    if tokenizer is not None:
        copy_tokenizer(tokenizer, folder.tmp)
    if quantize:
        quantization.write_marker(folder.tmp)
    folder.commit(cfg)
    seconds = time.perf_counter() - t0
    log(f"wrote {folder.output} ({written / 1e6:.1f} MB in {seconds:.1f} s)")
    return ConvertResult(folder.output, cfg, detected.format, len(todo),
                         len(layout.units(cfg)) - len(todo), written, seconds)

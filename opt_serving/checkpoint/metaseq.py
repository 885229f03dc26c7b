"""Readers for metaseq checkpoints: raw FSDP shards and unflattened (resharded / singleton) files.

Raw shards follow fairscale's FullyShardedDataParallel: each FSDP instance (the root and
every decoder layer) concatenates its parameters into one flat tensor, pads it to a
multiple of the world size S, and shard s keeps the contiguous chunk
[s*c, (s+1)*c) with c = ceil(n/S). `shard_metadata` lists names/shapes/numels per flat
parameter and the padding at the end of this shard's chunk (a trailing shard may be all
padding). Everything is checked when the files are opened, before anything is written.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from opt_serving.config import OPTConfig
from opt_serving.checkpoint import layout
from opt_serving.checkpoint.formats import CheckpointError, Detected
from opt_serving.checkpoint.torch_io import MappedFile, load_pt


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_against_expected(cfg: OPTConfig, num_parts: int, fused: bool,
                            shapes: dict[str, tuple[int, ...]], where: dict[str, Path],
                            part_files: list[Path], part: int) -> None:
    """Every expected key present with the right shape, and nothing else."""
    expected = layout.expected_local_shapes(cfg, num_parts, fused)
    for key, shape in shapes.items():
        if layout.IGNORED_KEYS.search(key):
            continue
        if key not in expected:
            raise CheckpointError(f"{where[key]}: unexpected key {key} for this OPT model")
        if tuple(shape) != expected[key]:
            raise CheckpointError(f"{where[key]}: shape mismatch for {key}: the file has {tuple(shape)}, "
                                  f"an OPT model of this config split over {num_parts} part(s) "
                                  f"needs {expected[key]}")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        names = ", ".join(str(f) for f in part_files[:3]) + (" ..." if len(part_files) > 3 else "")
        raise CheckpointError(f"model-parallel part {part} ({names}) lacks {len(missing)} "
                              f"parameter(s), e.g. {missing[0]}")


def _check_parallel_sizes(ckpt: dict, path: Path, num_parts: int, num_shards: int | None) -> None:
    cfg = ckpt.get("cfg")
    mp = layout._get(layout._get(cfg, "common"), "model_parallel_size")
    if mp is not None and int(mp) != num_parts:
        raise CheckpointError(f"{path}: cfg says model_parallel_size {mp} but {num_parts} part(s) "
                              f"were found; is a model_part missing?")
    world = layout._get(layout._get(cfg, "distributed_training"), "distributed_world_size")
    if num_shards is not None and world is not None and int(world) != num_parts * num_shards:
        hint = ""
        want = int(world) // num_parts
        if want > num_shards:  # the missing files are the trailing shards of every part
            hint = f"; missing e.g. {path.parent / path.name.replace(f'-shard0.', f'-shard{num_shards}.')}"
        raise CheckpointError(f"{path}: cfg says distributed_world_size {world} = parts x shards, "
                              f"but {num_parts} x {num_shards} files were found{hint}")


def _glued_singleton(ckpt: dict, path: Path, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """A singleton file whose cfg names more model-parallel parts than one: metaseq's convert_to_singleton
    glues the parts but copies cfg from part 0, so restored.pt still says model_parallel_size 8. The
    attention projection's rows tell the two apart: all the heads (glued) or 1/mp of them (one part).
    Returns what was detected, None when the cfg says one part (or nothing)."""
    mp = layout._get(layout._get(ckpt.get("cfg"), "common"), "model_parallel_size")
    if mp is None or int(mp) == 1:
        return None
    hidden = shapes.get("decoder.embed_positions.weight", (0, 0))[1]
    q = shapes.get("decoder.layers.0.self_attn.q_proj.weight")
    qkv = shapes.get("decoder.layers.0.self_attn.qkv_proj.weight")
    rows = q[0] if q is not None else (qkv[0] // 3 if qkv is not None else None)
    if rows == hidden:
        return (f"{path}: cfg says model_parallel_size {mp} but the tensors are full-size: a glued singleton "
                f"(metaseq's convert_to_singleton keeps part 0's cfg); converting it as one part")
    raise CheckpointError(f"{path}: cfg says model_parallel_size {mp} and its attention holds {rows} of "
                          f"{hidden} rows: this is one model-parallel part; pass all {mp} parts "
                          f"(*-model_part-N.pt) or a glued singleton")


class FlatParam:
    """One FSDP flat parameter (the same in every shard of a part) and where its members lie."""

    def __init__(self, key: str, members: list[tuple[str, tuple[int, ...], int]]):
        self.key, self.members = key, members  # members: (metaseq name, local shape, numel)
        self.numel = sum(n for _, _, n in members)

    def signature(self):
        return self.key, tuple((n, s, k) for n, s, k in self.members)


def _flat_params(meta: dict, path: Path) -> list[FlatParam]:
    try:
        flats = []
        for entry in meta["param_metadata"]:
            prefix = entry["fsdp_path"]
            for backing, v in entry["params"].items():
                members = [(_join(prefix, n), tuple(int(d) for d in s), int(k))
                           for n, s, k in zip(v["names"], v["shapes"], v["numels"], strict=True)]
                for n, s, k in members:
                    if math.prod(s) != k:
                        raise CheckpointError(f"{path}: shard_metadata gives {n} shape {s} but numel {k}")
                flats.append(FlatParam(_join(prefix, backing), members))
        return flats
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed shard_metadata ({type(e).__name__}: {e})") from None


def _paddings(meta: dict) -> dict[str, int]:
    return {_join(e["fsdp_path"], b): int(v["padding"])
            for e in meta["param_metadata"] for b, v in e["params"].items()}


class FsdpReader:
    """P model-parallel parts x S FSDP shards, all memory-mapped once and read layer by layer."""

    def __init__(self, detected: Detected, override: OPTConfig | None = None):
        self.files = detected.all_files
        self.num_parts, self.num_shards = len(detected.files), len(detected.files[0])
        S = self.num_shards
        self.shards: list[list[MappedFile]] = []
        self.flats: list[list[FlatParam]] = []
        first = None
        for p, paths in enumerate(detected.files):
            loaded, ref = [], None
            for s, path in enumerate(paths):
                mf = load_pt(path)
                loaded.append(mf)
                data = mf.data
                if "model" not in data or "shard_metadata" not in data:
                    raise CheckpointError(f"{path}: not an FSDP shard (needs 'model' and 'shard_metadata', "
                                          f"has {sorted(data)})")
                if first is None:
                    first = mf
                    _check_parallel_sizes(data, path, self.num_parts, S)
                elif layout.architecture_signature(data) != layout.architecture_signature(first.data):
                    raise CheckpointError(f"{path}: its cfg describes a different model from {first.path} "
                                          f"(a shard of another model mixed in?)")
                flats = _flat_params(data["shard_metadata"], path)
                if ref is None:
                    ref = flats
                elif [f.signature() for f in flats] != [f.signature() for f in ref]:
                    raise CheckpointError(f"{path}: its shard_metadata lists different parameters from "
                                          f"{paths[0]} (a shard of another model mixed in?)")
                self._check_shard(mf, s, flats)
                if mf is not first:  # checked; 992 copies of the metadata would cost ~200 MB
                    data.pop("shard_metadata")
                    data.pop("cfg", None)
            self.shards.append(loaded)
            self.flats.append(ref)

        local = {m[0]: m[1] for f in self.flats[0] for m in f.members}
        self.config = layout.config_from_metaseq(first.data, local, self.num_parts, str(first.path), override)
        layout.check_divisible(self.config, self.num_parts, str(first.path))
        for p in range(self.num_parts):
            shapes = {m[0]: m[1] for f in self.flats[p] for m in f.members}
            where = {k: detected.files[p][0] for k in shapes}
            fused = any(".qkv_proj." in k for k in shapes)
            _check_against_expected(self.config, self.num_parts, fused, shapes, where, detected.files[p], p)

    def _check_shard(self, mf: MappedFile, s: int, flats: list[FlatParam]) -> None:
        try:
            model, pads = mf.data["model"], _paddings(mf.data["shard_metadata"])
            buffers = set(mf.data["shard_metadata"].get("buffer_names", []))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{mf.path}: malformed shard_metadata ({type(e).__name__}: {e})") from None
        for flat in flats:
            t = model.get(flat.key)
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{mf.path}: missing flat parameter {flat.key}")
            chunk = -(-flat.numel // self.num_shards)
            valid = max(0, min(chunk, flat.numel - s * chunk))
            if t.dim() != 1 or t.numel() != chunk:
                raise CheckpointError(f"{mf.path}: {flat.key} has shape {tuple(t.shape)}; shard {s} of "
                                      f"{self.num_shards} of {flat.numel} elements should hold ({chunk},) "
                                      f"(is a shard missing, or from another model?)")
            if pads[flat.key] != chunk - valid:
                raise CheckpointError(f"{mf.path}: {flat.key} padding is {pads[flat.key]}, expected "
                                      f"{chunk - valid} for shard {s} of {self.num_shards} "
                                      f"(is a shard missing, or from another model?)")
        known = {f.key for f in flats} | buffers
        for key in model:
            if key not in known and not layout.IGNORED_KEYS.search(key):
                raise CheckpointError(f"{mf.path}: unexpected key {key} in 'model'")

    def read_unit(self, unit: str, writer) -> None:
        for p in range(self.num_parts):
            for s, mf in enumerate(self.shards[p]):
                model = mf.data["model"]
                for flat in self.flats[p]:
                    chunk = -(-flat.numel // self.num_shards)
                    lo_shard = s * chunk
                    hi_shard = min(lo_shard + chunk, flat.numel)
                    start = 0
                    for name, _, numel in flat.members:
                        lo, hi = max(start, lo_shard), min(start + numel, hi_shard)
                        if lo < hi and layout.unit_of(name) == unit and not layout.IGNORED_KEYS.search(name):
                            piece = model[flat.key][lo - lo_shard:hi - lo_shard]
                            writer.put(name, p, lo - start, piece, mf.path)
                        start += numel
                mf.release()  # only about one shard's slice of this layer is ever resident

    def release(self) -> None:
        for part in self.shards:
            for mf in part:
                mf.release()


class UnflattenedReader:
    """`reshard-model_part-{p}.pt` parts (fused qkv) or one singleton file (e.g. `restored.pt`)."""

    def __init__(self, detected: Detected, override: OPTConfig | None = None):
        self.files = detected.all_files
        self.num_parts = len(detected.files)
        self.parts: list[MappedFile] = []
        for p, (path,) in enumerate(detected.files):
            mf = load_pt(path)
            model = mf.data.get("model", mf.data)
            bad = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise CheckpointError(f"{path}: not a state dict: {bad[0]!r} is a "
                                      f"{type(model[bad[0]]).__name__}, not a tensor")
            if self.parts and (layout.architecture_signature(mf.data)
                               != layout.architecture_signature(self.parts[0].data)):
                raise CheckpointError(f"{path}: its cfg describes a different model from {self.parts[0].path}")
            self.parts.append(mf)
        first = self.parts[0]
        shapes0 = {k: tuple(v.shape) for k, v in self._model(0).items()}
        self.note = None  # what the reader found beyond the format (convert logs it)
        if self.num_parts == 1:  # the shapes, not the copied cfg, tell a glued singleton from one part
            self.note = _glued_singleton(first.data, first.path, shapes0)
        else:
            _check_parallel_sizes(first.data, first.path, self.num_parts, None)
        self.config = layout.config_from_metaseq(first.data, shapes0, self.num_parts, str(first.path), override)
        layout.check_divisible(self.config, self.num_parts, str(first.path))
        for p, mf in enumerate(self.parts):
            shapes = {k: tuple(v.shape) for k, v in self._model(p).items()}
            fused = any(".qkv_proj." in k for k in shapes)
            _check_against_expected(self.config, self.num_parts, fused, shapes,
                                    {k: mf.path for k in shapes}, [mf.path], p)

    def _model(self, p: int) -> dict:
        data = self.parts[p].data
        return data.get("model", data)

    def read_unit(self, unit: str, writer) -> None:
        for p, mf in enumerate(self.parts):
            for key, t in self._model(p).items():
                if layout.unit_of(key) == unit and not layout.IGNORED_KEYS.search(key):
                    writer.put(key, p, 0, t.reshape(-1), mf.path, release=mf.release)

    def release(self) -> None:
        for mf in self.parts:
            mf.release()

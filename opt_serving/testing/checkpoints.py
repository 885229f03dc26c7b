"""Tiny random OPT models written in every on-disk format the converter reads.

The reference is always a `transformers.OPTForCausalLM`; `metaseq_state_dict` renames
its parameters to metaseq keys, and the writers lay them out as metaseq/Megatron/fairscale
did (see opt_serving/checkpoint/metaseq.py for the format facts). Configs are saved as
plain dicts holding an argparse.Namespace, as real OPT checkpoints do.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from opt_serving.config import OPTConfig

_HF_TO_METASEQ = (("decoder.project_in.", "decoder.project_in_dim."),
                  ("decoder.project_out.", "decoder.project_out_dim."),
                  ("decoder.final_layer_norm.", "decoder.layer_norm."))


def tiny_config(hidden: int = 32, layers: int = 2, heads: int = 4, vocab: int = 96, ffn: int | None = None,
                max_positions: int = 64, word_embed_proj_dim: int | None = None,
                pre_ln: bool = True) -> OPTConfig:
    return OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, ffn_dim=ffn or 4 * hidden,
                     max_position_embeddings=max_positions,
                     word_embed_proj_dim=word_embed_proj_dim or hidden, do_layer_norm_before=pre_ln)


def random_hf_model(cfg: OPTConfig, seed: int = 0, dtype=torch.float16):
    """OPTForCausalLM with every parameter random (layer norms and biases too, so each one is tested)."""
    import transformers

    hf_cfg = transformers.OPTConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                       if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.to(dtype)


def metaseq_state_dict(model) -> dict[str, torch.Tensor]:
    """The HF model's parameters under metaseq keys (separate q/k/v), as a singleton holds them."""
    out = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        key = key.removeprefix("model.")
        for hf, ms in _HF_TO_METASEQ:
            if key.startswith(hf):
                key = ms + key[len(hf):]
        out[key] = t.detach().clone()
    return out


def metaseq_cfg(cfg: OPTConfig, parts: int = 1, shards: int | None = None) -> dict:
    """cfg as metaseq stores it: sections of a dict, the model section an argparse.Namespace."""
    model = argparse.Namespace(
        arch="transformer_lm_megatron", decoder_layers=cfg.num_hidden_layers,
        decoder_embed_dim=cfg.hidden_size, decoder_attention_heads=cfg.num_attention_heads,
        decoder_ffn_embed_dim=cfg.ffn_dim, decoder_input_dim=cfg.word_embed_proj_dim,
        decoder_output_dim=cfg.word_embed_proj_dim, max_target_positions=cfg.max_position_embeddings,
        decoder_normalize_before=cfg.do_layer_norm_before, decoder_learned_pos=True,
        share_decoder_input_output_embed=True, activation_fn="relu")
    out = {"model": model, "common": {"model_parallel_size": parts, "fp16": True}}
    if shards is not None:
        out["distributed_training"] = {"distributed_world_size": parts * shards}
    return out


# ---- Megatron model-parallel split ----

def _split(t: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    return [c.clone() for c in torch.chunk(t, parts, dim=dim)]


def megatron_parts(sd: dict[str, torch.Tensor], parts: int, fuse_qkv: bool = True) -> list[dict]:
    """Split a metaseq state dict as Megatron laid it out over `parts` model-parallel ranks."""
    out: list[dict] = [{} for _ in range(parts)]
    for key, t in sd.items():
        if key == "decoder.embed_tokens.weight" or any(
                f".{n}." in key for n in ("q_proj", "k_proj", "v_proj", "fc1")):
            pieces = _split(t, parts, 0)
        elif key.endswith(("out_proj.weight", "fc2.weight")):
            pieces = _split(t, parts, 1)
        else:  # out_proj/fc2 biases, positions, layer norms, project_in/out: replicated
            pieces = [t.clone() for _ in range(parts)]
        for p in range(parts):
            out[p][key] = pieces[p]
    if fuse_qkv:
        for part in out:
            for key in [k for k in part if ".q_proj." in k]:
                k_key, v_key = key.replace(".q_proj.", ".k_proj."), key.replace(".q_proj.", ".v_proj.")
                # the per-part fused projection is [K_p; V_p; Q_p]
                part[key.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                    [part.pop(k_key), part.pop(v_key), part.pop(key)], dim=0)
    return out


def _ordered(part: dict, prefix: str) -> list[str]:
    """Parameter order inside one FSDP flat param: module registration order in metaseq."""
    if prefix == "":
        order = ["decoder.embed_tokens.weight", "decoder.project_in_dim.weight",
                 "decoder.embed_positions.weight", "decoder.layer_norm.weight", "decoder.layer_norm.bias",
                 "decoder.project_out_dim.weight"]
        return [k for k in order if k in part]
    order = ["self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias",
             "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
             "self_attn.v_proj.bias", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
             "self_attn.out_proj.weight", "self_attn.out_proj.bias", "self_attn_layer_norm.weight",
             "self_attn_layer_norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
             "final_layer_norm.weight", "final_layer_norm.bias"]
    return [f"{prefix}.{k}" for k in order if f"{prefix}.{k}" in part]


def fsdp_shard_dicts(part: dict[str, torch.Tensor], num_layers: int, shards: int, cfg: dict) -> list[dict]:
    """One model-parallel part flattened and sharded as fairscale FSDP saved it (local_state_dict)."""
    out = [{"model": {}, "shard_metadata": {"param_metadata": [], "buffer_names": ["decoder.version"]},
            "cfg": cfg} for _ in range(shards)]
    for fsdp_path in [""] + [f"decoder.layers.{i}" for i in range(num_layers)]:
        names = _ordered(part, fsdp_path)
        flat = torch.cat([part[n].reshape(-1) for n in names])
        chunk = math.ceil(flat.numel() / shards)  # torch.chunk's size: trailing shards may be empty
        rel = [n[len(fsdp_path) + 1:] if fsdp_path else n for n in names]
        for s in range(shards):
            piece = flat[s * chunk:(s + 1) * chunk]
            pad = chunk - piece.numel()
            out[s]["model"][f"{fsdp_path}.flat_param_0" if fsdp_path else "flat_param_0"] = \
                torch.cat([piece, piece.new_zeros(pad)])
            out[s]["shard_metadata"]["param_metadata"].append({
                "fsdp_path": fsdp_path,
                "params": {"flat_param_0": {"names": rel, "shapes": [part[n].shape for n in names],
                                            "numels": [part[n].numel() for n in names], "padding": pad}},
                "no_broadcast_optim_state": False,
                "shared_param_info": ([("decoder.embed_tokens.weight", "decoder.output_projection.weight")]
                                      if fsdp_path == "" else []),
            })
    for s in range(shards):
        out[s]["model"]["decoder.version"] = torch.tensor([3.0])
    return out


def write_fsdp_shards(folder: str | Path, model, parts: int, shards: int,
                      prefix: str = "checkpoint_last") -> list[Path]:
    """`{prefix}-model_part-{p}-shard{s}.pt` for p < parts, s < shards; returns the files."""
    return write_fsdp_shards_from_state_dict(folder, metaseq_state_dict(model), _opt_config(model),
                                             parts, shards, prefix)


def random_metaseq_state_dict(cfg: OPTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp16 parameters of any size without building a model (for the memory benchmark)."""
    from opt_serving.model.weights import param_shapes
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=g) * 0.02).half() for k, s in param_shapes(cfg).items()}


def write_fsdp_shards_from_state_dict(folder: str | Path, sd: dict, cfg: OPTConfig, parts: int,
                                      shards: int, prefix: str = "checkpoint_last") -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for p, part in enumerate(megatron_parts(sd, parts, fuse_qkv=True)):
        for s, shard in enumerate(fsdp_shard_dicts(part, cfg.num_hidden_layers, shards,
                                                   metaseq_cfg(cfg, parts, shards))):
            path = folder / f"{prefix}-model_part-{p}-shard{s}.pt"
            torch.save(shard, path)
            files.append(path)
    return files


def write_reshard_parts(folder: str | Path, model, parts: int) -> list[Path]:
    """`reshard-model_part-{p}.pt`: unflattened per part, fused qkv (metaseq reshard_fsdp output)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _opt_config(model)
    files = []
    for p, part in enumerate(megatron_parts(metaseq_state_dict(model), parts, fuse_qkv=True)):
        part["decoder.version"] = torch.tensor([3.0])
        path = folder / f"reshard-model_part-{p}.pt"
        torch.save({"model": part, "cfg": metaseq_cfg(cfg, parts)}, path)
        files.append(path)
    return files


def write_singleton(path: str | Path, model, with_cfg: bool = True, cfg_parts: int = 1) -> Path:
    """A consolidated checkpoint (Alpa's `restored.pt`): one file, separate q/k/v. `cfg_parts`: the
    model_parallel_size its cfg names; metaseq's convert_to_singleton copies part 0's cfg, so a glued
    singleton of an 8-part model still says 8."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = metaseq_state_dict(model)
    sd["decoder.version"] = torch.tensor([3.0])
    data = {"model": sd}
    if with_cfg:
        data["cfg"] = metaseq_cfg(_opt_config(model), parts=cfg_parts)
    torch.save(data, path)
    return path


def write_hf(folder: str | Path, model, safetensors: bool = True) -> Path:
    """`save_pretrained` folder; with safetensors=False, a legacy `pytorch_model.bin` as the
    facebook/opt-* repos ship it (saved from OPTModel: no `model.` prefix, no lm_head)."""
    folder = Path(folder)
    if safetensors:
        model.save_pretrained(folder)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(folder / "config.json")
    sd = {k.removeprefix("model."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torch.save(sd, folder / "pytorch_model.bin")
    return folder


def _opt_config(model) -> OPTConfig:
    return OPTConfig.from_hf_dict(model.config.to_dict())


_MEASURE = r"""
import json, resource, sys, time
import psutil
from opt_serving.checkpoint.convert import convert
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
res = convert(sys.argv[1], sys.argv[2], log=lambda m: None, progress=False)
secs = time.perf_counter() - t0
try:  # VmHWM belongs to this program's memory map; ru_maxrss would also count the forking parent
    status = open("/proc/self/status").read()
    peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
except (OSError, IndexError):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
print(json.dumps({"baseline_rss": base, "peak_rss": peak, "seconds": secs, "bytes": res.bytes_written}))
"""


def measure_conversion(src: str | Path, out: str | Path) -> dict:
    """Convert in a fresh process; its RSS before converting (after imports), peak RSS, time, bytes."""
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(out)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"conversion failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])

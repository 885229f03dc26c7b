"""Peak memory and throughput of `opt-serving convert` on raw FSDP shards.

Writes a random model of a preset size (default OPT-125m) as P x S metaseq shards, converts
it in a fresh process, and prints that process's peak RSS next to the model's fp16 size.

    python benchmark/probes/convert_memory.py --size 125m --parts 2 --shards 8
    python benchmark/probes/convert_memory.py --format singleton   # or hf
"""
import argparse
import gc
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from opt_serving.config import get_config
from opt_serving.testing import checkpoints as ck


def hf_key_to_metaseq_inverse(key: str) -> str:
    return key.replace("decoder.layer_norm.", "decoder.final_layer_norm.").replace(
        "decoder.project_in_dim.", "decoder.project_in.").replace("decoder.project_out_dim.", "decoder.project_out.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="125m")
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--format", default="fsdp", choices=("fsdp", "singleton", "hf"))
    ap.add_argument("--workdir", help="where to write shards and output (default: a temporary folder)")
    args = ap.parse_args()

    cfg = get_config(args.size)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert_memory_"))
    (work / "ckpt").mkdir(parents=True, exist_ok=True)
    try:
        sd = ck.random_metaseq_state_dict(cfg)
        model_bytes = sum(t.numel() * 2 for t in sd.values())
        if args.format == "fsdp":
            ck.write_fsdp_shards_from_state_dict(work / "ckpt", sd, cfg, args.parts, args.shards)
            layout_desc = f"{args.parts} x {args.shards} FSDP shards"
        elif args.format == "singleton":
            torch.save({"model": sd, "cfg": ck.metaseq_cfg(cfg)}, work / "ckpt" / "restored.pt")
            layout_desc = "one restored.pt"
        else:
            save_file({"model." + hf_key_to_metaseq_inverse(k): v for k, v in sd.items()},
                      work / "ckpt" / "model.safetensors")
            cfg.save_hf_json(work / "ckpt" / "config.json")
            layout_desc = "a Hugging Face safetensors folder"
        del sd
        gc.collect()
        m = ck.measure_conversion(work / "ckpt", work / "np")
        mb = 1e6
        print(f"OPT-{args.size} as {layout_desc}, fp16 size {model_bytes / mb:.0f} MB")
        print(f"  peak RSS of the converting process: {m['peak_rss'] / mb:.0f} MB "
              f"({m['peak_rss'] / model_bytes:.2f} x model)")
        print(f"  RSS after imports (torch etc.):     {m['baseline_rss'] / mb:.0f} MB")
        print(f"  peak RSS above that baseline:       {(m['peak_rss'] - m['baseline_rss']) / mb:.0f} MB "
              f"({(m['peak_rss'] - m['baseline_rss']) / model_bytes:.2f} x model)")
        print(f"  conversion: {m['seconds']:.2f} s, {m['bytes'] / mb / m['seconds']:.0f} MB/s written")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

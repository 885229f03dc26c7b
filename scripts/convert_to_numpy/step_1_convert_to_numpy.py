"""Step 1: convert the checkpoint straight to the numpy folder (no consolidation step).

Alpa's recipe glued the 992 OPT-175B shards into one ~350 GB singleton first, needing
~700 GB of RAM; this streams one layer at a time from the shards instead. Same as
`opt-serving convert`:

    python scripts/convert_to_numpy/step_1_convert_to_numpy.py \
        --input 'PATH_TO_992_SHARDS/checkpoint_last-model_part-*-shard*.pt' --output opt-175b-np \
        [--md5 opt175b_md5sum_shards.csv] [--tokenizer DIR] [--dtype float16]
"""
import sys

from opt_serving.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["convert", *sys.argv[1:]]))

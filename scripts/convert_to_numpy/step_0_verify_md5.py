"""Step 0: check downloaded checkpoint files against metaseq's md5 list before converting.

    python scripts/convert_to_numpy/step_0_verify_md5.py --input PATH_TO_992_SHARDS/ \
        --md5 opt175b_md5sum_shards.csv
Exits non-zero naming the first missing, unlisted or corrupt file.
"""
import argparse
import sys

from opt_serving.checkpoint.formats import CheckpointError, detect
from opt_serving.checkpoint.md5 import verify


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="checkpoint folder, file or quoted glob")
    ap.add_argument("--md5", required=True, help="'shard,md5sum' CSV")
    ap.add_argument("--workers", type=int, default=4, help="files hashed in parallel")
    args = ap.parse_args()
    try:
        detected = detect(args.input)
        print(f"found {detected.describe()}", file=sys.stderr)
        verify(detected.all_files, args.md5, workers=args.workers)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"all {len(detected.all_files)} files match {args.md5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Step 2 (optional): check a numpy folder is complete and readable, and print its size.

    python scripts/convert_to_numpy/step_2_check_numpy.py opt-175b-np
Every parameter the folder's config.json implies must be present with the right shape;
each file is memory-mapped, so this is quick even for OPT-175B.
"""
import argparse
import sys

import numpy as np

from opt_serving.model.weights import load_numpy_folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--finite", action="store_true", help="also scan every value for NaN/inf (reads it all)")
    args = ap.parse_args()
    try:
        cfg, params = load_numpy_folder(args.folder)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, arr in params.items():
        if args.finite and not np.isfinite(np.asarray(arr, dtype=np.float32)).all():
            print(f"error: {args.folder}/{name} holds NaN or inf", file=sys.stderr)
            return 1
    nbytes = sum(a.nbytes for a in params.values())
    dtypes = sorted({str(a.dtype) for a in params.values()})
    print(f"{args.folder}: {len(params)} arrays, {cfg.num_params() / 1e9:.2f}B parameters, "
          f"{nbytes / 1e9:.2f} GB ({', '.join(dtypes)}), {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

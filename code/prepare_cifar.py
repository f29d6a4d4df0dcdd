"""Prepare CIFAR-10 once, before any training job: generate a stand-in offline, or download it.

    python code/prepare_cifar.py                         # generated, offline (the default here)
    python code/prepare_cifar.py --source download       # the real CIFAR-10 (163 MB, needs internet)
    python code/prepare_cifar.py --train-per-batch 200   # a smaller generated set

Both write ``<data-dir>/cifar-10-batches-py`` in CIFAR-10's on-disk format plus a manifest of
MD5 sums (``distlab-manifest.json``) that ``distlab.cifar.data.ManifestCIFAR10`` checks. A
generated stand-in is replaced by ``--source download`` without ``--force`` (nothing is lost);
any other set that differs from what is asked needs ``--force``. Run it on
the login node (or in a one-task job) before training: a download inside a distributed job would
have every rank fetch and write the same files at once.
"""

from __future__ import annotations

import argparse
import os
import sys

from distlab import REPO_ROOT
from distlab.cifar import data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--data-dir",
        default=os.environ.get("LAB_DATA", str(REPO_ROOT / "data")),
        help="cifar-10-batches-py is written inside it",
    )
    p.add_argument(
        "--source",
        choices=("generate", "download"),
        default="generate",
        help="generate: offline stand-in; download: the real CIFAR-10",
    )
    p.add_argument("--train-per-batch", type=int, default=600, help="generated images per data_batch_k (x5)")
    p.add_argument("--test", type=int, default=1000, help="generated test images")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated images")
    p.add_argument("--force", action="store_true", help="replace a set that is already there")
    args = p.parse_args(argv)
    if args.train_per_batch < 1 or args.test < 1:
        p.error(f"--train-per-batch {args.train_per_batch} and --test {args.test} must be >= 1")
    try:
        existing = data.read_manifest(args.data_dir)
    except data.DatasetMissing:
        existing = None
    upgrade = existing is not None and existing["source"] == "generated" and args.source == "download"
    if existing is not None and not args.force and not upgrade:  # the real set may replace a stand-in
        want = {"generated": "generate", "download": "download"}[existing["source"]]
        same = want == args.source and (
            args.source == "download"
            or (
                existing["num_train"] == 5 * args.train_per_batch
                and existing["num_test"] == args.test
                and existing.get("seed") == args.seed
            )
        )
        if not same:
            sys.exit(
                f"{data.describe(args.data_dir)} is already there and differs from what you ask: "
                "add --force to replace it"
            )
        print(f"already prepared: {data.describe(args.data_dir)}")
        return 0
    if args.source == "download":
        data.download(args.data_dir)
    else:
        data.generate(args.data_dir, train_per_batch=args.train_per_batch, test=args.test, seed=args.seed)
    print(f"prepared: {data.describe(args.data_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

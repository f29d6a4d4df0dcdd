"""CIFAR-10 on disk: a generated stand-in in the genuine format, or the real download.

Format (``cifar-10-batches-py``, as published by Krizhevsky): five training files
``data_batch_1..5`` and one ``test_batch``, each a pickled dict with

    data        uint8 array (N, 3072): N images, each 1024 red, 1024 green, 1024 blue bytes, row-major
    labels      list of N ints in [0, 10)
    filenames   list of N names
    batch_label str

plus ``batches.meta`` with ``label_names`` (10 strings). torchvision's ``CIFAR10`` reads exactly
that and checks each file against the genuine MD5 sums, so a generated set cannot pass it as is.
``ManifestCIFAR10`` is the thinnest subclass that swaps the genuine sums for the ones in the set's
own manifest (``distlab-manifest.json``, written by ``prepare``); decoding, ``data``/``targets``
and transforms stay torchvision's.

Generated classes: class k = (colour ``k % 5``, stripe orientation ``k // 5``) drawn with random
stripe frequency, phase, contrast, brightness and pixel noise. Colour and orientation both survive
the usual random crop and horizontal flip, so a small ResNet learns them in an epoch or two.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
from torchvision.datasets import CIFAR10

BASE_FOLDER = CIFAR10.base_folder  # "cifar-10-batches-py"
MANIFEST = "distlab-manifest.json"
TRAIN_FILES = [name for name, _ in CIFAR10.train_list]  # data_batch_1 .. data_batch_5
TEST_FILES = [name for name, _ in CIFAR10.test_list]  # test_batch
META_FILE = CIFAR10.meta["filename"]  # batches.meta

_COLOURS = {  # RGB of each class colour, 0..1
    "red": (0.9, 0.15, 0.1),
    "green": (0.1, 0.75, 0.2),
    "blue": (0.15, 0.25, 0.9),
    "yellow": (0.9, 0.85, 0.1),
    "magenta": (0.8, 0.1, 0.8),
}
GENERATED_CLASSES = [f"{c}-{o}" for o in ("horizontal", "vertical") for c in _COLOURS]


class DatasetMissing(FileNotFoundError):
    """No prepared dataset where the run looks for one."""


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dataset_dir(root: str | os.PathLike) -> Path:
    """``<root>/cifar-10-batches-py``."""
    return Path(root) / BASE_FOLDER


def read_manifest(root: str | os.PathLike) -> dict:
    """The manifest ``prepare`` wrote; raises ``DatasetMissing`` naming the command to run."""
    path = dataset_dir(root) / MANIFEST
    if not path.is_file():
        raise DatasetMissing(
            f"no prepared CIFAR-10 under {dataset_dir(root)} (missing {MANIFEST}). Prepare it once, "
            f"before any job, with:  python code/prepare_cifar.py --data-dir {root}  "
            "(add --source download on a machine with internet for the real dataset)"
        )
    return json.loads(path.read_text())


class ManifestCIFAR10(CIFAR10):
    """``torchvision.datasets.CIFAR10`` checked against the set's own manifest, never downloading.

    A drop-in: it takes exactly torchvision's arguments, so ``CIFAR10(root, train=True,
    download=True, transform=...)`` in a learner's script becomes ``ManifestCIFAR10(...)`` with
    nothing else changed. ``download`` does nothing: the set is prepared once, before any job
    (``python code/prepare_cifar.py``); without it the constructor raises :class:`DatasetMissing`
    naming that command. Only the three class attributes holding the genuine MD5 sums are
    replaced, per instance, before torchvision's constructor runs; everything else is torchvision's.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        train: bool = True,
        transform=None,
        target_transform=None,
        download: bool = False,  # accepted for torchvision's signature; ranks never download
    ):
        sums = read_manifest(root)["md5"]
        self.train_list = [[name, sums[name]] for name in TRAIN_FILES]
        self.test_list = [[name, sums[name]] for name in TEST_FILES]
        self.meta = {**CIFAR10.meta, "md5": sums[META_FILE]}
        super().__init__(root, train=train, transform=transform, target_transform=target_transform)


def synthesize(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images of the generated classes: ``(images (n, 32, 32, 3) uint8, labels (n,) int64)``."""
    labels = rng.integers(0, len(GENERATED_CLASSES), size=n)
    colour = np.array(list(_COLOURS.values()), dtype=np.float32)[labels % 5]  # (n, 3)
    vertical = (labels // 5).astype(bool)  # (n,)
    grid = np.arange(32, dtype=np.float32)
    cycles = rng.uniform(2.0, 6.0, size=(n, 1))  # stripes per image
    phase = rng.uniform(0, 2 * np.pi, size=(n, 1))
    wave = 0.5 + 0.5 * np.sin(2 * np.pi * cycles * grid / 32 + phase)  # (n, 32)
    stripes = np.where(vertical[:, None, None], wave[:, None, :], wave[:, :, None])  # (n, 32, 32)
    contrast = rng.uniform(0.25, 1.0, size=(n, 1, 1, 1))
    background = rng.uniform(0.1, 0.6, size=(n, 1, 1, 1))
    img = (
        background * (1 - contrast * stripes[..., None])
        + contrast * stripes[..., None] * colour[:, None, None]
    )
    img = img + rng.normal(0.0, 0.18, size=img.shape)  # (n, 32, 32, 3)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8), labels.astype(np.int64)


def _write_batch(path: Path, images: np.ndarray, labels: np.ndarray, batch_label: str, first: int) -> None:
    data = images.transpose(0, 3, 1, 2).reshape(len(images), 3072)  # HWC -> CHW planes, (N, 3072)
    entry = {
        "batch_label": batch_label,
        "labels": [int(x) for x in labels],
        "data": np.ascontiguousarray(data),
        "filenames": [f"generated_{first + i:06d}.png" for i in range(len(images))],
    }
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=2)


def _write_manifest(folder: Path, source: str, **extra) -> dict:
    files = TRAIN_FILES + TEST_FILES + [META_FILE]
    manifest = {"source": source, "md5": {name: _md5(folder / name) for name in files}, **extra}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def generate(root: str | os.PathLike, *, train_per_batch: int = 600, test: int = 1000, seed: int = 0) -> dict:
    """Write a generated set (5 x ``train_per_batch`` train, ``test`` test images); return its manifest."""
    if train_per_batch < 1 or test < 1:
        raise ValueError(f"train_per_batch={train_per_batch} and test={test} must both be >= 1")
    final = dataset_dir(root)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i, name in enumerate(TRAIN_FILES):
        images, labels = synthesize(train_per_batch, rng)
        _write_batch(
            tmp / name, images, labels, f"generated training batch {i + 1} of 5", i * train_per_batch
        )
    images, labels = synthesize(test, rng)
    _write_batch(tmp / TEST_FILES[0], images, labels, "generated testing batch 1 of 1", 5 * train_per_batch)
    meta = {"num_cases_per_batch": train_per_batch, "label_names": GENERATED_CLASSES, "num_vis": 3072}
    with open(tmp / META_FILE, "wb") as f:
        pickle.dump(meta, f, protocol=2)
    manifest = _write_manifest(tmp, "generated", seed=seed, num_train=5 * train_per_batch, num_test=test)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # readers never see a half-written set
    return manifest


def download(root: str | os.PathLike) -> dict:
    """Fetch the real CIFAR-10 with torchvision (checks the genuine MD5s) and write its manifest."""
    CIFAR10(root, train=True, download=True)
    folder = dataset_dir(root)
    manifest = _write_manifest(folder, "download", num_train=50000, num_test=10000)
    for name, md5 in CIFAR10.train_list + CIFAR10.test_list:
        assert manifest["md5"][name] == md5, f"{name}: MD5 differs from torchvision's genuine sum"
    return manifest


def describe(root: str | os.PathLike) -> str:
    """One line naming which set is at ``root``: generated or the real download."""
    m = read_manifest(root)
    kind = (
        "GENERATED stand-in (synthetic classes)" if m["source"] == "generated" else "real CIFAR-10 (download)"
    )
    return f"{dataset_dir(root)}: {kind}, {m['num_train']} train / {m['num_test']} test images"

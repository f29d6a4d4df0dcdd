"""The generated set is CIFAR-10's on-disk format, read by torchvision's own loader."""

from __future__ import annotations

import importlib.util
import inspect
import json
import pickle

import numpy as np
import pytest
import torch
from torchvision.datasets import CIFAR10

from distlab import REPO_ROOT
from distlab.cifar import data, engine


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    data.generate(root, train_per_batch=40, test=30, seed=5)
    return root


def test_files_have_the_genuine_layout(root):
    folder = root / "cifar-10-batches-py"
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(
        [*[f"data_batch_{i}" for i in range(1, 6)], "test_batch", "batches.meta", data.MANIFEST]
    )
    with open(folder / "data_batch_3", "rb") as f:
        entry = pickle.load(f, encoding="latin1")  # how torchvision opens them
    assert set(entry) == {"batch_label", "labels", "data", "filenames"}
    assert entry["data"].dtype == np.uint8 and entry["data"].shape == (40, 3072)
    assert len(entry["labels"]) == len(entry["filenames"]) == 40 and set(entry["labels"]) <= set(range(10))
    with open(folder / "batches.meta", "rb") as f:
        assert pickle.load(f, encoding="latin1")["label_names"] == data.GENERATED_CLASSES


def test_torchvision_reads_what_was_generated(root):
    rng = np.random.default_rng(5)  # regenerate the same images: train batches first, then test
    train = [data.synthesize(40, rng) for _ in range(5)]
    test_images, test_labels = data.synthesize(30, rng)
    ds = data.ManifestCIFAR10(root, train=True)
    assert isinstance(ds, CIFAR10) and len(ds) == 200 and ds.classes == data.GENERATED_CLASSES
    np.testing.assert_array_equal(ds.data, np.concatenate([im for im, _ in train]))  # (200, 32, 32, 3)
    assert ds.targets == [int(t) for _, lab in train for t in lab]
    test = data.ManifestCIFAR10(root, train=False, transform=engine.make_transform(False))
    np.testing.assert_array_equal(test.data, test_images)
    x, y = test[7]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == test_labels[7]


def test_genuine_checksums_refuse_the_generated_set(root):
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR10(root, train=True)  # the real MD5s: this is why ManifestCIFAR10 exists


def test_a_changed_file_is_caught(tmp_path):
    data.generate(tmp_path, train_per_batch=4, test=4)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    manifest = json.loads((tmp_path / "cifar-10-batches-py" / data.MANIFEST).read_text())
    assert manifest["source"] == "generated" and manifest["num_train"] == 20
    for train in (True, False):  # torchvision checks every file, whichever split is asked for
        with pytest.raises(RuntimeError, match="corrupted"):
            data.ManifestCIFAR10(tmp_path, train=train)


def test_missing_set_names_the_command(tmp_path):
    for download in (False, True):  # download=True never fetches inside a job: it names the command
        with pytest.raises(data.DatasetMissing, match=r"prepare_cifar.py .*--source download"):
            data.ManifestCIFAR10(tmp_path / "nowhere", download=download)
    assert not (tmp_path / "nowhere").exists()


def test_drop_in_for_torchvision(root):
    """Exactly CIFAR10's parameters, so a learner's call works unchanged, download=True included."""
    ours, theirs = inspect.signature(data.ManifestCIFAR10), inspect.signature(CIFAR10)
    assert (
        list(ours.parameters)
        == list(theirs.parameters)
        == [
            "root",
            "train",
            "transform",
            "target_transform",
            "download",
        ]
    )
    assert all(ours.parameters[k].default == theirs.parameters[k].default for k in ours.parameters)
    before = {p.name: p.stat().st_mtime_ns for p in (root / "cifar-10-batches-py").iterdir()}
    ds = data.ManifestCIFAR10(root, True, engine.make_transform(False), lambda y: y + 100, True)
    x, y = ds[0]
    assert x.shape == (3, 32, 32) and 100 <= y < 110
    assert before == {p.name: p.stat().st_mtime_ns for p in (root / "cifar-10-batches-py").iterdir()}


def test_classes_are_learnable():
    """A nearest-centroid rule on 5 simple features (mean colour, row/column variation) beats chance."""
    rng = np.random.default_rng(0)
    images, labels = data.synthesize(2000, rng)
    x = images.astype(np.float32) / 255  # (n, 32, 32, 3)
    gray = x.mean(-1)  # (n, 32, 32)
    down = np.abs(np.diff(gray.mean(2), axis=1)).mean(1, keepdims=True)  # row means vary: horizontal stripes
    across = np.abs(np.diff(gray.mean(1), axis=1)).mean(1, keepdims=True)  # column means vary: vertical
    feats = np.concatenate([x.mean((1, 2)), 5 * down, 5 * across], axis=1)  # (n, 5)
    fit, held = slice(0, 1500), slice(1500, None)
    centroids = np.stack([feats[fit][labels[fit] == k].mean(0) for k in range(10)])
    pred = np.argmin(((feats[held, None] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (pred == labels[held]).mean() > 0.5, (pred == labels[held]).mean()  # chance is 0.1


def test_prepare_is_idempotent_and_refuses_to_overwrite_silently(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("prepare_cifar", REPO_ROOT / "code" / "prepare_cifar.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    small = ["--data-dir", str(tmp_path), "--train-per-batch", "3", "--test", "4"]
    assert prepare.main(small) == 0
    first = (tmp_path / "cifar-10-batches-py" / data.MANIFEST).read_text()
    assert prepare.main(small) == 0 and "already prepared" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="add --force"):
        prepare.main([*small[:2], "--train-per-batch", "5", "--test", "4"])
    assert (tmp_path / "cifar-10-batches-py" / data.MANIFEST).read_text() == first  # untouched
    assert prepare.main([*small, "--seed", "1", "--force"]) == 0
    assert (tmp_path / "cifar-10-batches-py" / data.MANIFEST).read_text() != first

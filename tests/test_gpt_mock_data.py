"""--mock-data is Megatron's MockGPTLowLevelDataset (100000 documents of 1 to 4095 tokens drawn
from numpy's default_rng(0); token j is (j + 1) mod V, then the eod), split, shuffled and cut
into samples by the real loader; --no-mmap-bin-files reads the same tokens; --data-cache-path
writes the index arrays once and reads them back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distlab.gpt.data.gpt_dataset import build_datasets
from distlab.gpt.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from distlab.gpt.data.mock_dataset import MockIndexedDataset
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.training import micro_batches

pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(120)]
V, EOD = 50, 49


def test_mock_documents_are_megatrons():
    docs = MockIndexedDataset(V, EOD)
    # megatron/core/datasets/gpt_dataset.py: default_rng(seed=0).integers(low=1, high=4096, size=100000)
    sizes = np.random.default_rng(seed=0).integers(low=1, high=4096, size=100000, dtype=np.int32)
    assert len(docs) == 100000 and np.array_equal(docs.sizes, sizes)
    for i in (0, 1, 7, 99999):
        n = int(sizes[i])
        whole = np.concatenate([(np.arange(n - 1) + 1) % V, [EOD]])  # Megatron's __getitem__
        assert np.array_equal(docs[i], whole)
        assert np.array_equal(docs.get(i, offset=n // 3, length=n - n // 3), whole[n // 3 :])


def test_mock_data_through_the_real_loader():
    """Samples of the train split as a training step reads them: every label is the next token
    of its document, or a new document's first token (1) after an eod."""
    train, valid, test = build_datasets(MockIndexedDataset(V, EOD), [0.99, 0.01, 0.0], 16, [8, 4, 0], seed=3)
    assert test is None and len(valid) < len(train)
    state = ParallelState(Layout(1, micro_batch_size=2, global_batch_size=8), rank=0)
    batches = micro_batches(
        train, 0, micro_batch_size=2, num_micro_batches=4, state=state, device=torch.device("cpu")
    )
    tokens = torch.cat([t for t, _ in batches])  # (8, 16)
    labels = torch.cat([lab for _, lab in batches])
    assert tokens.shape == labels.shape == (8, 16) and int(tokens.max()) < V
    follows = (labels == (tokens + 1) % V) | (labels == EOD) | ((tokens == EOD) & (labels == 1))
    assert bool(follows.all())
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the tokens shifted by one
    assert len({tuple(t.tolist()) for t in tokens}) == 8  # shuffled samples, not one repeated


def test_no_mmap_reads_the_same_tokens(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16)
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 60000, size=int(n)) for n in rng.integers(1, 300, size=40)]
    for d in docs:
        builder.add_document(d)
    builder.finalize()
    mapped, read = IndexedDataset(str(tmp_path / "d")), IndexedDataset(str(tmp_path / "d"), mmap=False)
    assert read._bin is None and mapped._bin is not None
    for i in (0, 5, 39):
        n = len(docs[i])
        assert np.array_equal(read[i], docs[i]) and np.array_equal(read[i], mapped[i])
        assert np.array_equal(read.get(i, n // 2, n - n // 2), docs[i][n // 2 :])


def test_data_cache_path_writes_then_reads_back(tmp_path):
    mock = MockIndexedDataset(V, EOD)
    first = build_datasets(mock, [0.99, 0.01, 0.0], 16, [8, 4, 0], seed=3, cache_dir=str(tmp_path))
    assert not any(d.cache_hit for d in first if d) and len(list(tmp_path.glob("*.npy"))) == 4
    again = build_datasets(mock, [0.99, 0.01, 0.0], 16, [8, 4, 0], seed=3, cache_dir=str(tmp_path))
    assert all(d.cache_hit for d in again if d)
    for a, b in zip(first[:2], again[:2], strict=True):
        assert np.array_equal(a.shuffle_idx, b.shuffle_idx) and np.array_equal(a[5], b[5])
    other = build_datasets(mock, [0.99, 0.01, 0.0], 16, [8, 4, 0], seed=4, cache_dir=str(tmp_path))
    assert not other[0].cache_hit and not np.array_equal(other[0].shuffle_idx[:50], first[0].shuffle_idx[:50])

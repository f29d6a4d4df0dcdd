"""Megatron's mock GPT documents (``MockGPTLowLevelDataset`` in megatron/core/datasets/gpt_dataset.py),
for ``--mock-data``: no files, the same documents on every rank and every run.

``N = 100000`` documents; document ``i`` has ``n_i`` tokens, ``n`` drawn once as
``numpy.random.default_rng(0).integers(1, 4096, N)`` (1 to 4095), and is::

    doc_i = [1, 2, ..., n_i - 1] mod V  +  [eod]          (token j = (j + 1) mod V, then eod)

``V`` the tokenizer's vocabulary and ``eod`` its end-of-document id (NullTokenizer: ``V - 1``).
As Megatron's ``MockGPTDataset`` wraps them in its ``GPTDataset``, these documents go through this
engine's :class:`~distlab.gpt.data.gpt_dataset.GPTDataset`: ``--split`` by document, shuffled from
the seed, cut into samples. Tokens are computed on demand (nothing of ``sum n_i`` ~ 2e8 is stored).
"""

from __future__ import annotations

import numpy as np

#: Megatron's hard-coded constants (MockGPTLowLevelDataset.seed, .size, .max_sequence_length).
SEED, SIZE, MAX_SEQUENCE_LENGTH = 0, 100000, 4096


class MockIndexedDataset:
    """The :class:`~distlab.gpt.data.indexed_dataset.IndexedDataset` interface over Megatron's mock documents."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed=SEED)
        self.sizes = rng.integers(low=1, high=MAX_SEQUENCE_LENGTH, size=SIZE, dtype=np.int32)  # (N,)
        self.prefix = f"mock(V={vocab_size}, eod={eod})"  # names the source (cache keys, logs)

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``i`` (int64)."""
        size = int(self.sizes[i])
        length = size - offset if length is None else length
        j = np.arange(offset, offset + length, dtype=np.int64)
        return np.where(j == size - 1, self.eod, (j + 1) % self.vocab_size)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

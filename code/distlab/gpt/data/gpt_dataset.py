"""Fixed-length GPT samples cut from an indexed dataset, split and shuffled from the seed.

Documents are split by ``--split`` (e.g. ``949,50,1``) into train / validation / test ranges of
document indices, as Megatron does: boundary ``k`` is ``round(cumsum(split)[k] x n_docs)``.
For one split, an epoch is its documents in a seeded random order, concatenated into one token
stream; ``E`` epochs are appended until the stream holds the samples asked for. Sample ``j``
of the stream is ``stream[j*s : j*s + s + 1]`` (``s = --seq-length``; consecutive samples share
one token so every token is once a label). The samples are then shuffled with the same seed::

    tokens = sample[:-1]   # (s,)
    labels = sample[1:]    # (s,)   next-token targets

Everything is a pure function of (documents, split, seed, s, number of samples), so every rank
and every resumed run sees the same sample ``i``. With ``cache_dir`` (``--data-cache-path``) the
two index arrays (document order, sample shuffle) are written there as ``.npy`` files named by a
hash of those inputs, as Megatron caches its indices, and read back by the next run.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from distlab.gpt.data.indexed_dataset import IndexedDataset


def split_ranges(n_docs: int, weights: list[float]) -> list[tuple[int, int]]:
    """``[(start, stop)]`` document ranges of train / validation / test."""
    bounds = [0] + [int(round(c * n_docs)) for c in np.cumsum(weights)]
    bounds[-1] = n_docs
    return [(bounds[k], bounds[k + 1]) for k in range(len(weights))]


class GPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` tokens from documents ``[start, stop)``."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        seed: int,
        name: str = "train",
        cache_dir: str | None = None,
    ) -> None:
        start, stop = doc_range
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        self.cache_files: tuple[str, str] | None = None
        self.cache_hit = False
        if cache_dir is not None:
            key = json.dumps(
                [str(indexed.prefix), len(indexed), doc_range, seq_length, num_samples, seed, name]
            )
            stem = os.path.join(cache_dir, f"{hashlib.md5(key.encode()).hexdigest()}-{name}")
            self.cache_files = (f"{stem}-doc_idx.npy", f"{stem}-shuffle_idx.npy")
            if all(os.path.exists(f) for f in self.cache_files):
                self.doc_idx, self.shuffle_idx = (np.load(f) for f in self.cache_files)
                self.cache_hit = True
        docs = np.arange(start, stop, dtype=np.int64)
        tokens_per_epoch = int(indexed.sizes[start:stop].sum())
        if tokens_per_epoch < seq_length + 1:
            raise ValueError(
                f"{name} split has {stop - start} documents and {tokens_per_epoch} tokens, fewer than "
                f"one sample of --seq-length {seq_length} + 1: give it a larger share in --split or more data"
            )
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        self.num_epochs = max(1, -(-num_samples // samples_per_epoch))
        rng = np.random.RandomState(seed)
        if not self.cache_hit:
            # doc_idx: the stream's documents in order, epoch after epoch        (E * n_split_docs,)
            self.doc_idx = np.concatenate([rng.permutation(docs) for _ in range(self.num_epochs)])
        sizes = indexed.sizes[self.doc_idx].astype(np.int64)
        self.doc_start = np.zeros(len(sizes) + 1, dtype=np.int64)  # stream offset of each doc
        np.cumsum(sizes, out=self.doc_start[1:])
        if not self.cache_hit:
            total = (int(self.doc_start[-1]) - 1) // seq_length
            self.shuffle_idx = rng.permutation(total)  # (total samples,)
            if self.cache_files is not None:
                _save_atomically(self.cache_files, (self.doc_idx, self.shuffle_idx))
        self.num_samples = num_samples

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: ``seq_length + 1`` token ids (int64)."""
        begin = int(self.shuffle_idx[i % len(self.shuffle_idx)]) * self.seq_length
        end = begin + self.seq_length + 1
        d = int(np.searchsorted(self.doc_start, begin, side="right")) - 1
        parts, pos = [], begin
        while pos < end:
            doc_off = pos - int(self.doc_start[d])
            take = min(end - pos, int(self.doc_start[d + 1]) - pos)
            parts.append(self.indexed.get(int(self.doc_idx[d]), doc_off, take))
            pos += take
            d += 1
        return np.concatenate(parts).astype(np.int64)

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, labels)`` for sample indices, each ``(len(indices), seq_length)`` int64."""
        samples = torch.from_numpy(np.stack([self[i] for i in indices]))  # (B, s+1)
        return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()


def _save_atomically(files: tuple[str, ...], arrays: tuple[np.ndarray, ...]) -> None:
    """Each array to its ``.npy`` through a temporary name: ranks writing the same cache at once
    each replace it whole, with the same content."""
    os.makedirs(os.path.dirname(files[0]) or ".", exist_ok=True)
    for path, array in zip(files, arrays, strict=True):
        tmp = f"{path}.tmp{os.getpid()}.npy"
        np.save(tmp, array)
        os.replace(tmp, path)


def build_datasets(
    indexed: IndexedDataset | str,
    split: list[float],
    seq_length: int,
    num_samples: list[int],
    seed: int,
    cache_dir: str | None = None,
) -> list[GPTDataset | None]:
    """Train / validation / test datasets of ``indexed`` (a dataset prefix, an ``IndexedDataset``
    or ``mock_dataset.MockIndexedDataset``); ``None`` where no sample is needed or the split share is 0."""
    if isinstance(indexed, str):
        indexed = IndexedDataset(indexed)
    out: list[GPTDataset | None] = []
    ranges = split_ranges(len(indexed), split)
    for name, rng_, n, w in zip(("train", "validation", "test"), ranges, num_samples, split, strict=True):
        out.append(
            GPTDataset(indexed, rng_, seq_length, n, seed, name, cache_dir) if n > 0 and w > 0 else None
        )
    return out

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
and every resumed run sees the same sample ``i``.
"""

from __future__ import annotations

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
    ) -> None:
        start, stop = doc_range
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
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
        # doc_idx: the stream's documents in order, epoch after epoch        (E * n_split_docs,)
        self.doc_idx = np.concatenate([rng.permutation(docs) for _ in range(self.num_epochs)])
        sizes = indexed.sizes[self.doc_idx].astype(np.int64)
        self.doc_start = np.zeros(len(sizes) + 1, dtype=np.int64)  # stream offset of each doc
        np.cumsum(sizes, out=self.doc_start[1:])
        total = (int(self.doc_start[-1]) - 1) // seq_length
        self.shuffle_idx = rng.permutation(total)  # (total samples,)
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


def build_datasets(
    prefix: str, split: list[float], seq_length: int, num_samples: list[int], seed: int
) -> list[GPTDataset | None]:
    """Train / validation / test datasets; ``None`` where no sample is needed or the split share is 0."""
    indexed = IndexedDataset(prefix)
    out: list[GPTDataset | None] = []
    ranges = split_ranges(len(indexed), split)
    for name, rng_, n, w in zip(("train", "validation", "test"), ranges, num_samples, split, strict=True):
        out.append(GPTDataset(indexed, rng_, seq_length, n, seed, name) if n > 0 and w > 0 else None)
    return out

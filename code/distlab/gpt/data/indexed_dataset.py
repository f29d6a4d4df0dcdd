"""Memory-mapped indexed dataset: documents of token ids in a ``.bin``, their index in a ``.idx``.

In the spirit of Megatron's ``MMapIndexedDataset``, a document is read without loading the file:
``tokens(doc i) = bin[pointer[i] : pointer[i] + size[i]]`` (pointers in elements, not bytes).

File format (little-endian)::

    PREFIX.bin  token ids of every document, back to back, dtype uint16 (vocab < 65536) or int32
    PREFIX.idx  offset  bytes        field
                0       8            magic  b"DLIDX\\x00\\x01\\x00"
                8       1            dtype code (1: uint16, 2: int32)
                9       8            n, the number of documents (uint64)
                17      4 n          sizes, tokens per document (int32)
                17+4n   8 n          pointers, first token of each document in .bin (int64)

``IndexedDatasetBuilder`` writes both files (to temporary names, renamed at the end, so a killed
preprocessing never leaves a half-written dataset); ``IndexedDataset`` maps them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np

MAGIC = b"DLIDX\x00\x01\x00"
_DTYPES = {1: np.uint16, 2: np.int32}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


def best_dtype(vocab_size: int) -> type:
    """The smallest dtype that holds every id: uint16 below 65536 tokens, else int32."""
    return np.uint16 if vocab_size < 65536 else np.int32


class IndexedDatasetBuilder:
    """Append documents, then ``finalize()`` to write ``PREFIX.bin`` and ``PREFIX.idx``."""

    def __init__(self, prefix: str, dtype: type = np.uint16) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"dtype {self.dtype} unsupported: use numpy.uint16 or numpy.int32")
        self._tmp_bin = f"{prefix}.bin.tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize
        self._sizes: list[int] = []

    def add_document(self, ids: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id out of range for {self.dtype}: min {arr.min()}, max {arr.max()}")
        self._bin.write(arr.astype(self.dtype).tobytes())
        self._sizes.append(int(arr.size))

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], out=pointers[1:])
        tmp_idx = f"{self.prefix}.idx.tmp{os.getpid()}"
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<B", _CODES[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(tmp_idx, self.prefix + ".idx")


class IndexedDataset:
    """Read-only view of ``PREFIX.bin/.idx``: ``ds[i]`` is document ``i`` as a numpy array.
    ``mmap=False`` (``--no-mmap-bin-files``): the .bin is not mapped; each read opens it, seeks and
    reads the tokens asked for (Megatron's file reader), the index is mapped either way."""

    def __init__(self, prefix: str, mmap: bool = True) -> None:
        self.prefix, self.mmap = prefix, mmap
        with open(prefix + ".idx", "rb") as f:
            magic = f.read(8)
            if magic != MAGIC:
                raise ValueError(f"{prefix}.idx is not a distlab indexed dataset (magic {magic!r})")
            (code,) = struct.unpack("<B", f.read(1))
            (n,) = struct.unpack("<Q", f.read(8))
        self.dtype = np.dtype(_DTYPES[code])
        idx = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(idx, dtype=np.int32, count=n, offset=17)  # (n,)
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n, offset=17 + 4 * n)  # (n,)
        self._bin = (
            np.memmap(prefix + ".bin", mode="r", dtype=self.dtype) if mmap else None
        )  # (total tokens,)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``i``."""
        size = int(self.sizes[i])
        length = size - offset if length is None else length
        start = int(self.pointers[i]) + offset
        if self._bin is None:
            with open(self.prefix + ".bin", "rb") as f:
                f.seek(start * self.dtype.itemsize)
                return np.fromfile(f, dtype=self.dtype, count=length)
        return np.asarray(self._bin[start : start + length])

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum())

"""The prefetcher reads the next step's batches on its worker, and they are the batches the
training loop would read itself (same samples, same order), whatever it asks for next."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from distlab.gpt.data.gpt_dataset import build_datasets
from distlab.gpt.data.prefetch import Prefetcher
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.training import micro_batches
from distlab.local_runs import prepare_data

pytestmark = pytest.mark.engine_fast


def test_prefetched_batches_are_the_loops_and_read_off_its_thread(tmp_path) -> None:
    files = prepare_data(tmp_path, vocab_size=300, max_files=10)
    (train, *_), cpu = (
        build_datasets(files.data_path, [1.0, 0.0, 0.0], 16, [64, 0, 0], 1),
        torch.device("cpu"),
    )
    state = ParallelState(Layout(2, micro_batch_size=2, global_batch_size=8), rank=1)
    readers: list[str] = []

    def read(first: int, m: int):
        readers.append(threading.current_thread().name)
        time.sleep(0.05)  # a slow disk
        return micro_batches(train, first, micro_batch_size=2, num_micro_batches=m, state=state, device=cpu)

    prefetcher = Prefetcher(read, cpu)
    try:
        taken = []
        for step, (first, m) in enumerate([(0, 2), (8, 2), (16, 2), (40, 2), (48, 1)]):
            taken.append((first, m, prefetcher.take(first, m)))
            if step < 2:  # the loop's next batch; at step 2 it asks for 24 and takes 40 instead
                prefetcher.prefetch(first + 8, m)
            elif step == 2:
                prefetcher.prefetch(24, 2)
            else:
                prefetcher.prefetch(first + 8, 1)
        prefetcher.prefetch(56, 1)  # left in flight: close waits for it
    finally:
        prefetcher.close()
    for first, m, batches in taken:  # rank 1 of dp 2: samples first + 2 k dp + 2 .. + 3
        expected = micro_batches(
            train, first, micro_batch_size=2, num_micro_batches=m, state=state, device=cpu
        )
        assert len(batches) == m
        for (tokens, labels), (want_tokens, want_labels) in zip(batches, expected, strict=True):
            assert torch.equal(tokens, want_tokens) and torch.equal(labels, want_labels)
    # the first batch and the one the loop changed course for (40) were read on the caller's
    # thread; every other, and the dropped 24, on the worker
    main = threading.current_thread().name
    assert readers[0] == main and readers.count(main) == 2, readers
    assert sum(name.startswith("distlab-prefetch") for name in readers) == len(readers) - 2

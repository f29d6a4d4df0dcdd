"""Run ``pretrain`` on spawned local ranks, and prepare a small offline dataset: for tests,
and benchmarks that need a whole run without a cluster.

``spawn_pretrain(argv, world_size, out_dir)`` starts ``world_size`` processes on a free port
with torchrun's variables (``RANK``, ``WORLD_SIZE``, ...), runs ``pretrain(argv)`` in each, and
returns every rank's history and log text. ``prepare_data(folder)`` trains a byte-level BPE on
standard-library docstrings and writes the indexed dataset, once per folder.

Beside ``local_ranks.py`` (which it spawns with), outside the engine: it drives ``distlab.gpt``
from the outside, as ``pretrain_gpt.py`` does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

from distlab.gpt.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from distlab.gpt.data.tokenizer import GPT2BPETokenizer, stdlib_docstrings, train_bpe
from distlab.local_ranks import free_port, spawn_ranks, torchrun_env


@dataclass(frozen=True)
class DataFiles:
    """What ``--tokenizer-type GPT2BPETokenizer``, ``--vocab-file``, ``--merge-file`` and ``--data-path`` need."""

    vocab_file: str
    merge_file: str
    data_path: str

    def argv(self) -> list[str]:
        return [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            self.vocab_file,
            "--merge-file",
            self.merge_file,
            "--data-path",
            self.data_path,
        ]


def prepare_data(
    folder: str | os.PathLike, vocab_size: int = 4096, max_files: int | None = None
) -> DataFiles:
    """Tokenizer + ``stdlib_text_document.bin/.idx`` in ``folder`` (reused when already there)."""
    out = Path(folder)
    files = DataFiles(str(out / "vocab.json"), str(out / "merges.txt"), str(out / "stdlib_text_document"))
    if all(os.path.exists(p) for p in (files.vocab_file, files.merge_file, files.data_path + ".idx")):
        return files
    texts = list(stdlib_docstrings(max_files=max_files))
    train_bpe(texts, out, vocab_size)
    tok = GPT2BPETokenizer(files.vocab_file, files.merge_file)
    builder = IndexedDatasetBuilder(files.data_path, best_dtype(tok.vocab_size))
    for ids in tok.tokenize_batch(texts):
        builder.add_document(ids + [tok.eod])
    builder.finalize()
    return files


def pretrain_as_rank(rank: int, world: int, port: int, argv: list[str], log: Path) -> dict:
    """``pretrain(argv)`` as rank ``rank`` of ``world`` (torchrun's variables); stdout to ``log``."""
    os.environ.update(torchrun_env(rank, world, port))
    from distlab.gpt.pretrain import pretrain

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            history = pretrain(argv)
    finally:
        log.write_text(buf.getvalue())
    history.pop("args", None)
    return history


def _rank_main(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    history = pretrain_as_rank(rank, world, port, argv, Path(out, f"rank{rank}.log"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(history))


@dataclass
class RunResult:
    """Per-rank histories (``losses``, ``loss_scales``, ...) and logs of a spawned run."""

    histories: list[dict]
    logs: list[str]

    @property
    def last(self) -> dict:
        """History of the last rank (it holds the loss, as Megatron's last rank does)."""
        return self.histories[-1]

    @property
    def log(self) -> str:
        return "\n".join(self.logs)


def spawn_pretrain(argv: list[str], world_size: int, out_dir: str | os.PathLike) -> RunResult:
    """Run ``pretrain(argv)`` on ``world_size`` local ranks (gloo); raise if any rank fails."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_rank_main, (world_size, free_port(), list(argv), str(out)), world_size)
    return RunResult(
        [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)],
        [(out / f"rank{r}.log").read_text() for r in range(world_size)],
    )

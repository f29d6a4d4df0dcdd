"""The shared setup of the GPT notebooks 04-07 and 13: the site, the model per site, the data once.

One call replaces each notebook's setup cell::

    LAB = course.gpt_notebook("05")   # GPTNotebook(backend='gloo', procs=2, ..., iters=4, micro=2)
    LAB.export(GPT_MICRO=LAB.micro, GPT_ARGS=LAB.gpt_args())   # what the notebook's sbatch jobs read

Contract: the site profile (``$LAB_SITE``, :mod:`distlab.site`) gives the backend and the processes
per node; ``nccl`` means a GPU site and the notebook's GPU model, anything else the local cluster
and its tiny model (``SIZES``). The tokenizer and the indexed dataset (``data/gpt``) are made by the
two commands of notebook 04's section 1, :func:`data_commands`, run here only when a file is
missing; a command that fails raises :class:`DataPreparationError` naming the command and the fix.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from distlab import REPO_ROOT, site

VOCAB_SIZE = 4096
#: The indexed dataset's prefix (``--data-path``) inside the data folder, and what must exist.
DATASET = "stdlib_text_document"
DATA_FILES = ("vocab.json", "merges.txt", f"{DATASET}.bin", f"{DATASET}.idx")


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape in Megatron's flags: layers l, hidden size h, heads a, sequence length s."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int

    def args(self) -> str:
        """``--num-layers l --hidden-size h --num-attention-heads a --seq-length s``."""
        return (
            f"--num-layers {self.num_layers} --hidden-size {self.hidden_size} "
            f"--num-attention-heads {self.num_attention_heads} --seq-length {self.seq_length}"
        )


@dataclass(frozen=True)
class RunSize:
    """What one notebook trains on one kind of site."""

    model: ModelShape
    iters: int  # --train-iters of the notebook's runs
    micro: int  # --micro-batch-size of the notebook's runs (07: the fixes' micro batch)


#: Per notebook: (GPU site, local cluster). GPU sites train the reference shapes; the local
#: cluster's models train a job in seconds on 2 shared CPU cores.
SIZES: dict[str, tuple[RunSize, RunSize]] = {
    "04": (  # GPT-2 small's shape (32 heads, as the reference course), against the tiny one
        RunSize(ModelShape(12, 768, 32, 1024), iters=50, micro=2),
        RunSize(ModelShape(2, 64, 4, 64), iters=10, micro=2),
    ),
    "05": (  # 4 local layers: one per stage at PP = 4
        RunSize(ModelShape(8, 1024, 16, 1024), iters=10, micro=2),
        RunSize(ModelShape(4, 64, 4, 64), iters=4, micro=2),
    ),
    "06": (
        RunSize(ModelShape(12, 768, 32, 1024), iters=8, micro=2),
        RunSize(ModelShape(2, 64, 4, 64), iters=6, micro=2),
    ),
    "07": (  # GPT-2 small exactly (12 heads); the fixes run at micro batch 8 on both (on the CPU,
        # fp16's four iterations of slow half-precision GEMMs took 18 s of the notebook's 131 at 16)
        RunSize(ModelShape(12, 768, 12, 1024), iters=2, micro=8),
        RunSize(ModelShape(4, 128, 4, 128), iters=2, micro=8),
    ),
    "13": (  # the step-time model's local check: a few layouts of 2 ranks, timed against the model
        RunSize(ModelShape(8, 1024, 16, 1024), iters=10, micro=2),
        RunSize(ModelShape(4, 256, 8, 256), iters=5, micro=2),
    ),
}


class DataPreparationError(RuntimeError):
    """A data-preparation command failed: the message names it, its output's end, and the fix."""


@dataclass(frozen=True)
class GPTNotebook:
    """One GPT notebook's settings, as its cells use them (BACKEND, PROCS, PY, CODE, DATA, ...)."""

    backend: str  # LAB_BACKEND of the site: "nccl" on GPU sites, "gloo" on the local cluster
    procs: int  # LAB_PROCS_PER_NODE: processes (GPUs) per node
    python: str  # this kernel's interpreter, for commands typed in cells
    code: Path  # the entry scripts: pretrain_gpt.py, train_tokenizer.py, preprocess_data.py
    data: Path  # vocab.json, merges.txt and the indexed dataset
    model: ModelShape
    iters: int
    micro: int

    @property
    def data_args(self) -> str:
        """``--data-path --tokenizer-type --vocab-file --merge-file`` of the prepared data."""
        d = self.data
        return (
            f"--data-path {d / DATASET} --tokenizer-type GPT2BPETokenizer --vocab-file {d / 'vocab.json'} "
            f"--merge-file {d / 'merges.txt'}"
        )

    def gpt_args(self, *extra: str, log_interval: int = 1) -> str:
        """The runs' Megatron arguments: the model without dropout (runs of different layouts then
        compute the same losses), ``iters`` iterations of a cosine schedule from 1e-3 to 1e-4 after 10%
        warm-up, one validation batch at the end, the data, then ``extra``."""
        s = self.model.seq_length
        return " ".join(
            [
                f"{self.model.args()} --max-position-embeddings {s} --attention-dropout 0 --hidden-dropout 0",
                f"--train-iters {self.iters}",
                "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.1",
                f"--log-interval {log_interval} --eval-interval {self.iters} --eval-iters 1 --split 949,50,1",
                *extra,
                self.data_args,
            ]
        )

    def export(self, **variables: object) -> None:
        """Put ``variables`` into this kernel's environment (sbatch passes it on to the jobs) and
        print them under a line naming the backend."""
        print(f"backend {self.backend}, {self.procs} processes per node")
        for name, value in variables.items():
            os.environ[name] = str(value)
            print(f"{name}={value}")


def data_commands(python: str, code: Path, data: Path) -> list[list[str]]:
    """Notebook 04's two steps: train the byte-level BPE (writes the corpus too), then tokenize the
    corpus into ``<data>/stdlib_text_document.bin/.idx``."""
    tokenizer = [python, str(code / "train_tokenizer.py"), "--output-dir", str(data)]
    preprocess = [python, str(code / "preprocess_data.py"), "--input", str(data / "stdlib_docstrings.jsonl")]
    preprocess += ["--output-prefix", str(data / "stdlib"), "--vocab-file", str(data / "vocab.json")]
    preprocess += ["--merge-file", str(data / "merges.txt"), "--append-eod"]
    return [[*tokenizer, "--vocab-size", str(VOCAB_SIZE)], preprocess]


def prepare_data(python: str, code: Path, data: Path) -> bool:
    """Run :func:`data_commands` when a file of ``DATA_FILES`` is missing; True when it ran."""
    missing = [name for name in DATA_FILES if not (data / name).is_file()]
    if not missing:
        return False
    print(f"data: {', '.join(missing)} missing in {data}; preparing it as notebook 04 does")
    data.mkdir(parents=True, exist_ok=True)
    for command in data_commands(python, code, data):
        line = shlex.join(command)
        print(f"$ {line}")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
            raise DataPreparationError(
                f"data preparation failed (exit {done.returncode}):\n$ {line}\n{tail}\n"
                f"Fix: run that command in a terminal from {REPO_ROOT} to see the whole error (a full disk "
                f"or a read-only {data} are the usual causes), then run this cell again."
            )
    return True


def gpt_notebook(notebook: str, *, prepare: bool = True) -> GPTNotebook:
    """The settings of GPT notebook ``notebook`` ("04" to "07", "13") on this site, its data prepared
    if missing (``prepare=False``: notebook 04, whose learner runs the two commands in a cell)."""
    if notebook not in SIZES:
        raise ValueError(f"no GPT notebook {notebook!r}: choose one of {sorted(SIZES)}")
    profile = site.profile_env(site.current())  # keyed by name: profile_env() caches its None
    backend = profile["LAB_BACKEND"]
    size = SIZES[notebook][0 if backend == "nccl" else 1]
    lab = GPTNotebook(
        backend=backend,
        procs=int(profile["LAB_PROCS_PER_NODE"]),
        python=sys.executable,
        code=REPO_ROOT / "code",
        data=REPO_ROOT / "data" / "gpt",
        model=size.model,
        iters=size.iters,
        micro=size.micro,
    )
    if prepare:
        prepare_data(lab.python, lab.code, lab.data)
    return lab

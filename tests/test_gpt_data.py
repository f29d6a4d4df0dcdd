"""GPT data pipeline: tokenizer files, preprocess -> .bin/.idx round trip, samples, splits."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from distlab import REPO_ROOT
from distlab.gpt.data.gpt_dataset import GPTDataset, build_datasets, split_ranges
from distlab.gpt.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from distlab.gpt.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer, stdlib_docstrings, train_bpe

pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(120)]
CODE = REPO_ROOT / "code"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    subprocess.run(
        [
            sys.executable,
            str(CODE / "train_tokenizer.py"),
            "--output-dir",
            str(folder),
            "--vocab-size",
            "600",
            "--max-files",
            "40",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return folder


def test_tokenizer_files_are_gpt2_style_and_lossless(tok_dir):
    vocab = json.loads((tok_dir / "vocab.json").read_text())
    merges = (tok_dir / "merges.txt").read_text().splitlines()
    assert len(vocab) == 600 and EOD_TOKEN in vocab
    assert len(merges[-1].split(" ")) == 2  # "a b" pairs, GPT-2 layout
    tok = GPT2BPETokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    text = "Return the sum of x and y.\n\tÜnïcode ✓ survives byte-level BPE."
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == vocab[EOD_TOKEN]


def test_preprocess_round_trip(tok_dir, tmp_path):
    docs = ["First document.\nIt has two lines.", "Second, shorter.", "Third: ∑ unicode too."]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    subprocess.run(
        [
            sys.executable,
            str(CODE / "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "out"),
            "--vocab-file",
            str(tok_dir / "vocab.json"),
            "--merge-file",
            str(tok_dir / "merges.txt"),
            "--append-eod",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tok = GPT2BPETokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(ds) == len(docs)
    for i, d in enumerate(docs):
        assert ds[i].tolist() == tok.tokenize(d) + [tok.eod]
        assert tok.detokenize(ds[i][:-1].tolist()) == d
    assert ds.num_tokens == sum(len(tok.tokenize(d)) + 1 for d in docs)


def test_plain_text_documents_are_blank_line_separated(tok_dir, tmp_path):
    src = tmp_path / "docs.txt"
    src.write_text("para one\nline two\n\n\npara two\n")
    subprocess.run(
        [
            sys.executable,
            str(CODE / "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "t"),
            "--vocab-file",
            str(tok_dir / "vocab.json"),
            "--merge-file",
            str(tok_dir / "merges.txt"),
            "--workers",
            "2",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    ds = IndexedDataset(str(tmp_path / "t_text_document"))
    tok = GPT2BPETokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"))
    assert [tok.detokenize(ds[i].tolist()) for i in range(len(ds))] == ["para one\nline two\n", "para two\n"]


def _toy_dataset(tmp_path, sizes: list[int]) -> tuple[IndexedDataset, list[np.ndarray]]:
    rng = np.random.RandomState(0)
    docs = [rng.randint(0, 500, size=n) for n in sizes]
    b = IndexedDatasetBuilder(str(tmp_path / "toy"))
    for d in docs:
        b.add_document(d.tolist())
    b.finalize()
    return IndexedDataset(str(tmp_path / "toy")), docs


def test_samples_are_stream_slices_shuffled_deterministically(tmp_path):
    indexed, docs = _toy_dataset(tmp_path, [5, 17, 3, 40, 9, 11])
    seq = 8
    ds = GPTDataset(indexed, (0, 6), seq, num_samples=30, seed=7)  # 85 tokens/epoch -> 10 samples/epoch
    assert ds.num_epochs == 3 and len(ds) == (3 * 85 - 1) // seq
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    for i in range(len(ds)):
        j = ds.shuffle_idx[i]
        np.testing.assert_array_equal(ds[i], stream[j * seq : j * seq + seq + 1])
    again = GPTDataset(indexed, (0, 6), seq, num_samples=30, seed=7)
    other = GPTDataset(indexed, (0, 6), seq, num_samples=30, seed=8)
    assert all(np.array_equal(ds[i], again[i]) for i in range(len(ds)))
    assert not all(np.array_equal(ds[i], other[i]) for i in range(len(ds)))
    tokens, labels = ds.batch(range(4))
    assert tokens.shape == labels.shape == (4, seq)
    assert (tokens[:, 1:] == labels[:, :-1]).all()


def test_split_ranges_cover_documents_once(tmp_path):
    assert split_ranges(1000, [0.949, 0.05, 0.001]) == [(0, 949), (949, 999), (999, 1000)]
    indexed, _ = _toy_dataset(tmp_path, [30] * 10)
    train, valid, test = build_datasets(str(tmp_path / "toy"), [0.8, 0.2, 0.0], 8, [5, 3, 0], seed=1)
    assert test is None
    assert set(train.doc_idx.tolist()) == set(range(8)) and set(valid.doc_idx.tolist()) == {8, 9}
    with pytest.raises(ValueError, match="validation split has 0 documents"):
        build_datasets(str(tmp_path / "toy"), [0.99, 0.01, 0.0], 8, [5, 3, 0], seed=1)


def test_stdlib_corpus_is_deterministic():
    first = list(stdlib_docstrings(max_files=15))
    assert first and first == list(stdlib_docstrings(max_files=15))


def test_bad_vocab_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 100"):
        train_bpe(["some text"], tmp_path, vocab_size=100)

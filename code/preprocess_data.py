"""Tokenize text into an indexed binary dataset (``.bin`` + ``.idx``), like Megatron's preprocess_data.py.

Input: JSON lines (``.json``/``.jsonl``, text under ``--json-keys``, default ``text``), or plain
text where documents are separated by blank lines. Output: ``<output-prefix>_<key>_document.bin``
and ``.idx`` (format in ``distlab.gpt.data.indexed_dataset``), which ``--data-path`` names without the
suffix::

    python code/preprocess_data.py --input data/gpt/stdlib_docstrings.jsonl --output-prefix data/gpt/stdlib \\
        --vocab-file data/gpt/vocab.json --merge-file data/gpt/merges.txt --append-eod --workers 2
    # -> data/gpt/stdlib_text_document.bin / .idx     (--data-path data/gpt/stdlib_text_document)

Megatron's other tokenizer kinds read ``--tokenizer-model`` instead (``distlab.gpt.data.tokenizers``)::

    python code/preprocess_data.py --input data/gpt/stdlib_docstrings.jsonl --output-prefix data/gpt/sp \
        --tokenizer-type Llama2Tokenizer --tokenizer-model data/gpt/sp/tokenizer.model --append-eod
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from multiprocessing import Pool

from distlab.gpt.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from distlab.gpt.data.tokenizers import TokenizerSpec

_TOK = None  # this process's tokenizer (each pool worker builds its own)


def read_documents(path: str, key: str = "text") -> Iterator[str]:
    """Documents of a JSON-lines file (field ``key``) or of a text file (blank-line separated)."""
    with open(path, encoding="utf-8") as f:
        if path.endswith((".json", ".jsonl")):
            for n, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if key not in record:
                        raise KeyError(
                            f"{path}:{n} has no key {key!r} (keys: {sorted(record)}): set --json-keys"
                        )
                    yield record[key]
        else:
            doc: list[str] = []
            for line in f:
                if line.strip():
                    doc.append(line)
                elif doc:
                    yield "".join(doc)
                    doc = []
            if doc:
                yield "".join(doc)


def _init(spec: TokenizerSpec) -> None:
    global _TOK
    _TOK = spec.build()


def _encode(batch: list[str]) -> list[list[int]]:
    return _TOK.tokenize_batch(batch)


def _batches(docs: Iterator[str], size: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--input", required=True)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    p.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=["GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                 "HuggingFaceTokenizer"],
    )  # fmt: skip
    p.add_argument("--tokenizer-model", help="a sentencepiece .model, or a folder with tokenizer.json")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument(
        "--append-eod", action="store_true", help="end every document with the end-of-document token"
    )
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--dataset-impl", default="mmap", choices=["mmap"])
    args = p.parse_args(argv)
    t0 = time.time()
    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
    try:
        tok = spec.build()
    except (OSError, TypeError, ValueError) as exc:
        p.error(f"--tokenizer-type {args.tokenizer_type}: {exc}")
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_document"
        builder = IndexedDatasetBuilder(prefix, best_dtype(tok.vocab_size))
        n_docs = n_tokens = 0
        docs = _batches(read_documents(args.input, key))
        with (
            Pool(args.workers, initializer=_init, initargs=(spec,))
            if args.workers > 1
            else _Serial(spec) as pool
        ):
            for encoded in pool.imap(_encode, docs):
                for ids in encoded:
                    if args.append_eod:
                        ids = ids + [tok.eod]
                    if ids:
                        builder.add_document(ids)
                        n_docs += 1
                        n_tokens += len(ids)
        builder.finalize()
        print(
            f"> {args.input} [{key}] -> {prefix}.bin/.idx: {n_docs} documents, {n_tokens} tokens "
            f"({time.time() - t0:.1f} s)"
        )
    return 0


class _Serial:
    """The ``Pool`` interface in this process (``--workers 1``)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        _init(spec)

    def __enter__(self) -> _Serial:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def imap(self, fn, items):
        return map(fn, items)


if __name__ == "__main__":
    sys.exit(main())

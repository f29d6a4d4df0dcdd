"""Train a GPT-2-style byte-level BPE offline; write vocab.json + merges.txt (+ the corpus).

The corpus is the docstrings of the Python standard library (every machine has it, no download);
it is also written as JSON lines so that ``preprocess_data.py`` can turn it into a dataset::

    python code/train_tokenizer.py --output-dir data/gpt --vocab-size 4096
    # -> data/gpt/vocab.json, data/gpt/merges.txt, data/gpt/stdlib_docstrings.jsonl

Train on your own text instead with ``--input corpus.jsonl`` (key ``--json-key``) or ``--input a.txt``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from preprocess_data import read_documents

from distlab import REPO_ROOT
from distlab.gpt.data.tokenizer import stdlib_docstrings, train_bpe, write_corpus_jsonl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument(
        "--output-dir", default=str(REPO_ROOT / "data" / "gpt"), help="where vocab.json and merges.txt go"
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens incl. 256 bytes and <|endoftext|>")
    p.add_argument("--input", default=None, help="text/JSON-lines corpus (default: stdlib docstrings)")
    p.add_argument("--json-key", default="text", help="key of the text in JSON lines")
    p.add_argument(
        "--max-files", type=int, default=None, help="stdlib: read only this many files (fast tests)"
    )
    args = p.parse_args(argv)
    t0 = time.time()
    out = Path(args.output_dir)
    if args.input is None:
        texts = list(stdlib_docstrings(max_files=args.max_files))
        n = write_corpus_jsonl(out / "stdlib_docstrings.jsonl", iter(texts))
        print(f"> corpus: {n} docstrings of the Python standard library -> {out / 'stdlib_docstrings.jsonl'}")
    else:
        texts = list(read_documents(args.input, args.json_key))
        print(f"> corpus: {len(texts)} documents from {args.input}")
    try:
        vocab, merges = train_bpe(texts, out, args.vocab_size)
    except ValueError as exc:
        print(f"train_tokenizer.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"> byte-level BPE, vocab size {args.vocab_size}: {vocab}, {merges} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a GPT-2-style byte-level BPE offline; write vocab.json + merges.txt (+ the corpus).

The corpus is the docstrings of the Python standard library (every machine has it, no download);
it is also written as JSON lines so that ``preprocess_data.py`` can turn it into a dataset::

    python code/train_tokenizer.py --output-dir data/gpt --vocab-size 4096
    # -> data/gpt/vocab.json, data/gpt/merges.txt, data/gpt/stdlib_docstrings.jsonl

Train on your own text instead with ``--input corpus.jsonl`` (key ``--json-key``) or ``--input a.txt``.

The kinds of Megatron's ``--tokenizer-type`` that read a ``--tokenizer-model``, from the same text::

    python code/train_tokenizer.py --tokenizer-type SentencePieceTokenizer --output-dir data/gpt/sp
    # -> data/gpt/sp/tokenizer.model   (--tokenizer-type Llama2Tokenizer --tokenizer-model data/gpt/sp/tokenizer.model)
    python code/train_tokenizer.py --tokenizer-type HuggingFaceTokenizer --output-dir data/gpt/hf
    # -> data/gpt/hf/tokenizer.json    (--tokenizer-type HuggingFaceTokenizer --tokenizer-model data/gpt/hf)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from preprocess_data import read_documents

from distlab import REPO_ROOT
from distlab.gpt.data.tokenizer import stdlib_docstrings, train_bpe, write_corpus_jsonl
from distlab.gpt.data.tokenizers import save_hf_tokenizer, train_sentencepiece


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument(
        "--output-dir", default=str(REPO_ROOT / "data" / "gpt"), help="where vocab.json and merges.txt go"
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens incl. 256 bytes and <|endoftext|>")
    p.add_argument("--input", default=None, help="text/JSON-lines corpus (default: stdlib docstrings)")
    p.add_argument("--json-key", default="text", help="key of the text in JSON lines")
    p.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=["GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"],
        help="vocab.json + merges.txt, a sentencepiece tokenizer.model (also Llama2Tokenizer's), "
        "or a tokenizer.json folder",
    )
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
        if args.tokenizer_type == "SentencePieceTokenizer":
            written, what = train_sentencepiece(texts, out, args.vocab_size), "sentencepiece BPE"
        elif args.tokenizer_type == "HuggingFaceTokenizer":
            written, what = (
                save_hf_tokenizer(texts, out, args.vocab_size) + "/tokenizer.json",
                "byte-level BPE",
            )
        else:
            written, what = ", ".join(train_bpe(texts, out, args.vocab_size)), "byte-level BPE"
    except ValueError as exc:
        print(f"train_tokenizer.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"> {what}, vocab size {args.vocab_size}: {written} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

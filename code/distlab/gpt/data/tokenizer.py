"""GPT-2-style byte-level BPE: trained offline, stored as ``vocab.json`` + ``merges.txt``.

A byte-level BPE maps any text to ids without unknown tokens: text -> UTF-8 bytes -> 256 base
symbols -> merges learnt greedily from pair frequencies. GPT-2 ships exactly these two files;
Megatron's ``--vocab-file``/``--merge-file`` take them. So that no machine needs a download, the
default corpus is the docstrings of the Python standard library, which every Python has.

The end-of-document token is ``<|endoftext|>`` as in GPT-2.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer, Tokenizer

EOD_TOKEN = "<|endoftext|>"


def stdlib_docstrings(max_files: int | None = None, min_chars: int = 40) -> Iterator[str]:
    """Docstrings of the standard library's ``.py`` files, in sorted path order (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.parts))
    for path in files[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    yield doc


def write_corpus_jsonl(path: str | os.PathLike, texts: Iterator[str]) -> int:
    """Write one ``{"text": ...}`` per line; return the number of documents."""
    n = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
            n += 1
    return n


def train_bpe(texts: list[str], out_dir: str | os.PathLike, vocab_size: int = 4096) -> tuple[str, str]:
    """Train a byte-level BPE on ``texts``; write ``vocab.json`` and ``merges.txt``; return their paths."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} must exceed the 256 byte symbols + {EOD_TOKEN}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN], show_progress=False
    )
    tok.save_model(str(out))
    return str(out / "vocab.json"), str(out / "merges.txt")


class TokenizersLibrary:
    """Ids in, ids out through a ``tokenizers`` object ``self._tok`` (set by the subclass)."""

    _tok: Tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: the post-processor's (a bos, say); False for a chat template's
        text, which writes its own."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class GPT2BPETokenizer(TokenizersLibrary):
    """Load ``vocab.json`` + ``merges.txt`` with ``tokenizers``; ids in, ids out."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        for p in (vocab_file, merge_file):
            if not os.path.exists(p):
                raise FileNotFoundError(f"{p} does not exist: run code/train_tokenizer.py to create it")
        self._tok = ByteLevelBPETokenizer(vocab_file, merge_file, add_prefix_space=False)
        self.eod = self._tok.token_to_id(EOD_TOKEN)
        if self.eod is None:
            raise ValueError(f"{vocab_file} has no {EOD_TOKEN} token")

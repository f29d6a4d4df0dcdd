"""Megatron's --tokenizer-type kinds built offline: sentencepiece (SentencePieceTokenizer,
GPTSentencePieceTokenizer, Llama2Tokenizer), HuggingFace's tokenizer.json and NullTokenizer
round-trip text and end documents with their eod; train_tokenizer.py and preprocess_data.py
make and use them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distlab import REPO_ROOT
from distlab.gpt.data.indexed_dataset import IndexedDataset
from distlab.gpt.data.tokenizer import stdlib_docstrings
from distlab.gpt.data.tokenizers import (
    HuggingFaceTokenizer,
    TokenizerSpec,
    save_hf_tokenizer,
    train_sentencepiece,
)

pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(120)]
TEXT = "Return the sum of x and  y.\n\tSee also: math.fsum(12345) -- ü € 😀"


@pytest.fixture(scope="module")
def texts():
    return list(stdlib_docstrings(max_files=40))


@pytest.fixture(scope="module")
def sp_model(texts, tmp_path_factory):
    return train_sentencepiece(texts, tmp_path_factory.mktemp("sp"), vocab_size=512)


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece_round_trips_text(kind, sp_model):
    tok = TokenizerSpec(kind, tokenizer_model=sp_model).build()
    ids = tok.tokenize(TEXT)
    assert tok.vocab_size == 512 and tok.eod == 2  # <unk> 0, <s> 1, </s> 2
    assert tok.detokenize(ids) == TEXT  # byte fallback, no normalisation: nothing lost
    assert max(ids) < 512 and len(ids) < len(TEXT.encode())  # merges learnt: fewer ids than bytes
    assert tok.tokenize_batch([TEXT, "x"]) == [ids, tok.tokenize("x")]


def test_huggingface_tokenizer_from_a_folder(texts, tmp_path):
    folder = save_hf_tokenizer(texts, tmp_path / "hf", vocab_size=512)
    tok = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=folder).build()
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    assert tok.eod == tok._tok.token_to_id("<|endoftext|>") and tok.vocab_size == 512
    alone = HuggingFaceTokenizer(str(tmp_path / "hf" / "tokenizer.json"))  # the file itself
    assert alone.tokenize(TEXT) == tok.tokenize(TEXT)


def test_null_tokenizer_is_megatrons():
    tok = TokenizerSpec("NullTokenizer", vocab_size=100).build()
    assert (tok.vocab_size, tok.eod) == (100, 99)  # Megatron's default eod: vocab size - 1
    assert tok.tokenize("5 7 9") == [5, 7, 9] and tok.detokenize([5, 7, 9]) == "5 7 9"


def script(name: str, *argv: str) -> int:
    """Run ``code/<name>.py`` as the course runs it; its exit code."""
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "code" / f"{name}.py"), *argv], timeout=120
    ).returncode


def test_train_tokenizer_and_preprocess_with_sentencepiece(texts, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:50]))
    assert script("train_tokenizer", "--tokenizer-type", "SentencePieceTokenizer", "--vocab-size", "400",
                  "--input", str(corpus), "--output-dir", str(tmp_path / "sp")) == 0  # fmt: skip
    model = str(tmp_path / "sp" / "tokenizer.model")
    assert script("preprocess_data", "--input", str(corpus), "--output-prefix", str(tmp_path / "d"),
                  "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model, "--append-eod") == 0  # fmt: skip
    docs = IndexedDataset(str(tmp_path / "d_text_document"))
    tok = TokenizerSpec("Llama2Tokenizer", tokenizer_model=model).build()
    assert len(docs) == 50 and list(docs[3]) == tok.tokenize(texts[3]) + [tok.eod]


def test_train_tokenizer_writes_a_huggingface_folder(texts, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:50]))
    assert script("train_tokenizer", "--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size", "300",
                  "--input", str(corpus), "--output-dir", str(tmp_path / "hf")) == 0  # fmt: skip
    tok = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf")).build()
    assert tok.vocab_size == 300 and tok.detokenize(tok.tokenize(texts[0])) == texts[0]


def test_too_small_a_sentencepiece_vocabulary_is_named(texts, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:50]))
    run = subprocess.run([sys.executable, str(REPO_ROOT / "code" / "train_tokenizer.py"), "--tokenizer-type",
                          "SentencePieceTokenizer", "--vocab-size", "200", "--input", str(corpus), "--output-dir",
                          str(tmp_path / "sp")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "vocab_size 200 must hold the 256 byte pieces" in run.stderr

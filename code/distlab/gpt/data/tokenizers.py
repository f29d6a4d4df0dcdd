"""Megatron's ``--tokenizer-type`` kinds besides GPT-2's BPE (``tokenizer.py``), built offline:

    NullTokenizer              ids are the text's integers ("5 7 9" -> [5, 7, 9]); ``--vocab-size``
                               ids, the last one (``V - 1``) the end of document (Megatron's default)
    SentencePieceTokenizer,    a sentencepiece ``.model`` (``--tokenizer-model``): ids are the model's
    GPTSentencePieceTokenizer, encoding, its ``</s>`` (eos) ends a document, as megatron-core's
    Llama2Tokenizer            sentencepiece library does by default (its ``legacy`` mode, which
                               appended <CLS>, <SEP>, <EOD>, <MASK> pieces, is not built here)
    HuggingFaceTokenizer       ``tokenizer.json`` of the ``tokenizers`` library (a folder holding it,
                               as Megatron's AutoTokenizer.from_pretrained takes a folder); its
                               end-of-sequence token from ``tokenizer_config.json``'s ``eos_token``,
                               else the first of <|endoftext|>, <|end_of_text|>, </s>, <eos> it has

Every tokenizer has ``vocab_size``, ``eod``, ``tokenize``, ``tokenize_batch`` and ``detokenize``.
The course trains its own small sentencepiece and tokenizer.json models on the standard library's
docstrings (:func:`train_sentencepiece`, :func:`save_hf_tokenizer`; ``code/train_tokenizer.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer, Tokenizer

from distlab.gpt.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer, TokenizersLibrary

SENTENCEPIECE_KINDS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
#: The ``--tokenizer-type`` kinds built here (Megatron's others are refused before compute).
TOKENIZERS = ("GPT2BPETokenizer", *SENTENCEPIECE_KINDS, "HuggingFaceTokenizer", "NullTokenizer")
_HF_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class NullTokenizer:
    """Megatron's synthetic tokenizer: text is space-separated ids; eod = ``vocab_size - 1``."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eod = int(vocab_size), int(vocab_size) - 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


class SentencePieceTokenizer:
    """A sentencepiece model; eod is its ``</s>`` (eos) id."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"{model_file} does not exist: run code/train_tokenizer.py")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"{model_file} has no end-of-sequence piece (eos_id -1): train it with one")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


class HuggingFaceTokenizer(TokenizersLibrary):
    """``tokenizer.json`` (``tokenizers.Tokenizer``) from a folder or the file itself."""

    def __init__(self, path: str) -> None:
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path}: no tokenizer.json (nothing is downloaded here)")
        self._tok = Tokenizer.from_file(file)
        config = Path(file).with_name("tokenizer_config.json")
        eos = json.loads(config.read_text()).get("eos_token") if config.exists() else None
        names = [eos] if isinstance(eos, str) else list(_HF_EOS)
        ids = [self._tok.token_to_id(n) for n in names]
        self.eod = next((i for i in ids if i is not None), None)
        if self.eod is None:
            raise ValueError(f"{file} has none of the end-of-sequence tokens {', '.join(names)}")


@dataclass(frozen=True)
class TokenizerSpec:
    """What ``--tokenizer-type`` and its files name (picklable: preprocessing workers build it)."""

    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None

    @classmethod
    def from_args(cls, args) -> TokenizerSpec:
        return cls(
            args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model, args.vocab_size
        )

    def build(self):
        """The tokenizer (``ValueError`` for a kind not built here)."""
        kind = self.tokenizer_type
        if kind == "GPT2BPETokenizer":
            return GPT2BPETokenizer(self.vocab_file, self.merge_file)
        if kind == "NullTokenizer":
            return NullTokenizer(self.vocab_size)
        if kind in SENTENCEPIECE_KINDS:
            return SentencePieceTokenizer(self.tokenizer_model)
        if kind == "HuggingFaceTokenizer":
            return HuggingFaceTokenizer(self.tokenizer_model)
        raise ValueError(f"--tokenizer-type {kind} is not built in this engine")

    def describe(self, tokenizer) -> str:
        """The start-up line: which tokenizer, from which files, its vocabulary and eod."""
        source = {
            "GPT2BPETokenizer": f"{self.vocab_file}, {self.merge_file}",
            "NullTokenizer": f"--vocab-size {self.vocab_size}",
        }.get(self.tokenizer_type, str(self.tokenizer_model))
        return f"> tokenizer: {self.tokenizer_type} ({source}): {tokenizer.vocab_size} tokens, eod {tokenizer.eod}"


def train_sentencepiece(texts: list[str], out_dir: str | os.PathLike, vocab_size: int = 4096) -> str:
    """A BPE sentencepiece model as Llama's (byte fallback: no unknown text, the rarest 0.05% of
    characters as their UTF-8 bytes; digits split; no normalisation, so text round-trips), with
    <unk> 0, <s> 1, </s> 2; returns ``tokenizer.model``. ``ValueError`` when ``vocab_size`` cannot
    hold the 256 bytes, the specials and the corpus' characters."""
    import sentencepiece

    if vocab_size < 256 + 3:
        raise ValueError(f"vocab_size {vocab_size} must hold the 256 byte pieces, <unk>, <s> and </s>")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=0.9995,
            max_sentence_length=1 << 16, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
            minloglevel=2,
        )  # fmt: skip
    except RuntimeError as exc:  # e.g. fewer pieces than the corpus' characters
        raise ValueError(f"sentencepiece could not train a vocabulary of {vocab_size}: {exc}") from None
    return str(out / "tokenizer.model")


def save_hf_tokenizer(texts: list[str], out_dir: str | os.PathLike, vocab_size: int = 4096) -> str:
    """A byte-level BPE as one ``tokenizer.json`` plus ``tokenizer_config.json`` naming its
    end-of-sequence token (what HuggingFace tokenizers ship); returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN], show_progress=False
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOD_TOKEN}) + "\n")
    return str(out)

"""Megatron's data and tokenizer flags (``_add_data_args``, ``_add_tokenizer_args``), one
dataclass each; ``groups.py`` joins them into ``PretrainArgs``."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.arguments.fields import _f

#: Megatron-LM's ``--tokenizer-type`` choices (TokenizerConfig.tokenizer_type).
MEGATRON_TOKENIZERS = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
)


@dataclass
class DataArgs:
    """The dataset (Megatron's ``_add_data_args``)."""

    data_path: str = _f(None, "prefix of the .bin/.idx dataset, e.g. data/gpt/corpus_text_document")
    data_impl: str = _f("mmap", "indexed dataset implementation (only mmap)", choices=["mmap"])
    split: str = _f(
        None,
        "train,validation,test proportions of the documents, e.g. 949,50,1 (with --data-path and none "
        "given: Megatron's legacy 969,30,1, with a warning)",
    )
    seq_length: int = _f(None, "tokens per sample fed to the model (required)")
    mock_data: bool = _f(
        False,
        "no files: Megatron's mock GPT documents (100000 of 1 to 4095 tokens, token j of a document "
        "is j + 1 mod the vocabulary, then the end-of-document token), split, shuffled and cut into "
        "samples as a real dataset",
    )
    data_cache_path: str = _f(
        None, "write the datasets' index arrays (document order, sample shuffle) here and reuse them"
    )
    mmap_bin_files: bool = _f(
        True,
        "memory-map the .bin file (--no-mmap-bin-files: read each document from the file instead)",
        flag="--no-mmap-bin-files",
        action="store_false",
    )
    create_attention_mask_in_dataloader: bool = _f(
        True,
        "Megatron's data loader builds a (T, T) causal mask per sample unless "
        "--no-create-attention-mask-in-dataloader; attention here applies the causal mask itself",
        flag="--no-create-attention-mask-in-dataloader",
        action="store_false",
    )
    num_workers: int = _f(2, "data-loader worker processes (Megatron's torch DataLoader)")


@dataclass
class TokenizerArgs:
    """The tokenizer (Megatron's ``_add_tokenizer_args``)."""

    vocab_size: int = _f(None, "NullTokenizer: the vocabulary size (its last id is the end of document)")
    vocab_file: str = _f(None, "GPT2BPETokenizer: GPT-2-style vocab.json")
    merge_file: str = _f(None, "GPT2BPETokenizer: GPT-2-style merges.txt")
    tokenizer_type: str = _f(
        None,
        "GPT2BPETokenizer (--vocab-file, --merge-file); SentencePieceTokenizer, GPTSentencePieceTokenizer, "
        "Llama2Tokenizer (--tokenizer-model: a sentencepiece .model); HuggingFaceTokenizer "
        "(--tokenizer-model: a folder with tokenizer.json); NullTokenizer (--vocab-size)",
        choices=list(MEGATRON_TOKENIZERS),
    )
    tokenizer_model: str = _f(None, "the tokenizer's model: a sentencepiece .model file or a HF folder")
    tiktoken_pattern: str = _f(None, "TikTokenizer's pre-tokenizer pattern (only TikTokenizer reads it)",
                               choices=["v1", "v2"])  # fmt: skip

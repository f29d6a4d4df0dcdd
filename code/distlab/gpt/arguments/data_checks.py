"""The data source, the tokenizer and the loader's flags, checked before any compute: one data
source (``--data-path`` or ``--mock-data``, as Megatron asserts), the files each tokenizer reads,
and Megatron's tokenizer kinds this engine does not build, refused with the ones it does."""

from __future__ import annotations

import os

from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.data.tokenizers import SENTENCEPIECE_KINDS, TOKENIZERS


def data_errors(args: PretrainArgs) -> list[str]:
    """--data-path or --mock-data (not both); --data-cache-path a folder; --num-workers >= 0."""
    errors = []
    if args.mock_data and args.data_path is not None:
        errors.append(
            f"--mock-data and --data-path {args.data_path} were both given: a run reads one data source "
            f"(Megatron's rule): drop one"
        )
    elif not args.mock_data and args.data_path is None:
        errors.append(
            "--data-path is required: run code/preprocess_data.py first (see its docstring), or train "
            "on --mock-data"
        )
    elif args.data_path is not None and not (
        os.path.exists(args.data_path + ".bin") and os.path.exists(args.data_path + ".idx")
    ):
        errors.append(
            f"--data-path {args.data_path}: no {args.data_path}.bin/.idx; give the prefix "
            f"written by preprocess_data.py (it ends in _text_document)"
        )
    if args.data_cache_path is not None and os.path.isfile(args.data_cache_path):
        errors.append(f"--data-cache-path {args.data_cache_path} is a file: give a folder (it is created)")
    if args.num_workers < 0:
        errors.append(f"--num-workers {args.num_workers} must be >= 0")
    return errors


def tokenizer_errors(args: PretrainArgs) -> list[str]:
    """The files of --tokenizer-type's kind; Megatron's other kinds refused."""
    kind = args.tokenizer_type
    if kind is None:
        return [
            "--tokenizer-type is required (Megatron-LM has no default): GPT2BPETokenizer with --vocab-file "
            "and --merge-file (code/train_tokenizer.py writes them), NullTokenizer with --vocab-size, or "
            f"one of {', '.join(k for k in TOKENIZERS if k not in ('GPT2BPETokenizer', 'NullTokenizer'))} "
            "with --tokenizer-model"
        ]
    if kind not in TOKENIZERS:
        return [
            f"--tokenizer-type {kind}: not built in this engine (a GPT pretraining run here tokenizes with "
            f"one of {', '.join(TOKENIZERS)}): choose one of those"
        ]
    if kind == "GPT2BPETokenizer":
        return [
            f"--{name.replace('_', '-')} {getattr(args, name)} does not exist: run code/train_tokenizer.py"
            for name in ("vocab_file", "merge_file")
            if getattr(args, name) is None or not os.path.exists(getattr(args, name))
        ]
    if kind == "NullTokenizer":
        if args.vocab_size is None or args.vocab_size < 2:
            return [
                f"--tokenizer-type NullTokenizer needs --vocab-size >= 2 (got {args.vocab_size}): its "
                f"ids are 0 .. vocab size - 1, the last one the end of document"
            ]
        return []
    model = args.tokenizer_model
    if kind in SENTENCEPIECE_KINDS and (model is None or not os.path.isfile(model)):
        return [
            f"--tokenizer-type {kind} needs --tokenizer-model FILE, a sentencepiece model (got {model}): "
            f"train one with code/train_tokenizer.py --tokenizer-type SentencePieceTokenizer"
        ]
    if kind == "HuggingFaceTokenizer" and not _hf_tokenizer_json(model):
        return [
            f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model, a folder holding "
            f"tokenizer.json, or that file (got {model}); nothing is downloaded here: save one with "
            f"tokenizers' Tokenizer.save, or code/train_tokenizer.py --tokenizer-type HuggingFaceTokenizer"
        ]
    return []


def _hf_tokenizer_json(model: str | None) -> str | None:
    """The tokenizer.json that --tokenizer-model names (a folder holding it, or the file)."""
    if model is None:
        return None
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
    return path if os.path.isfile(path) else None

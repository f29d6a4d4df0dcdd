"""A transformers checkpoint folder, written from and read into whole course state dicts.

The folder ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read::

    config.json               the family's fields (``families.py``), bos/eos = <|endoftext|>
    generation_config.json    eos = <|endoftext|>; suppress_tokens = the padded ids V_tok .. V - 1
    model.safetensors         transformers' names and layouts (the family's ``to_hf``), fp32; over
                              ``max_shard_size``: shards and their index (``safetensors_shards.py``)
    vocab.json, merges.txt    the course's byte-level BPE, as trained (``data/tokenizer.py``)
    tokenizer.json            the same BPE in ``tokenizers``' one-file form
    tokenizer_config.json     GPT2Tokenizer, <|endoftext|> as bos/eos/unk, no prefix space

(GPT-2 BPE files with transformers' own beside them, e.g. a chat template, and a run's
``--tokenizer-type HuggingFaceTokenizer``: those files copied as they are, ``hf_tokenizer.py``.)

The vocabulary: the course pads V_tok tokens to V rows, a multiple of
``--make-vocab-size-divisible-by`` x tp (Megatron); the rows are kept (``vocab_size`` = V, so the
logits are the course's), and both ``generate.py`` and transformers' ``generate`` (its
``suppress_tokens``) never pick a padded id. Reading, the rows are cut or extended to the V of
the run that will load the checkpoint, extended with copies of the last row as Megatron-LM's
checkpoint converter pads (``tools/checkpoint/saver_base.py``).

:func:`inspect` checks the folder, the configuration against the weights' shapes (safetensors'
header: no weight read) and the tokenizer against the vocabulary before :func:`read_weights`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch
from tokenizers import ByteLevelBPETokenizer

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import model_config
from distlab.gpt.checkpointing.checkpointing import TRACKER
from distlab.gpt.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer
from distlab.gpt.data.tokenizers import TokenizerSpec
from distlab.gpt.inference import families, hf_tokenizer, safetensors_shards
from distlab.gpt.inference.architecture import Architecture, ConversionError, StateDict
from distlab.gpt.inference.course_checkpoint import meta_state_dict
from distlab.gpt.transformer.config import GPTConfig

WEIGHTS = safetensors_shards.WEIGHTS
TOKENIZER_FILES = ("vocab.json", "merges.txt")
CARRIED = ("GPT2BPETokenizer", "HuggingFaceTokenizer")  # the --tokenizer-type kinds written out


def write(folder: str, arch: Architecture, cfg: GPTConfig, args: PretrainArgs, sd: StateDict,
          tokenizer: TokenizerSpec | None, max_shard_size: int | str = safetensors_shards.MAX_SHARD_SIZE) -> bool:  # fmt: skip
    """Write the folder from the whole course state dict ``sd``; its token ids from ``tokenizer``
    (None: none), and its files when it is GPT-2's BPE (the return value: whether they were); the
    weights sharded beyond ``max_shard_size``."""
    os.makedirs(folder, exist_ok=True)
    config = arch.hf_config(cfg, args) | {"torch_dtype": "float32"}
    generation: dict = {}
    if tokenizer is not None:
        tok = tokenizer.build()
        check_vocabulary(tok.vocab_size, cfg.vocab_size, "the checkpoint's tokenizer")
        config |= {"bos_token_id": tok.eod, "eos_token_id": tok.eod}
        generation = {"bos_token_id": tok.eod, "eos_token_id": tok.eod, "pad_token_id": tok.eod,
                      "suppress_tokens": list(range(tok.vocab_size, cfg.vocab_size)) or None}  # fmt: skip
    files = tokenizer is not None and tokenizer.tokenizer_type in CARRIED
    if files and tokenizer.tokenizer_type == "HuggingFaceTokenizer":
        hf_tokenizer.copy(hf_tokenizer.folder_of(tokenizer.tokenizer_model), folder)
    elif files:  # sentencepiece models are not converted yet
        _write_tokenizer(folder, (tokenizer.vocab_file, tokenizer.merge_file), cfg.max_position_embeddings)
    _write_json(os.path.join(folder, "config.json"), config)
    _write_json(os.path.join(folder, "generation_config.json"), generation)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in arch.to_hf(sd, cfg).items()}
    safetensors_shards.write(folder, tensors, max_shard_size)
    return files


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def copy_tokenizer(files: tuple[str, str], folder: str) -> tuple[str, str]:
    """vocab.json and merges.txt copied into ``folder`` (unless there already); their new paths."""
    out = tuple(os.path.join(folder, name) for name in TOKENIZER_FILES)
    for src, dst in zip(files, out, strict=True):
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
    return out  # type: ignore[return-value]


def _write_tokenizer(folder: str, files: tuple[str, str], max_length: int) -> None:
    copy_tokenizer(files, folder)
    if hf_tokenizer.copy(hf_tokenizer.folder_of(files[0]), folder):  # transformers' own files beside them
        return
    ByteLevelBPETokenizer(*files, add_prefix_space=False).save(os.path.join(folder, "tokenizer.json"))
    _write_json(os.path.join(folder, "tokenizer_config.json"), {
        "tokenizer_class": "GPT2Tokenizer", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN,
        "unk_token": EOD_TOKEN, "add_prefix_space": False, "model_max_length": max_length})  # fmt: skip


def check_vocabulary(tokens: int, rows: int, what: str) -> None:
    """The tokenizer's ``tokens`` ids must all have a row of the ``rows``-row embedding."""
    if tokens > rows:
        raise ConversionError(
            f"{what} has {tokens} tokens but the embedding has {rows} rows (vocab_size): the "
            f"tokenizer is not this model's; give the one it was trained with (--vocab-file, --merge-file)"
        )


@dataclass
class HFCheckpoint:
    """A checked transformers folder: its family, configuration, course arguments and tokenizer."""

    folder: str
    arch: Architecture
    config: dict
    course_args: dict  # the family's course_args(config)
    tokenizer_files: tuple[str, str] | None
    shapes: dict[str, tuple[int, ...]]  # every tensor in the weight files, from their headers
    files: dict[str, str]  # every tensor's file: model.safetensors, or its shard


def inspect(folder: str, tokenizer_files: tuple[str, str] | None = None) -> HFCheckpoint:
    """Check ``folder`` (see the module docstring); read no weight."""
    if not os.path.isdir(folder):
        raise ConversionError(f"{folder} is not a folder: give a transformers checkpoint folder")
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        hint = (
            "it is a course checkpoint: convert it with --to hf"
            if os.path.exists(os.path.join(folder, TRACKER))
            else "not a transformers checkpoint folder"
        )
        raise ConversionError(f"{folder} has no config.json: {hint}")
    with open(config_path) as f:
        config = json.load(f)
    arch = families.for_hf(config, config_path)
    course_args = arch.course_args(config)
    weight_files = safetensors_shards.weight_map(folder)
    if weight_files is None:
        present = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".safetensors", ".json")))
        raise ConversionError(
            f"{folder} has neither {WEIGHTS} nor {safetensors_shards.INDEX} (found {present}): the "
            f"converter reads safetensors; save it with model.save_pretrained(folder, safe_serialization=True)"
        )
    shapes = safetensors_shards.shapes(weight_files)  # the headers only
    files = tokenizer_files or tuple(os.path.join(folder, n) for n in TOKENIZER_FILES)
    found = files if all(os.path.exists(p) for p in files) else None
    hf = HFCheckpoint(folder, arch, config, course_args, found, shapes, weight_files)  # type: ignore[arg-type]
    _check_shapes(hf)
    if found is not None:
        check_vocabulary(GPT2BPETokenizer(*found).vocab_size, config["vocab_size"], f"{folder}'s tokenizer")
    return hf


def tied(hf: HFCheckpoint) -> bool:
    """Whether the output layer is E (``tie_word_embeddings``, as the family reads it)."""
    return not hf.course_args.get("untie_embeddings_and_output_weights", False)


def _check_shapes(hf: HFCheckpoint) -> None:
    """Every weight the configuration implies, of its shape, and nothing else (but the buffers the
    family skips); tied output: ``lm_head.weight``, when written, is E's shape."""
    cfg = model_config(PretrainArgs(**hf.course_args), hf.config["vocab_size"])
    expected = {k: tuple(v.shape) for k, v in hf.arch.to_hf(meta_state_dict(cfg), cfg).items()}
    stored = {name: s for k, s in hf.shapes.items() if (name := hf.arch.read_name(k)) is not None}
    copy = stored.pop("lm_head.weight", None) if tied(hf) else None
    wrong = [f"{k}: {stored.get(k, 'missing')} (weights) vs {s} (config)" for k, s in expected.items()
             if stored.get(k) != s]  # fmt: skip
    wrong += [f"{k}: not in the configuration" for k in stored.keys() - expected.keys()]
    if copy is not None and copy != expected[hf.arch.embedding]:
        wrong.append(f"lm_head.weight: {copy} vs the embedding's {expected[hf.arch.embedding]} (tied)")
    if wrong:
        raise ConversionError(
            f"{hf.folder}: config.json does not match {WEIGHTS}: "
            + "; ".join(wrong[:6])
            + (f"; and {len(wrong) - 6} more" if len(wrong) > 6 else "")
        )


def read_weights(hf: HFCheckpoint) -> StateDict:
    """The weights in the names ``to_hf`` gives (a tied ``lm_head.weight`` checked equal to E, then dropped)."""
    names = {k: name for k in hf.files if (name := hf.arch.read_name(k)) is not None}
    sd = {k: v.to(torch.float32) for k, v in safetensors_shards.read(hf.files, names).items()}
    copy = sd.pop("lm_head.weight", None) if tied(hf) else None
    if copy is not None and not torch.equal(copy, sd[hf.arch.embedding]):
        raise ConversionError(
            f"{hf.folder}: lm_head.weight differs from the embedding, but the output is tied"
        )
    return sd


def fit_vocabulary(wte: torch.Tensor, rows: int) -> torch.Tensor:
    """E or the untied output layer (V_hf, H) -> (rows, H): cut, or extended with copies of the
    last row (Megatron-LM's)."""
    if wte.shape[0] >= rows:
        return wte[:rows]
    return torch.cat([wte, wte[-1:].expand(rows - wte.shape[0], -1)])

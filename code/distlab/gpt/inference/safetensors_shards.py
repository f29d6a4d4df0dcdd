"""transformers' weight files: one ``model.safetensors``, or shards with their index.

A published checkpoint of more than ``max_shard_size`` bytes is split (transformers'
``save_pretrained``, through ``huggingface_hub.split_torch_state_dict_into_shards``)::

    model-00001-of-00003.safetensors ... model-00003-of-00003.safetensors
    model.safetensors.index.json      {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}

Shards are filled in the state dict's order, a tensor never split; one tensor larger than the limit
gets a shard of its own. The default limit here is ``"5GB"``, huggingface_hub's ``MAX_SHARD_SIZE``
(transformers 4's default; transformers 5's ``save_pretrained`` writes up to ``"50GB"``). Readers
take either form: :func:`weight_map` says which file holds each tensor, from the headers only.
"""

from __future__ import annotations

import json
import os
import re

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from distlab.gpt.inference.architecture import ConversionError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PATTERN = "model{suffix}.safetensors"  # huggingface_hub's: {suffix} is "-00001-of-00003" or ""
MAX_SHARD_SIZE = "5GB"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")


def weight_map(folder: str) -> dict[str, str] | None:
    """Each tensor's name -> the path of the file that holds it; None when the folder has neither
    ``model.safetensors`` nor an index. Shards the index names but the folder lacks are refused."""
    single, index = os.path.join(folder, WEIGHTS), os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            names = json.load(f).get("weight_map")
        if not isinstance(names, dict) or not names:
            raise ConversionError(f"{index} has no weight_map: it is no safetensors index")
        missing = sorted({s for s in names.values() if not os.path.exists(os.path.join(folder, s))})
        if missing:
            raise ConversionError(f"{index} names shards the folder lacks: {', '.join(missing)}")
        return {k: os.path.join(folder, s) for k, s in names.items()}
    if os.path.exists(single):
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    return None


def shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the files' headers (no weight read)."""
    out = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            out |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if files.get(k) == path}
    return out


def read(files: dict[str, str], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` maps (stored name -> name wanted), file by file."""
    out = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                if k in names and files.get(k) == path:
                    out[names[k]] = f.get_tensor(k)
    return out


def write(
    folder: str, tensors: dict[str, torch.Tensor], max_shard_size: int | str = MAX_SHARD_SIZE
) -> list[str]:
    """``tensors`` into ``model.safetensors``, or into shards and their index when they exceed
    ``max_shard_size`` (bytes, or "5GB", "200MB", "10KB"); the weight files of an earlier write to
    ``folder`` are removed first (transformers would read a stale single file before an index).
    Returns the files' names."""
    try:
        split = split_torch_state_dict_into_shards(
            tensors, filename_pattern=PATTERN, max_shard_size=max_shard_size
        )
    except ValueError as exc:
        raise ConversionError(f"--max-shard-size {max_shard_size}: {exc}") from None
    for name in os.listdir(folder):
        if name in (WEIGHTS, INDEX) or _SHARD.match(name):
            os.remove(os.path.join(folder, name))
    for file, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(folder, file), metadata={"format": "pt"})
    if not split.is_sharded:
        return list(split.filename_to_tensors)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return [*split.filename_to_tensors, INDEX]

"""A transformers tokenizer's files, carried between checkpoints, and its chat template.

What Llama 3, Mixtral and Qwen ship beside the weights (``AutoTokenizer.from_pretrained`` reads it)::

    tokenizer.json            the whole tokenizer (``tokenizers``' one-file form): required
    tokenizer_config.json     its class, special tokens and, in published checkpoints, chat_template
    special_tokens_map.json   bos / eos / unk / pad (older transformers write it)
    chat_template.jinja       the chat template, where transformers >= 4.43 saves it
    chat_template.json        the same, in the form of transformers 4.4x's processors

They are copied byte for byte, both ways (``convert_checkpoint.py``): a course run reads the copy
as ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <folder>``. The chat template is
Jinja, rendered here as transformers renders it (a sandbox, ``trim_blocks`` and ``lstrip_blocks``,
``messages``, ``add_generation_prompt`` and the special tokens as variables).
"""

from __future__ import annotations

import json
import os
import shutil

from distlab.gpt.inference.architecture import ConversionError

FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def check_given(**paths: str | None) -> None:
    """Each tokenizer path given on the command line (``vocab_file="..."``) must exist: refused by
    its flag's name before any work."""
    missing = [f"--{k.replace('_', '-')} {p}" for k, p in paths.items() if p and not os.path.exists(p)]
    if missing:
        raise ConversionError(f"{', '.join(missing)}: no such file or folder")


def folder_of(path: str) -> str:
    """A tokenizer given as its folder or as its ``tokenizer.json``: the folder."""
    return path if os.path.isdir(path) else os.path.dirname(path) or "."


def files_in(folder: str) -> list[str]:
    """The tokenizer files ``folder`` holds (none unless it has ``tokenizer.json``)."""
    present = [n for n in FILES if os.path.isfile(os.path.join(folder, n))]
    return present if "tokenizer.json" in present else []


def copy(src: str, dst: str) -> list[str]:
    """The tokenizer files of folder ``src`` copied into ``dst`` (unless the same folder)."""
    names = files_in(src)
    os.makedirs(dst, exist_ok=True)
    for name in names:
        if os.path.abspath(os.path.join(src, name)) != os.path.abspath(os.path.join(dst, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return names


def _config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def chat_template(folder: str) -> str | None:
    """The folder's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``, else ``chat_template.json``); of a list of named templates, "default"."""
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    template = _config(folder).get("chat_template")
    if template is None and os.path.isfile(legacy := os.path.join(folder, "chat_template.json")):
        with open(legacy) as f:
            template = json.load(f).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # AddedToken as a dict


def render_chat(folder: str, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``messages`` ([{"role": "user", "content": ...}]) through the folder's chat template, as
    ``tokenizer.apply_chat_template(..., tokenize=False)``; refused where there is none."""
    template = chat_template(folder)
    if template is None:
        raise ConversionError(
            f"--chat: {folder} has no chat template (chat_template.jinja, or chat_template in "
            f"tokenizer_config.json): give --prompt without --chat"
        )
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ConversionError(f"--chat: the chat template refuses the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    config = _config(folder)
    special = {k: _token(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special
    )

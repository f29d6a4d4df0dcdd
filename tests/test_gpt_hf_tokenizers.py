"""A transformers tokenizer travels with the checkpoint both ways: ``tokenizer.json``,
``tokenizer_config.json`` (its chat template inside, as published checkpoints ship it) and
``special_tokens_map.json`` are copied in, a course run reads the copy (HuggingFaceTokenizer),
and the export is a folder ``AutoTokenizer.from_pretrained`` loads with the same template and ids.
``generate.py --chat`` renders the template as transformers does; tokenizer paths that do not exist
are refused by name before any work. The tokenizer is built here with ``tokenizers`` (offline)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distlab.gpt.inference import course_checkpoint
from tests.conftest import entry_script

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: tokenizer and model are built here
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
convert_checkpoint, generate_py = entry_script("convert_checkpoint"), entry_script("generate")
pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(120)]

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(folder) -> int:
    """A byte-level BPE of 260 ids (256 bytes + 4 specials) with a bos-adding post-processor, saved
    as a published checkpoint ships it; returns its vocabulary size."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=260,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["a tiny corpus"], trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    os.makedirs(folder, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": SPECIAL[0], "eos_token": SPECIAL[1]}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny transformers Llama with the tokenizer beside it -> course release checkpoint."""
    root = tmp_path_factory.mktemp("tok")
    vocab = write_tokenizer(root / "hf")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    argv = ["--from", "hf", "--load", str(root / "hf"), "--save", str(root / "course"),
            "--make-vocab-size-divisible-by", "4"]  # fmt: skip
    assert convert_checkpoint.main(argv) == 0
    return root


def test_the_tokenizer_travels_in_and_out(converted):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (converted / "course" / name).read_bytes() == (converted / "hf" / name).read_bytes(), name
    args = course_checkpoint.inspect(str(converted / "course")).args
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model == str(converted / "course")

    out = ["--to", "hf", "--load", str(converted / "course"), "--save", str(converted / "out")]
    assert convert_checkpoint.main(out) == 0
    original = transformers.AutoTokenizer.from_pretrained(converted / "hf")
    again = transformers.AutoTokenizer.from_pretrained(converted / "out")
    assert again.chat_template == original.chat_template == TEMPLATE
    chat = [{"role": "user", "content": "a tiny question"}]
    assert again.apply_chat_template(chat, add_generation_prompt=True) == original.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert again("a tiny corpus").input_ids == original("a tiny corpus").input_ids
    config = json.loads((converted / "out" / "config.json").read_text())
    assert config["eos_token_id"] == original.eos_token_id


def test_generate_chat_applies_the_template(converted, capsys):
    theirs = transformers.AutoTokenizer.from_pretrained(converted / "hf")
    chat = [{"role": "user", "content": "a tiny question"}]
    text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    argv = ["--load", str(converted / "course"), "--prompt", "a tiny question", "--max-new-tokens", "4"]
    assert generate_py.main([*argv, "--chat", "--repeat", "1"]) == 0
    printed = capsys.readouterr().out
    assert text.startswith("<|begin_of_text|><|im_start|>user\n") and text in printed
    assert "<|begin_of_text|><|begin_of_text|>" not in printed  # the template's bos only


def test_generate_chat_is_refused_without_a_template(converted, tmp_path, capsys):
    argv = ["--load", str(converted / "course"), "--chat", "--max-new-tokens", "4"]
    assert generate_py.main([*argv, "--prompt-ids", "1 2"]) == 2
    assert "--chat takes --prompt TEXT" in capsys.readouterr().err
    config = converted / "course" / "tokenizer_config.json"
    kept = config.read_text()
    try:
        config.write_text(json.dumps({k: v for k, v in json.loads(kept).items() if k != "chat_template"}))
        assert generate_py.main([*argv, "--prompt", "hi"]) == 2
        assert "has no chat template" in capsys.readouterr().err
    finally:
        config.write_text(kept)


@pytest.mark.parametrize(
    "way,flags,named",
    [
        ("from", ["--vocab-file", "/nonexistent", "--merge-file", "/nonexistent-too"], "--vocab-file /nonexistent"),
        ("from", ["--tokenizer-model", "/nonexistent"], "--tokenizer-model /nonexistent"),
        ("to", ["--tokenizer-model", "/nonexistent"], "--tokenizer-model /nonexistent"),
        ("to", ["--vocab-file", "/nonexistent", "--merge-file", "/nonexistent-too"], "--merge-file /nonexistent-too"),
        ("generate", ["--vocab-file", "/nonexistent", "--merge-file", "/nonexistent-too"], "--vocab-file /nonexistent"),
    ],
)  # fmt: skip
def test_a_tokenizer_path_that_does_not_exist_is_refused_by_name(
    converted, tmp_path, capsys, no_weights_read, way, flags, named
):
    source = {"from": converted / "hf", "to": converted / "course", "generate": converted / "course"}[way]
    if way == "generate":
        assert generate_py.main(["--load", str(source), "--prompt", "hi", *flags]) == 2
    else:
        argv = [f"--{way}", "hf", "--load", str(source), "--save", str(tmp_path / "o"), *flags]
        assert convert_checkpoint.main(argv) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

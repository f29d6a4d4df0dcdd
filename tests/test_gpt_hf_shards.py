"""Sharded safetensors, as published checkpoints are: a tiny Llama that transformers saves in
shards with ``model.safetensors.index.json`` converts in with transformers' logits, and the
converter's export beyond ``--max-shard-size`` is shards with their index that transformers loads
back to the same weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distlab.gpt.inference import course_checkpoint, safetensors_shards
from tests.conftest import entry_script

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: the model is built here
transformers = pytest.importorskip("transformers")
convert_checkpoint = entry_script("convert_checkpoint")
pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(120)]

VOCAB = 128  # a multiple of --make-vocab-size-divisible-by 128: no padding, no tokenizer needed
SHARD = "20KB"  # E alone is 128 x 32 x 4 bytes = 16 KB: the ~80 KB model takes several shards


def saved_sharded(folder) -> torch.nn.Module:
    """transformers' own tiny Llama, random (norms too), saved by ``save_pretrained`` in shards."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size=SHARD)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


def shards(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def test_sharded_llama_in_and_out(tmp_path):
    hf = saved_sharded(tmp_path / "hf")
    assert (tmp_path / "hf" / safetensors_shards.INDEX).exists() and len(shards(tmp_path / "hf")) > 1
    argv = ["--from", "hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "course")]
    assert convert_checkpoint.main(argv) == 0
    model = course_checkpoint.read_model(course_checkpoint.inspect(str(tmp_path / "course")))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), hf(tokens()).logits, rtol=0, atol=1e-5)

    out = ["--to", "hf", "--load", str(tmp_path / "course"), "--save", str(tmp_path / "out")]
    assert convert_checkpoint.main([*out, "--max-shard-size", SHARD]) == 0
    index = json.loads((tmp_path / "out" / safetensors_shards.INDEX).read_text())
    written = shards(tmp_path / "out")
    assert len(written) > 1 and "model.safetensors" not in written
    assert sorted(set(index["weight_map"].values())) == written
    assert all(os.path.getsize(tmp_path / "out" / n) < 20_000 + 1_000 for n in written)  # + the header
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    theirs = hf.state_dict()
    assert again.state_dict().keys() == theirs.keys()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name

    # the default limit (5GB) writes one file again, and the shards of the earlier export go
    assert convert_checkpoint.main(out) == 0
    assert shards(tmp_path / "out") == ["model.safetensors"]
    assert not (tmp_path / "out" / safetensors_shards.INDEX).exists()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_an_index_naming_a_missing_shard_is_refused(tmp_path, capsys):
    saved_sharded(tmp_path / "hf")
    os.remove(tmp_path / "hf" / shards(tmp_path / "hf")[-1])
    argv = ["--from", "hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "course")]
    assert convert_checkpoint.main(argv) == 2
    err = capsys.readouterr().err
    assert "model.safetensors.index.json names shards the folder lacks" in err
    assert not (tmp_path / "course").exists()

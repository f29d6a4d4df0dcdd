"""Bad input to convert_checkpoint.py and generate.py is refused with a clear error before any
weight is read (the readers of weights raise if they are reached): a folder that is no
checkpoint, an architecture transformers lacks or the converter does not know, a configuration
that does not match the weights, a vocabulary mismatch, a prompt longer than the positions."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from distlab import REPO_ROOT
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.data.tokenizers import TokenizerSpec
from distlab.gpt.inference import course_checkpoint, gpt2, hf_checkpoint
from distlab.gpt.moe.moe_layer import MoEConfig
from distlab.gpt.tools.local_run import prepare_data
from distlab.gpt.transformer.model import GPTConfig, GPTModel

os.environ["HF_HUB_OFFLINE"] = "1"


def _script(name: str):
    """An entry script of code/ as a module (called in this process, so that the tests can see
    which functions it reaches)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "code" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert_checkpoint, generate = _script("convert_checkpoint"), _script("generate")
pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=300, max_files=20)


@pytest.fixture
def no_weights_read(monkeypatch):
    """Reaching a weight fails the test: every error must come before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the input was refused")

    monkeypatch.setattr(hf_checkpoint, "read_weights", refuse)
    monkeypatch.setattr(course_checkpoint, "read_model", refuse)


@pytest.fixture(scope="module")
def hf_folder(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    cfg = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=384, max_position_embeddings=16
    )
    args = PretrainArgs(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16)
    spec = TokenizerSpec("GPT2BPETokenizer", data.vocab_file, data.merge_file)
    hf_checkpoint.write(str(folder), gpt2.GPT2, cfg, args, GPTModel(cfg).state_dict(), spec)
    return folder


@pytest.fixture(scope="module")
def course_folder(hf_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("course")
    assert convert_checkpoint.main(["--from", "hf", "--load", str(hf_folder), "--save", str(folder)]) == 0
    return folder


def edited(hf_folder, tmp_path, **changes):
    """A copy of the transformers folder with config.json's fields changed."""
    folder = tmp_path / "edited"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def convert_fails(capsys, *argv) -> str:
    assert convert_checkpoint.main(list(argv)) == 2
    return capsys.readouterr().err


def test_a_folder_that_is_no_checkpoint(tmp_path, capsys, no_weights_read):
    (tmp_path / "notes.txt").write_text("hello")
    err = convert_fails(capsys, "--from", "hf", "--load", str(tmp_path), "--save", str(tmp_path / "o"))
    assert "has no config.json: not a transformers checkpoint folder" in err
    err = convert_fails(capsys, "--to", "hf", "--load", str(tmp_path), "--save", str(tmp_path / "o"))
    assert f"has no {checkpointing.TRACKER}: not a course checkpoint" in err
    err = convert_fails(
        capsys, "--to", "hf", "--load", str(tmp_path / "missing"), "--save", str(tmp_path / "o")
    )
    assert "is not a folder" in err


def test_the_two_kinds_of_folder_are_told_apart(hf_folder, course_folder, tmp_path, capsys, no_weights_read):
    err = convert_fails(capsys, "--to", "hf", "--load", str(hf_folder), "--save", str(tmp_path))
    assert "it is a transformers folder: convert it with --from hf" in err
    err = convert_fails(capsys, "--from", "hf", "--load", str(course_folder), "--save", str(tmp_path))
    assert "it is a course checkpoint: convert it with --to hf" in err


def test_an_architecture_transformers_lacks(hf_folder, tmp_path, capsys, no_weights_read):
    folder = edited(hf_folder, tmp_path, model_type="gpt5000", architectures=["GPT5000ForCausalLM"])
    err = convert_fails(capsys, "--from", "hf", "--load", str(folder), "--save", str(tmp_path / "o"))
    assert "model_type 'gpt5000' is not an architecture transformers has" in err


def test_an_architecture_the_converter_does_not_know(hf_folder, tmp_path, capsys, no_weights_read):
    folder = edited(hf_folder, tmp_path, model_type="bert", architectures=["BertForMaskedLM"])
    err = convert_fails(capsys, "--from", "hf", "--load", str(folder), "--save", str(tmp_path / "o"))
    assert "model_type 'bert'" in err and "a transformers architecture the converter does not know" in err


def test_a_function_the_course_does_not_compute(hf_folder, tmp_path, capsys, no_weights_read):
    folder = edited(hf_folder, tmp_path, activation_function="gelu_new")
    err = convert_fails(capsys, "--from", "hf", "--load", str(folder), "--save", str(tmp_path / "o"))
    assert "'activation_function': 'gelu_new'" in err and "exact GeLU" in err


@pytest.mark.parametrize("change", [{"n_embd": 64}, {"n_layer": 3}, {"vocab_size": 512}, {"n_inner": 64}])
def test_a_config_that_does_not_match_the_weights(hf_folder, tmp_path, capsys, no_weights_read, change):
    folder = edited(hf_folder, tmp_path, **change)
    err = convert_fails(capsys, "--from", "hf", "--load", str(folder), "--save", str(tmp_path / "o"))
    assert "config.json does not match model.safetensors" in err


def test_a_course_checkpoint_that_does_not_match_its_arguments(course_folder, tmp_path, capsys):
    folder = tmp_path / "course"
    shutil.copytree(course_folder, folder)
    path = folder / "release" / "mp_rank_00" / "model_optim_rng.pt"
    ckpt = torch.load(path, weights_only=False)
    ckpt["args"]["hidden_size"] = 64
    torch.save(ckpt, path)
    err = convert_fails(capsys, "--to", "hf", "--load", str(folder), "--save", str(tmp_path / "o"))
    assert "does not match its arguments" in err and "wpe.weight" in err


def test_a_vocabulary_mismatch(hf_folder, tmp_path, capsys, no_weights_read):
    folder = edited(hf_folder, tmp_path)
    big = prepare_data(tmp_path / "big", vocab_size=600, max_files=20)  # 600 tokens > 384 rows
    err = convert_fails(capsys, "--from", "hf", "--load", str(folder), "--save", str(tmp_path / "o"),
                        "--vocab-file", big.vocab_file, "--merge-file", big.merge_file)  # fmt: skip
    assert "tokens but the embedding has 384 rows" in err


def test_a_prompt_longer_than_the_positions(course_folder, capsys, no_weights_read):
    assert generate.main(["--load", str(course_folder), "--prompt-ids", " ".join(["7"] * 17)]) == 2
    assert "exceed the model's 16 positions" in capsys.readouterr().err
    argv = ["--load", str(course_folder), "--prompt-ids", "1 2 3", "--max-new-tokens", "14"]
    assert generate.main(argv) == 2
    assert "ask for at most 13 new tokens" in capsys.readouterr().err
    assert generate.main(["--load", str(course_folder), "--prompt-ids", "1 999"]) == 2
    assert "--prompt-ids [999] are not ids of the vocabulary [0, 300)" in capsys.readouterr().err


def test_a_course_model_the_converter_does_not_know(tmp_path, capsys, no_weights_read):
    """A mixture of experts (no transformers family for it yet) is refused, by generate.py too."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
                    max_position_embeddings=16, moe=MoEConfig(num_experts=2))  # fmt: skip
    args = PretrainArgs(
        num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16, num_experts=2
    )
    course_checkpoint.write_release(str(tmp_path / "moe"), args, cfg, GPTModel(cfg).state_dict())
    err = convert_fails(capsys, "--to", "hf", "--load", str(tmp_path / "moe"), "--save", str(tmp_path / "o"))
    assert "no converter knows this course model" in err and "--num-experts 2" in err
    assert generate.main(["--load", str(tmp_path / "moe"), "--prompt-ids", "1 2"]) == 2
    assert "no converter knows this course model" in capsys.readouterr().err


def test_a_target_layout_that_does_not_split_the_model(hf_folder, tmp_path, capsys, no_weights_read):
    err = convert_fails(capsys, "--from", "hf", "--load", str(hf_folder), "--save", str(tmp_path),
                        "--target-tensor-parallel-size", "3", "--target-pipeline-parallel-size", "4")  # fmt: skip
    assert "heads 4 not divisible by --target-tensor-parallel-size 3" in err
    assert "layers 2 not divisible by --target-pipeline-parallel-size 4" in err

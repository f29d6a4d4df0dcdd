"""Bad input to convert_checkpoint.py and generate.py is refused with a clear error before any
weight is read (the readers of weights raise if they are reached): a folder that is no
checkpoint, an architecture transformers lacks or the converter does not know, a configuration
that does not match the weights, a vocabulary mismatch, a prompt longer than the positions."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import model_config
from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.data.tokenizers import TokenizerSpec
from distlab.gpt.inference import course_checkpoint, gpt2, hf_checkpoint, llama, mixtral
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.gpt.transformer.moe.moe_layer import MoEConfig
from distlab.local_runs import prepare_data
from tests.conftest import entry_script

os.environ["HF_HUB_OFFLINE"] = "1"


convert_checkpoint, generate = entry_script("convert_checkpoint"), entry_script("generate")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=300, max_files=20)


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
    folder = edited(hf_folder, tmp_path, activation_function="relu")
    err = convert_fails(capsys, "--from", "hf", "--load", str(folder), "--save", str(tmp_path / "o"))
    assert "'activation_function': 'relu'" in err and "exact GeLU or its tanh approximation" in err


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
    """A GeLU mixture of experts with biases (neither GPT-2 nor Mixtral) is refused, by generate.py
    too, each family naming the flags the run lacks."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
                    max_position_embeddings=16, moe=MoEConfig(num_experts=2))  # fmt: skip
    args = PretrainArgs(
        num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16, num_experts=2
    )
    course_checkpoint.write_release(str(tmp_path / "moe"), args, cfg, GPTModel(cfg).state_dict())
    err = convert_fails(capsys, "--to", "hf", "--load", str(tmp_path / "moe"), "--save", str(tmp_path / "o"))
    assert "no converter knows this course model" in err
    assert "GPT (GPT-2 architecture) needs no --num-experts (the run has num_experts 2)" in err
    assert "Llama-MoE (Mixtral architecture) needs --normalization RMSNorm" in err and "--swiglu" in err
    assert generate.main(["--load", str(tmp_path / "moe"), "--prompt-ids", "1 2"]) == 2
    assert "no converter knows this course model" in capsys.readouterr().err


LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
             ffn_hidden_size=48, max_position_embeddings=16, position_embedding_type="rope", normalization="RMSNorm",
             swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True)  # fmt: skip


def test_a_llama_run_transformers_cannot_express(tmp_path, capsys, no_weights_read):
    """(--apply-layernorm-1p is expressed: 1 + the stored gamma, tests/test_gpt_hf_llama.py.)"""
    extra, flag = (
        {"num_experts": 2, "moe_expert_capacity_factor": 1.0},
        "needs no --moe-expert-capacity-factor (dropless)",
    )
    args = PretrainArgs(**LLAMA, **extra)
    course_checkpoint.write_release(str(tmp_path / "c"), args, model_config(args, 128), {})
    err = convert_fails(capsys, "--to", "hf", "--load", str(tmp_path / "c"), "--save", str(tmp_path / "o"))
    assert "no converter knows this course model" in err and flag in err


@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory) -> dict:
    """A transformers folder of each family, from a course model (its initial weights)."""
    folders = {}
    for arch, extra in ((llama.LLAMA, {}), (mixtral.MIXTRAL, {"num_experts": 2})):
        args = PretrainArgs(**LLAMA, **extra)
        cfg = model_config(args, 128)
        folders[arch.model_type] = tmp_path_factory.mktemp(arch.model_type)
        hf_checkpoint.write(str(folders[arch.model_type]), arch, cfg, args, GPTModel(cfg).state_dict(), None)
    return folders


BOTH = ("llama", "mixtral")
CANNOT = [  # (families, config.json change, error); attention_bias is Llama's field, sliding_window Mixtral's
    (("llama",), {"attention_bias": True}, "attention_bias True (the course computes no bias"),
    (BOTH, {"hidden_act": "gelu"}, "hidden_act 'gelu' (the course computes SwiGLU's silu"),
    (
        BOTH,
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        "rope_type 'linear'",
    ),
    (
        BOTH,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4 + 0.5}},
        "an integer --rotary-base",
    ),
    (BOTH, {"num_key_value_heads": 4}, "config.json does not match model.safetensors"),
    (("mixtral",), {"sliding_window": 8}, "sliding_window 8 positions"),
]


@pytest.mark.parametrize(
    "family,change,error",
    [(f, change, error) for families, change, error in CANNOT for f in families],
    ids=[f"{f}-{next(iter(change))}" for families, change, _ in CANNOT for f in families],
)
def test_a_llama_the_course_cannot_compute(
    llama_folders, tmp_path, capsys, no_weights_read, family, change, error
):
    folder = edited(llama_folders[family], tmp_path, **change)
    err = convert_fails(capsys, "--from", "hf", "--load", str(folder), "--save", str(tmp_path / "o"))
    assert error in err, err


def test_a_target_layout_that_does_not_split_the_model(hf_folder, tmp_path, capsys, no_weights_read):
    err = convert_fails(capsys, "--from", "hf", "--load", str(hf_folder), "--save", str(tmp_path),
                        "--target-tensor-parallel-size", "3", "--target-pipeline-parallel-size", "4")  # fmt: skip
    assert "--target-tensor-parallel-size 3 x --target-pipeline-parallel-size 4 does not split" in err
    assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" in err
    assert "--num-layers 2 is not divisible by --pipeline-model-parallel-size 4" in err

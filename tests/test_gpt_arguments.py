"""Argument parsing and validation of pretrain_gpt.py: Megatron names, clear messages before compute."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distlab import REPO_ROOT
from distlab.gpt.arguments import parse_args, parse_split, validate_args
from distlab.gpt.arguments.samples import evaluations_during_training

pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(60)]


@pytest.fixture
def files(tmp_path):
    for name in ("vocab.json", "merges.txt", "d.bin", "d.idx"):
        (tmp_path / name).write_text("")
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp_path / "vocab.json"),
        "--merge-file",
        str(tmp_path / "merges.txt"),
        "--data-path",
        str(tmp_path / "d"),
    ]


BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
]


def check(argv, world=4):
    args = parse_args(argv)
    return args, validate_args(args, world)


def test_valid_command_fills_megatron_defaults(files):
    args, dims = check([*BASE, *files, "--local-rank", "3", "--profile-execution", "True", "--profile-step-start", "1",
                        "--profile-step-end", "3"])  # fmt: skip
    assert (dims.dp, dims.tp, dims.pp) == (4, 1, 1)
    assert args.max_position_embeddings == 32 and args.lr_decay_iters == 10 and args.profile_execution
    args, _ = check([*BASE, *files, "--local_rank=1", "--profile-execution", "False", "--fp16"])
    assert args.local_rank == 1 and not args.profile_execution and args.fp16


def test_validation_without_an_eval_interval_runs_only_at_the_end(files):
    """Megatron's --eval-interval has no default: no validation during training, one at the end;
    --split, also without a default, becomes Megatron's legacy 969,30,1."""
    args, _ = check([*BASE, *files])
    assert (args.eval_interval, evaluations_during_training(args), args.split) == (None, 0, "969,30,1")
    args, _ = check([*BASE, *files, "--eval-interval", "3"])
    assert evaluations_during_training(args) == 3  # iterations 3, 6 and 9 of 10


def test_a_run_names_its_tokenizer(files):
    """--tokenizer-type has no default (Megatron's): a run without it is refused, naming the kinds."""
    argv = [*BASE, *files[2:]]  # without --tokenizer-type GPT2BPETokenizer
    with pytest.raises(
        ValueError, match="--tokenizer-type is required .* GPT2BPETokenizer with --vocab-file"
    ):
        check(argv)


def test_fp32_residual_connection_reaches_the_model_and_the_pipeline(files):
    """Megatron's flag, default off: the residual stream in the --bf16 / --fp16 dtype, which the
    pipeline's stages exchange; with it, fp32 (GPTConfig's field, Precision's residual dtype)."""
    from distlab.gpt.arguments.to_configs import model_config, precision_config

    for extra, flag, residual in (
        ([], False, torch.bfloat16),
        (["--fp32-residual-connection"], True, torch.float32),
    ):
        args, _ = check([*BASE, *files, "--bf16", *extra])
        assert (
            args.fp32_residual_connection is flag and model_config(args, 256).fp32_residual_connection is flag
        )
        precision = precision_config(args)
        assert precision.residual_dtype == residual
        assert precision.describe(torch.device("cpu")).endswith(
            "residual stream in fp32 (--fp32-residual-connection)" if flag else "residual stream in bf16"
        )
    args, _ = check([*BASE, *files, "--fp16", "--fp32-residual-connection"])
    assert precision_config(args).residual_dtype == torch.float32
    args, _ = check([*BASE, *files])
    assert precision_config(args).residual_dtype == torch.float32 and not args.fp32_residual_connection


def test_unknown_argument_is_named(files, capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, *files, "--num-layer", "3"])
    assert "unrecognized arguments: --num-layer" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (
            ["--global-batch-size", "12"],
            4,
            "--global-batch-size 12 is not divisible by --micro-batch-size 2 x data-parallel size 4 = 8",
        ),
        (["--fp16", "--bf16"], 4, "--fp16 and --bf16 were both given"),
        (
            ["--fp32-residual-connection"],
            4,
            "--fp32-residual-connection without --bf16 or --fp16: an fp32 run's residual stream is fp32 "
            "already",
        ),
        (["--num-attention-heads", "3"], 4, "--hidden-size 64 is not divisible by --num-attention-heads 3"),
        (
            ["--tensor-model-parallel-size", "8"],
            8,
            "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8",
        ),
        (
            ["--pipeline-model-parallel-size", "3"],
            3,
            "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3",
        ),
        (
            ["--tensor-model-parallel-size", "3"],
            4,
            "world size 4 is not divisible by tensor-model-parallel size 3",
        ),
        (["--max-position-embeddings", "16"], 4, "--seq-length 32 exceeds --max-position-embeddings 16"),
        (["--min-lr", "0.1"], 4, "--min-lr 0.1 is above --lr 0.001"),
        (["--save-interval", "5"], 4, "--save-interval 5 was given without --save"),
        (["--split", "a,b"], 4, "--split 'a,b' must be numbers"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], 4, "choose one"),
        (
            ["--profile-execution", "True", "--train-iters", "2"],
            4,
            "--profile-step-start 10 and --profile-step-end 12 need 1 <= start < end <= --train-iters 2",
        ),
        (
            ["--profile-execution", "True", "--profile-step-start", "3", "--profile-step-end", "3"],
            4,
            "--profile-step-start 3 and --profile-step-end 3 need 1 <= start < end",
        ),
        (["--zero-stage", "2"], 4, "--zero-stage was given without --deepspeed"),
        (
            ["--deepspeed", "--tensor-model-parallel-size", "2"],
            4,
            "--deepspeed runs data parallelism only: got --tensor-model-parallel-size 2",
        ),
        (["--deepspeed", "--bf16"], 4, "--deepspeed runs in fp32 in this course"),
        (["--deepspeed", "--zero-stage", "4"], 4, "ZeRO stage 4 must be 0, 1, 2 or 3"),
        (["--device-memory-gib", "0"], 4, "--device-memory-gib 0.0 must be > 0"),
        (
            ["--profile-ranks", "0", "4"],
            4,
            "--profile-ranks 0 4: ranks [4] not in world size 4: name ranks 0 to 3",
        ),
    ],
)
def test_contradictions_are_refused_with_values(files, extra, world, message):
    with pytest.raises(ValueError) as err:
        check([*BASE, *files, *extra], world)
    assert message in str(err.value)


def test_missing_data_names_the_fix(tmp_path):
    with pytest.raises(ValueError) as err:
        check(
            [*BASE, "--data-path", str(tmp_path / "nope"), "--vocab-file", "v.json", "--merge-file", "m.txt"]
        )
    text = str(err.value)
    assert (
        f"{tmp_path / 'nope'}.bin/.idx" in text
        and "preprocess_data.py" in text
        and "train_tokenizer.py" in text
    )


def test_required_arguments_are_listed():
    with pytest.raises(ValueError, match="--num-layers is required; --hidden-size is required"):
        check(["--lr", "1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of nccl without a GPU")
def test_nccl_without_gpu_is_refused(files):
    with pytest.raises(ValueError, match="--distributed-backend nccl: backend 'nccl' needs CUDA GPUs"):
        check([*BASE, *files, "--distributed-backend", "nccl"])


def test_split():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("9,1") == pytest.approx([0.9, 0.1, 0.0])


def test_entry_script_fails_before_compute(files):
    out = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "code" / "pretrain_gpt.py"),
            *BASE,
            *files,
            "--global-batch-size",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--global-batch-size 3 is not divisible by --micro-batch-size 2" in out.stderr
    assert "iteration" not in out.stdout


def test_deepspeed_batch_rule_checked_before_compute(files, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text('{"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}')
    with pytest.raises(ValueError) as err:
        check([*BASE, *files, "--deepspeed", "--deepspeed_config", str(config)], 4)
    assert "train_batch_size 12 must equal train_micro_batch_size_per_gpu 2" in str(err.value)
    config.write_text('{"zero_optimization": {"stage": 1}}')
    args, dims = check(
        [*BASE, *files, "--deepspeed", "--deepspeed_config", str(config), "--zero-stage", "2"], 4
    )
    assert (args.deepspeed, args.zero_stage, dims.dp) == (True, 2, 4)

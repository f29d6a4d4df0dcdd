"""Megatron's flags of the Llama 3 / Mixtral example scripts, one by one: each refused flag's
message (what, why, instead), the sample-based schedule against the iteration-based one,
--decoupled-lr's parameters, --manual-gc, --grad-reduce-in-bf16's reduction, --no-load-optim /
--no-load-rng, --log-throughput's field."""

from __future__ import annotations

import gc

import pytest
import torch

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.arguments.implementations import implementation_lines
from distlab.gpt.arguments.to_configs import (
    checkpoint_config,
    housekeeping_config,
    lr_schedule,
    optimizer_config,
)
from distlab.gpt.distributed.grad_buckets import GradBuckets
from distlab.gpt.layout import Layout
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training import housekeeping
from distlab.gpt.training.log import ITERATION, iteration_line
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 --lr 1e-3"
)
MOCK = "--mock-data --tokenizer-type NullTokenizer --vocab-size 64"
BASE = f"{MODEL} {MOCK} --train-iters 4".split()


def check(argv: list[str], world: int = 1):
    args = parse_args(argv)
    return args, validate_args(args, world)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fp8-format", "hybrid"],
         "--fp8-format hybrid: FP8 GEMMs run in NVIDIA Transformer Engine's layers on Hopper (sm_90)"),
        (["--fp8-amax-history-len", "1024", "--fp8-param-gather"],
         "--fp8-amax-history-len 1024 --fp8-param-gather: FP8 GEMMs"),
        (["--fp8-amax-compute-algo", "max"], "drop the --fp8-* flags and train in --bf16"),
        (["--overlap-param-gather", "--overlap-grad-reduce"],
         "--overlap-param-gather is only supported with the distributed optimizer"),
        (["--use-distributed-optimizer", "--overlap-param-gather"],
         "--overlap-param-gather must be used with --overlap-grad-reduce"),
        (["--wandb-project", "p", "--wandb-exp-name", "x"],
         "--wandb-project p --wandb-exp-name x: Weights & Biases is not installed"),
        (["--tokenizer-type", "TikTokenizer"], "--tokenizer-type TikTokenizer: not built in this engine"),
        (["--tokenizer-type", "BertWordPieceCase"], "choose one of those"),
        (["--transformer-impl", "inference_optimized"], "inference-only layers cannot train"),
        (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
         "use --cross-entropy-fusion-impl native or omit --cross-entropy-loss-fusion"),
        (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 without --bf16"),
        (["--bf16", "--grad-reduce-in-bf16", "--use-torch-fsdp2"], "those back ends reduce the gradients"),
        (["--use-pytorch-profiler"], "--use-pytorch-profiler was given without --profile"),
        (["--data-path", "x"], "--mock-data and --data-path x were both given"),
        (["--train-samples", "8"], "give one of --train-iters (iterations) and --train-samples (samples): both"),
        (["--lr-decay-samples", "8"], "--lr-decay-samples 8 with --train-iters 4"),
        (["--lr-warmup-samples", "2"], "--lr-warmup-samples 2 with --train-iters 4"),
        (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr 1e-05 was given without --decoupled-lr"),
        (["--decoupled-lr", "1e-5", "--decoupled-min-lr", "1e-4"], "--decoupled-min-lr 0.0001 is above"),
        (["--vocab-size", "1"], "NullTokenizer needs --vocab-size >= 2 (got 1)"),
        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/no/such.model"],
         "--tokenizer-type Llama2Tokenizer needs --tokenizer-model FILE"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model, a folder holding tokenizer.json"),
        (["--manual-gc-interval", "-1"], "--manual-gc-interval -1 must be >= 0"),
        (["--num-workers", "-1"], "--num-workers -1 must be >= 0"),
    ],
)  # fmt: skip
def test_refused_with_the_flag_why_and_instead(extra, message):
    with pytest.raises(ValueError) as err:
        check([*BASE, *extra])
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "give one of --train-iters (iterations) and --train-samples (samples): neither was given"),
        (["--train-samples", "8", "--lr-decay-iters", "2"], "--lr-decay-iters 2 with --train-samples 8"),
        (["--train-samples", "8", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "2"],
         "--lr-warmup-fraction 0.1 and --lr-warmup-samples 2 were both given"),
        (["--train-samples", "8", "--global-batch-size", "2", "--rampup-batch-size", "1", "1", "4"],
         "--train-samples 8 with a batch-size ramp"),
        (["--train-samples", "3", "--global-batch-size", "4"], "is less than one global batch of 4"),
        (["--train-samples", "0"], "--train-samples 0 must be positive"),
    ],
)  # fmt: skip
def test_sample_based_flags_refused(extra, message):
    with pytest.raises(ValueError) as err:
        check(f"{MODEL} {MOCK}".split() + extra)
    assert message in str(err.value)


def test_sample_schedule_equals_iteration_schedule():
    """--train-samples / --lr-decay-samples / --lr-warmup-samples = iterations x global batch give
    the iteration-based run's length and learning rates (Megatron counts both in samples)."""
    common = f"{MODEL} {MOCK} --global-batch-size 4 --lr-decay-style cosine --min-lr 1e-4".split()
    it, _ = check([*common, "--train-iters", "10", "--lr-decay-iters", "8", "--lr-warmup-iters", "2"])
    sa, _ = check([*common, "--train-samples", "40", "--lr-decay-samples", "32", "--lr-warmup-samples", "8"])
    assert sa.train_iters == it.train_iters == 10
    lrs = [lr_schedule(it)(i) for i in range(1, 11)]
    assert [lr_schedule(sa)(i) for i in range(1, 11)] == pytest.approx(lrs, rel=1e-12)
    assert lrs[1] == pytest.approx(1e-3) and lrs[7] == pytest.approx(1e-4) and lrs[0] < lrs[1] > lrs[4]
    fr_it, _ = check(
        [*common, "--train-iters", "10", "--lr-decay-iters", "8", "--lr-warmup-fraction", "0.25"]
    )
    fr_sa, _ = check(
        [*common, "--train-samples", "42", "--lr-decay-samples", "32", "--lr-warmup-fraction", "0.25"]
    )
    assert fr_sa.train_iters == 10  # Megatron: train samples // global batch
    assert [lr_schedule(fr_sa)(i) for i in range(1, 11)] == pytest.approx(
        [lr_schedule(fr_it)(i) for i in range(1, 11)]
    )


def _model(args) -> GPTModel:
    cfg = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64, max_position_embeddings=16
    )
    return GPTModel(cfg, ParallelState(Layout(1), rank=0))


def test_decoupled_lr_is_the_word_embedding_and_output_layer():
    args, _ = check([*BASE, "--lr-warmup-iters", "1", "--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5",
                     "--min-lr", "1e-5", "--lr-decay-style", "linear"])  # fmt: skip
    model = _model(args)
    opt = build_optimizer(model, optimizer_config(args))
    names = {id(p): n for n, p in model.named_parameters()}
    decoupled = [names[id(p)] for g in opt.param_groups if g["max_lr"] == 5e-4 for p in g["params"]]
    assert decoupled == ["wte.weight"]  # E, also the output layer here (tied); not the position table
    schedule = lr_schedule(args)
    for iteration, (run_lr, e_lr) in ((1, (1e-3, 5e-4)), (4, (1e-5, 4.5e-5))):  # warm-up end, decay end
        assert schedule.apply(opt, iteration) == pytest.approx(run_lr)
        by_name = {names[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]}
        assert by_name["wte.weight"] == pytest.approx(e_lr) and by_name["wpe.weight"] == pytest.approx(run_lr)
    plain, _ = check(BASE)
    assert {g["max_lr"] for g in build_optimizer(_model(plain), optimizer_config(plain)).param_groups} == {
        1e-3
    }


def test_manual_gc_collects_only_where_megatron_does():
    args, _ = check([*BASE, "--manual-gc", "--manual-gc-interval", "2"])
    config = housekeeping_config(args)
    collections = []
    gc.callbacks.append(collect := lambda phase, info: collections.append(phase == "start"))
    try:
        housekeeping.start_manual_gc(config)
        assert not gc.isenabled() and collections.count(True) == 1
        housekeeping.collect_after_step(config, 1)
        assert collections.count(True) == 1
        housekeeping.collect_after_step(config, 2)
        housekeeping.collect_around_validation(config)
        assert collections.count(True) == 3
    finally:
        housekeeping.stop_manual_gc(config)
        gc.callbacks.remove(collect)
    assert gc.isenabled()
    off, _ = check([*BASE, "--manual-gc", "--no-manual-gc-eval"])
    assert not off.manual_gc_eval


def _bf16_reduce(ctx, reduce_dtype):
    state = ParallelState.build(Layout(ctx.world_size))
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0 + 2**-10, 3.0, 2.0**-20]) * (ctx.rank + 1)  # not all bf16 numbers
    buckets = GradBuckets([p], state, bucket_size=100, overlap=False, reduce_dtype=reduce_dtype)
    buckets.finish()
    base = torch.tensor([1.0 + 2**-10, 3.0, 2.0**-20])
    exact = (base + 2 * base) / 2  # fp32: the average of the two ranks' gradients
    in_bf16 = ((base.bfloat16() + (2 * base).bfloat16()) / 2).float()  # rounded on the way, summed in bf16
    assert not torch.equal(exact, in_bf16)  # 1 + 2^-10 is not a bf16 number: the two differ
    expected = exact if reduce_dtype is None else in_bf16
    assert p.grad.dtype == torch.float32 and torch.equal(p.grad, expected), (p.grad, expected)


@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16], ids=["fp32", "grad-reduce-in-bf16"])
def test_grad_reduce_in_bf16_reduces_in_bf16(reduce_dtype):
    run_gloo(_bf16_reduce, 2, reduce_dtype)


def test_log_throughput_field_and_start_up_lines():
    line = iteration_line(iteration=3, train_iters=8, consumed_samples=12, elapsed_ms=10.0, lr=1e-3,
                          global_batch_size=4, loss=2.0, loss_scale=1.0, grad_norm=0.5, skipped=0, nan=0,
                          tokens_per_s=10.0, tflops_per_device=1.25, mfu=None, throughput=1.25)  # fmt: skip
    assert (
        "| elapsed time per iteration (ms): 10.0 | throughput per GPU (TFLOP/s/GPU): 1.2 | learning rate:"
        in line
    )
    assert ITERATION.parse(line)[0]["throughput"] == 1.2
    args, _ = check([*BASE, "--use-mcore-models", "--no-masked-softmax-fusion", "--calculate-per-token-loss",
                     "--no-create-attention-mask-in-dataloader", "--tiktoken-pattern", "v2", "--profile"])  # fmt: skip
    said = "\n".join(implementation_lines(args, cuda=False))
    for flag in ("--transformer-impl transformer_engine (Megatron's default)", "--use-mcore-models: deprecated",
                 "--no-masked-softmax-fusion", "--calculate-per-token-loss", "--no-create-attention-mask",
                 "--num-workers 2", "--tiktoken-pattern v2: read by TikTokenizer only",
                 "no CUDA here, nothing is captured"):  # fmt: skip
        assert flag in said, flag
    local, _ = check([*BASE, "--transformer-impl", "local"])
    assert "> --transformer-impl local: the local layers run" in implementation_lines(local, cuda=False)[0]
    traced, _ = check(
        [*BASE, "--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3"]
    )
    assert traced.profile_execution  # Megatron's torch.profiler is this engine's --profile-execution


def _load_flags(ctx, root: str, fmt: str) -> None:
    from distlab.gpt.arguments import PretrainArgs
    from distlab.gpt.checkpointing import checkpointing, dist_checkpointing
    from distlab.gpt.checkpointing.checkpointing import Snapshot

    module = dist_checkpointing if fmt == "torch_dist" else checkpointing
    state = ParallelState.build(Layout(1))
    model = GPTModel(GPTConfig(1, 16, 2, 32, 8, seed=3), state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).mean().backward()
    opt.step()  # Adam moments to save
    shape = dict(
        num_layers=1, hidden_size=16, num_attention_heads=2, max_position_embeddings=8, ckpt_format=fmt
    )
    module.save_checkpoint(
        checkpoint_config(PretrainArgs(save=root, **shape)), state, Snapshot(model, opt, {"scale": 8.0}, 1, 4)
    )
    after_save = torch.rand(3)  # the generator's next numbers as saved
    for no_optim, no_rng in ((True, True), (False, False)):
        fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
        args = PretrainArgs(load=root, no_load_optim=no_optim, no_load_rng=no_rng, **shape)
        iteration, consumed, scaler = module.load_checkpoint(checkpoint_config(args), state, model, fresh)
        assert (iteration, consumed) == (1, 4)  # --no-load-optim keeps the iteration and the samples
        assert (len(fresh.state) == 0) == no_optim and (scaler is None) == no_optim, (no_optim, scaler)
        assert torch.equal(torch.rand(3), after_save) != no_rng  # the saved stream, unless --no-load-rng


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_no_load_optim_and_no_load_rng(fmt, tmp_path):
    run_gloo(_load_flags, 1, str(tmp_path / "ckpt"), fmt)


def test_exit_duration_in_mins_stops_and_saves(tmp_path):
    """--exit-duration-in-mins: every rank stops at the same iteration once the time is up, and
    the run saves there (with --save), as Megatron's training loop does."""
    from distlab.local_runs import spawn_pretrain

    argv = [*BASE, "--train-iters", "50", "--exit-duration-in-mins", "1e-6", "--save", str(tmp_path / "ckpt")]
    run = spawn_pretrain(argv, 2, tmp_path / "run")
    assert [h["iteration"] for h in run.histories] == [1, 1]  # 50 asked, stopped after the first
    assert "exiting program after" in run.log and "at iteration 1" in run.log
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

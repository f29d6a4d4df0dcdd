"""--use-distributed-optimizer (Megatron's ZeRO-1): the same training as the plain optimizer, with
fp32 main parameters and Adam's moments sharded over dp x cp.

A tiny GPT (4 layers, hidden 32) trains 3 AdamW steps on global batches of 16 samples (b 2, dp 4,
m 2): with the distributed optimizer, --overlap-grad-reduce and --overlap-param-gather and small
buckets (8 of them, so the reduce-scatters and the chain of all-gathers really interleave with
backward and forward), its fp32 losses equal one process's (m 8) within 1e-5 and its parameters
equal the non-overlapped distributed run's bit for bit; dp 2 x tp 2 with sequence parallelism
equals one process too; so does interleaved pipelining (pp 2 x dp 2, v = 2: each model chunk
its own buckets) in losses, norms and fp32 parameters; bf16 against the plain optimizer's bf16;
fp16 (fp16 gradient buffer, loss scaling on the shards, an inf on one rank's shard skipping the
step on all) against the plain optimizer's fp16 on one process within fp16's rounding, and through
the driver with interleaved pipelining (fp16 activations between the stages); each rank's
parameters, gradient buffer and optimizer state are Megatron's bytes per parameter exactly (fp32,
bf16, bf16 with bf16 gradients, fp16), and what the memory estimator predicts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import estimate
from distlab.gpt.memory.setup import MemorySetup
from distlab.gpt.optimizer.distrib_optimizer import (
    DistributedOptimizer,
    build_distributed_optimizer,
    bytes_per_parameter,
)
from distlab.gpt.optimizer.loss_scaler import DynamicLossScaler
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel.p2p_communication import P2PSpec
from distlab.gpt.pipeline_parallel.schedules import PipelineForwardBackward
from distlab.gpt.training.training import LocalBackend, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_ranks import free_port, spawn_ranks
from tests.conftest import TINY_GPT_ARGV, run_gloo, train_plan

pytestmark = pytest.mark.timeout(180)

CFG = GPTConfig(
    num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16
)
B, M, STEPS, T = 2, 2, 3, 16  # micro batch b, micro-batches m per rank, steps, sequence length
BUCKET = 5000  # elements: about half a block (12 H^2 + 13 H = 12704) per bucket
OPTIM = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95)  # Adam


def _data() -> torch.Tensor:
    """Every step's global batch: (STEPS, 16, T + 1) tokens."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, CFG.vocab_size, (STEPS, B * 4 * M, T + 1), generator=gen)  # 16 samples a step


def distributed(
    model: GPTModel, state: ParallelState, dtype=torch.float32, overlap=False, bf16_grads=False, config=OPTIM
):
    """``build_distributed_optimizer`` with ``config`` in :data:`BUCKET`-element buckets (and both
    overlaps, or neither)."""
    ddp = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        bucket_size=BUCKET,
        grad_reduce_in_bf16=bf16_grads,
    )
    return build_distributed_optimizer(model, state, config, ddp, dtype)


def _train(
    state: ParallelState,
    dp: int,
    *,
    distopt: bool,
    overlap=False,
    dtype=torch.float32,
    autocast=None,
    scaler: DynamicLossScaler | None = None,
    pipeline: PipelineForwardBackward | None = None,
    config: OptimizerConfig = OPTIM,
    inf_at_first_step: bool = False,
):
    """STEPS steps of this rank's micro-batches (through ``pipeline`` when given): the losses,
    {name: parameter} (the fp32 main ones with the distributed optimizer), the optimizer, the model,
    overlap seen, the norms, the steps skipped. ``inf_at_first_step``: data-parallel rank 0 gives E's gradient
    an inf in the first step (one element: after the reduce-scatter, on one rank's shard only)."""
    model = GPTModel(CFG, state)
    opt = (
        distributed(model, state, dtype, overlap, config=config)
        if distopt
        else build_optimizer(model, config)
    )
    backend = LocalBackend(model, opt, state, clip_grad=1.0, bucket_size=BUCKET, scaler=scaler)
    seen = []  # bucket 0's reduce-scatter in flight when wte's gradient is accumulated
    if distopt and state.pp == 1:
        model.wte.weight.register_post_accumulate_grad_hook(
            lambda _p: seen.append(opt.buffer.buckets[0].grad_work is not None)
        )
    step = 0
    if inf_at_first_step and state.dp_rank == 0:
        model.wte.weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if step == 0 else g
        )
    data, r, losses, norms, skipped = _data(), state.dp_rank, [], [], []
    mine = [range(k * B * dp + r * B, k * B * dp + (r + 1) * B) for k in range(M * 4 // dp)]
    for step in range(STEPS):  # the hook above reads it
        batches = [(data[step, s, :-1], data[step, s, 1:]) for s in mine]  # (b, T) each
        kwargs = {"autocast": autocast} if autocast else {}
        if pipeline is not None:
            kwargs["forward_backward_fn"] = pipeline
        result = train_step(backend, batches, state=state, **kwargs)
        losses.append(result.loss)
        norms.append(result.grad_norm)  # Adam ignores a gradient's scale: the norm does not
        skipped.append(bool(result.skipped))
        if distopt and overlap and not skipped[-1]:
            assert opt.buffer.pending, "no all-gather left for the next forward to wait for"
    if distopt:
        opt.buffer.finish_param_sync()
    params = (
        main_parameters(model, opt)
        if distopt
        else {n: p.detach().clone() for n, p in model.named_parameters()}
    )
    return SimpleNamespace(
        losses=losses, params=params, opt=opt, model=model, seen=seen, norms=norms, skipped=skipped
    )


def main_parameters(model: GPTModel, opt) -> dict[str, torch.Tensor]:
    """The distributed optimizer's fp32 main parameters, whole (its shards all-gathered), by name."""
    names, out = {p: name for name, p in model.named_parameters()}, {}
    for bucket, main in zip(opt.buffer.buckets, opt.main, strict=True):
        whole = main
        if bucket.d > 1:
            whole = main.new_empty(bucket.shard_size * bucket.d)  # (S d,)
            dist.all_gather_single(whole, main, group=bucket.group)
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            out[names[p]] = whole[offset : offset + p.numel()].view(p.shape).clone()
    return out


def _dp4_rank(ctx) -> None:
    state = ParallelState.build(Layout(4))
    run = _train(state, 4, distopt=True, overlap=True)
    plain = _train(state, 4, distopt=True, overlap=False)
    assert run.losses == plain.losses and all(torch.equal(run.params[k], plain.params[k]) for k in run.params)
    assert run.seen == [False, True] * STEPS, run.seen  # overlapped in the last micro-batch's backward
    ref = _train(ParallelState(Layout(1), rank=0), 1, distopt=False)  # m = 8 on one process
    _assert_same_training(run, ref, tol=1e-5)


def _assert_same_training(run: SimpleNamespace, ref: SimpleNamespace, tol: float) -> None:
    """A run's losses, gradient norms and parameters (this rank's stage's, by global name; the last
    stage's copy of E is E) against one process's within ``tol``; the steps moved them by far more."""
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=0, atol=tol)
    torch.testing.assert_close(torch.tensor(run.norms), torch.tensor(ref.norms), rtol=tol, atol=0)
    for name, p in run.params.items():
        other = ref.params["wte.weight" if name == "output_weight" else name]
        torch.testing.assert_close(p, other, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    fresh = dict(GPTModel(CFG, ParallelState(Layout(1), rank=0)).named_parameters())
    moved = max((ref.params[k] - fresh[k]).abs().max() for k in fresh)
    assert moved > 100 * tol, "the steps did not move the parameters: the comparison proves nothing"


def test_dp4_both_overlaps_equal_one_process() -> None:
    run_gloo(_dp4_rank, 4, timeout_s=150)


def _dp2_tp2_rank(ctx) -> None:
    state = ParallelState.build(Layout(4, tp=2, sequence_parallel=True))
    run = _train(state, 2, distopt=True, overlap=True)
    ref = _train(ParallelState(Layout(1), rank=0), 1, distopt=False)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(run.norms), torch.tensor(ref.norms), rtol=1e-5, atol=0)


def test_dp2_tp2_sequence_parallel_equals_one_process() -> None:
    run_gloo(_dp2_tp2_rank, 4, timeout_s=150)


#: (parameters, --grad-reduce-in-bf16, the gradient buffer, bytes per parameter per rank at d = 4)
BYTES = [
    (torch.float32, False, torch.float32, 10.0),  # 8 + 8/4
    (torch.bfloat16, False, torch.float32, 9.0),  # 6 + 12/4
    (torch.bfloat16, True, torch.bfloat16, 8.0),  # 4 + 16/4
    (torch.float16, False, torch.float16, 8.0),  # 4 + 16/4, Megatron's fp16 row
]


def _bytes_rank(ctx) -> None:
    state = ParallelState.build(Layout(4))
    for dtype, bf16_grads, grad_dtype, expected in BYTES:
        model = GPTModel(CFG, state)
        opt = distributed(model, state, dtype, bf16_grads=bf16_grads)
        backend = LocalBackend(model, opt, state, clip_grad=1.0)
        tokens = torch.randint(
            0, CFG.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(state.rank)
        )
        train_step(backend, [(tokens[:, :-1], tokens[:, 1:])], state=state)  # Adam's moments now exist
        n = sum(b.numel for b in opt.buffer.buckets)
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in opt.buffer.buckets)
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in opt.buffer.buckets)
        shard = sum(b.shard_size for b in opt.buffer.buckets)
        assert sum(b.param_data.numel() for b in opt.buffer.buckets) == n == 4 * shard, "no padding here"
        pieces = sum(piece.numel() for _, _, piece, _ in opt.pieces)  # this rank's elements
        assert pieces == shard == n // 4 and opt.buffer.buckets[0].grad_data.dtype == grad_dtype
        main = (
            4 * shard * ((dtype != torch.float32) + (grad_dtype != torch.float32))
        )  # fp32 copies of half ones
        assert opt.state_bytes() == main + 8 * pieces  # + exp_avg and exp_avg_sq, fp32
        per_param = (params + grads + opt.state_bytes()) / n
        assert per_param == bytes_per_parameter(dtype, 4, grad_dtype) == expected, (
            dtype,
            grad_dtype,
            per_param,
        )
        precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        setup = MemorySetup(num_layers=CFG.num_layers, hidden_size=CFG.hidden_size, seq_length=T,
                            num_attention_heads=CFG.num_attention_heads, vocab_size=CFG.vocab_size,
                            micro_batch_size=B, precision=precision, dp=4,
                            distributed_optimizer=True, grad_reduce_in_bf16=bf16_grads)  # fmt: skip
        predicted = estimate(setup)
        assert (predicted.parameters, predicted.gradients, predicted.optimizer_state) == (
            params,
            grads,
            opt.state_bytes(),
        )


def test_bytes_per_parameter_per_rank_are_megatrons() -> None:
    """8 + 8/4 = 10 (fp32), 6 + 12/4 = 9 (bf16), 4 + 16/4 = 8 (bf16 with --grad-reduce-in-bf16, and
    fp16), measured on the buffers and the optimizer's state, and as the memory estimator predicts."""
    run_gloo(_bytes_rank, 4)


def _bf16_rank(ctx) -> None:
    state = ParallelState.build(Layout(4))
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    mine = _train(state, 4, distopt=True, overlap=True, dtype=torch.bfloat16, autocast=autocast).losses
    plain = _train(state, 4, distopt=False, autocast=autocast).losses
    # The distributed optimizer keeps the model's weights in bf16 (Megatron's --bf16: each weight
    # the fp32 main parameter rounded, relative error <= 2^-8); the plain optimizer keeps them in
    # fp32 and autocast rounds them only where it computes (the residual stream is bf16 in both),
    # so the embeddings' sums and the gradients differ by bf16 roundings. Bound: bf16's unit
    # round-off 2^-8, relative (seen: 1e-4 relative after 3 steps; a wrong gradient or update
    # moves the loss by far more).
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(plain), rtol=2**-8, atol=0)
    assert mine != plain, "the same losses: the distributed run did not keep bf16 weights"


def test_bf16_equals_the_plain_optimizers_bf16_within_bf16_rounding() -> None:
    run_gloo(_bf16_rank, 4, timeout_s=150)


def _interleaved_rank(ctx) -> None:
    """pp 2 x dp 2 with v = 2 (chunk c of stage r runs block 2c + r; E on chunk 0 of stage 0, its
    copy on chunk 1 of stage 1), both overlaps, small buckets."""
    state = ParallelState.build(Layout(4, pp=2, vp=2, micro_batch_size=B, global_batch_size=4 * B * M))
    spec = P2PSpec((B, T, CFG.hidden_size), torch.float32, ctx.device)  # (b, T, H) between stages
    pipeline = PipelineForwardBackward(state, spec, chunks=2)
    started = []  # at the end of each step's schedule: which buckets' reduce-scatters had started
    finish = DistributedOptimizer.finalize_gradients

    def recording(self, *args, **kwargs):
        started.append([b.started for b in self.buffer.buckets])
        return finish(self, *args, **kwargs)

    DistributedOptimizer.finalize_gradients = recording
    run = _train(state, 2, distopt=True, overlap=True, pipeline=pipeline)
    DistributedOptimizer.finalize_gradients = finish
    _assert_same_training(run, _train(ParallelState(Layout(1), rank=0), 1, distopt=False), tol=1e-5)
    # Megatron's buffers per model chunk: no bucket holds two chunks' parameters; every bucket but
    # the tied E's (summed over the stages first) started its reduce-scatter during backward
    buckets = run.opt.buffer.buckets
    names = {p: name for name, p in run.model.named_parameters()}  # global names
    chunk_of = {p: int(n.split(".")[1]) // 2 if n.startswith("layers.") else 0 if n.startswith(("wte", "wpe")) else 1
                for p, n in names.items()}  # fmt: skip
    assert all(len({chunk_of[p] for p in b.params}) == 1 for b in buckets)
    assert {chunk_of[p] for b in buckets for p in b.params} == {0, 1}
    held = [i in run.opt.buffer.held for i in range(len(buckets))]
    assert started == [[not h for h in held]] * STEPS, (started, held)


def test_interleaved_pipeline_equals_one_process() -> None:
    """--use-distributed-optimizer with --num-layers-per-virtual-pipeline-stage (Megatron's
    interleaved 1F1B, v = 2): losses and gradient norms of one process within 1e-5, and its fp32
    parameters after 3 steps."""
    run_gloo(_interleaved_rank, 4, timeout_s=150)


#: fp16's test steps with SGD: Adam's first steps are sign(g) per element, so an element whose
#: gradient is near 0 takes +lr or -lr by fp16's rounding alone; SGD's update is proportional to
#: the gradient, so fp16's rounding stays as small in the updates as in the gradients
SGD = dataclasses.replace(OPTIM, optimizer="sgd", lr=0.1, sgd_momentum=0.9)


def _fp16_rank(ctx) -> None:
    """dp 4, fp16 weights, fp16 gradient buffer, loss scale 2^14; in the first step an inf in one
    element of E's gradient on dp rank 0, which the reduce-scatter leaves in one rank's shard."""
    state = ParallelState.build(Layout(4))
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.float16)
    scalers = [DynamicLossScaler(2.0**14, hysteresis=1) for _ in range(2)]
    run = _train(
        state, 4, distopt=True, overlap=True, dtype=torch.float16, autocast=autocast, scaler=scalers[0],
        config=SGD, inf_at_first_step=True,
    )  # fmt: skip
    bucket = run.opt.buffer.buckets[-1]  # E's: the last one, E registered first
    at = next(o for q, o in zip(bucket.params, bucket.offsets, strict=True) if q is run.model.wte.weight)
    owner = at // bucket.shard_size  # the rank whose shard holds E[0, 0]
    assert bucket.grad_data.dtype == torch.float16 and 0 <= owner < 4
    single = ParallelState(Layout(1), rank=0)
    ref = _train(
        single, 1, distopt=False, autocast=autocast, scaler=scalers[1], config=SGD, inf_at_first_step=True
    )
    # every rank skipped the first step (the inf's shard is rank `owner`'s only) and backed off
    assert run.skipped == ref.skipped == [True, False, False], (owner, run.skipped)
    assert scalers[0].scale == scalers[1].scale == 2.0**13
    # fp16 keeps 11 significant bits (2^-11 = 4.9e-4 relative); the losses, norms and updates of
    # the plain optimizer (fp32 weights under fp16 autocast) differ by a few roundings (seen: the
    # losses 1e-6, the norms 2e-5, the updates 3.4e-3 of the largest of their tensor)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=2**-11, atol=0)
    torch.testing.assert_close(torch.tensor(run.norms[1:]), torch.tensor(ref.norms[1:]), rtol=2**-9, atol=0)
    fresh = dict(GPTModel(CFG, single).named_parameters())
    for name, p in run.params.items():
        mine, theirs = p - fresh[name].half().float(), ref.params[name] - fresh[name]  # the updates
        worst = (mine - theirs).abs().max() / theirs.abs().max()
        assert worst < 2**-7, f"{name}: the update differs from one process's by {worst:.1e} of its largest"
    assert min(ref.params[k].sub(fresh[k]).abs().max() for k in fresh) > 1e-5, "some tensor did not move"


def test_fp16_with_loss_scaling_on_the_shards_equals_one_process() -> None:
    """--use-distributed-optimizer with --fp16 (Megatron's fp16 row: fp16 parameters and gradient
    buffer): unscaled and checked for inf / nan on the shards, every rank skips a step that
    overflowed on one, and the training is the plain optimizer's on one process, within fp16's rounding."""
    run_gloo(_fp16_rank, 4, timeout_s=150)


def test_fp16_and_interleaving_are_accepted() -> None:
    """Megatron allows both with the distributed optimizer; the start-up check no longer refuses them."""
    base = (
        "--num-layers 4 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --train-iters 2 --lr 1e-3 "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
    ).split()
    layout = validate_args(parse_args([*base, "--fp16"]), 2)
    assert layout.dp == 2
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    layout = validate_args(parse_args([*base, *interleaved, "--global-batch-size", "4"]), 4)
    assert (layout.pp, layout.vp, layout.dp) == (2, 2, 2)


def test_fp16_with_interleaved_pipelining_through_the_driver(tmp_path) -> None:
    """pretrain_gpt.py's own path (one spawn): --fp16 with the distributed optimizer on pp 2 x dp 2
    with v = 2 (the stages exchange fp16 activations, the weights' dtype, as Megatron's
    pipeline_dtype) trains as one process's --fp16 does, within fp16's rounding (seen: the losses
    1e-5 apart, the norms 3e-4)."""
    mock = (
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --fp16 --initial-loss-scale 4096".split()
    )
    distopt = (
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000"
    )
    interleaved = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
    plan = [
        ("ipp", 4, [*TINY_GPT_ARGV, *mock, *distopt.split(), *interleaved.split()], free_port()),
        ("one", 1, [*TINY_GPT_ARGV, *mock], free_port()),
    ]
    spawn_ranks(train_plan, (plan, str(tmp_path)), 4)
    run, one = (
        json.loads((tmp_path / f"{name}.rank{world - 1}.json").read_text()) for name, world, *_ in plan
    )
    assert len(one["losses"]) == 3 and run["skipped"] == one["skipped"] == 0
    assert run["loss_scales"] == one["loss_scales"] == [4096.0] * 3
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(one["losses"]), rtol=2**-11, atol=0)
    torch.testing.assert_close(
        torch.tensor(run["grad_norms"]), torch.tensor(one["grad_norms"]), rtol=2**-9, atol=0
    )
    line = next(
        x for x in (tmp_path / "ipp.rank0.log").read_text().splitlines() if "> distributed optimizer" in x
    )
    assert (
        "fp16 parameters, fp16 gradient buffer" in line and "of 2 model chunks; 4 + 16/d = 12 bytes" in line
    ), line

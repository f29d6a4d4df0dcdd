"""What the step-time model adds beyond the model FLOPs (planning/engine_work.py), by hand from the
engine's code: ring attention's blocks, FLOPs, unfused passes and rounds, the experts' FLOPs,
dispatch and parameters."""

from __future__ import annotations

import pytest

from distlab.gpt.arguments import parse_args
from distlab.gpt.arguments.from_args import model_flops_per_iteration
from distlab.gpt.context_parallel.ring_attention import pair_work
from distlab.gpt.layout import Layout
from distlab.gpt.planning import engine_work as work
from distlab.gpt.planning.hardware import Hardware, Link, load
from distlab.gpt.planning.step_model import predict_step

pytestmark = pytest.mark.engine_fast

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --lr 1e-3"
)
MOE = "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2"


def test_a_ring_rank_computes_two_cp_plus_one_blocks_two_of_them_diagonal() -> None:
    """cp 2, rank 0 holds chunks (0, 3). Step 0 against its own: (0, 0), (3, 0), (3, 3) (b <= a);
    step 1 against rank 1's (1, 2): (3, 1), (3, 2). Five blocks, two diagonal; the pair-work of
    the ring's docstring counts a diagonal as half: 2 cp = 4 pair-equivalents."""
    assert work.ring_blocks(2) == (5, 2)
    assert work.ring_blocks(4) == (9, 2)
    for cp in (2, 4):
        blocks, diagonal = work.ring_blocks(cp)
        assert blocks - diagonal / 2 == sum(pair_work(cp)[0]) == 2 * cp


def test_ring_attention_flops_by_hand() -> None:
    """B 1, s 32, cp 2 (c = 8), n d = 64, 2 layers: 2 ranks x 5 blocks x c^2 n d x (14 per layer:
    forward Q K^T and P V 4, backward with the recomputed scores 10)."""
    args = parse_args(f"{TINY} --global-batch-size 1".split())
    assert work.ring_attention_flops(args, 2) == 2 * 5 * 8**2 * 64 * 14 * 2
    recompute = parse_args(
        f"{TINY} --global-batch-size 1 --recompute-granularity full --recompute-method uniform".split()
    )
    assert work.ring_attention_flops(recompute, 2) == 2 * 5 * 8**2 * 64 * (14 * 2 + 4 * 2)


def test_ring_unfused_seconds_by_hand() -> None:
    """b 1, 2 heads, c 4, d 8, cp 2: 5 blocks of 25 passes over 1 x 2 x 4 x 4 scores and 16 over
    1 x 2 x 4 x 8 rows, 2 diagonal blocks of 4 more score passes, 4 bytes each; 5 x 26 + 2 x 6
    kernels."""
    link = Link(bandwidth=1e9, latency=1e-6)
    nbytes = 4 * (5 * (25 * 32 + 16 * 64) + 2 * 4 * 32)
    assert work.ring_unfused_seconds(1, 2, 4, 8, 2, link) == pytest.approx(142e-6 + nbytes / 1e9)


def test_the_model_flops_count_k_experts_and_the_router_is_executed_beside_them() -> None:
    """Top-2 of 4 GeLU experts of F = 4H: per token and layer forward the model FLOPs count the MLP
    twice, 2 x (2 x 64 x 256 x 2) more than one dense MLP (Megatron-LM's num_experts_routed_to);
    the router's 2 x 64 x 4 is executed on top; forward + backward x 3, B s = 4 x 32, 2 layers."""
    moe = parse_args(f"{TINY} --global-batch-size 4 {MOE}".split())
    dense = parse_args(f"{TINY} --global-batch-size 4".split())
    extra_mlp = 1 * 2 * 64 * 256 * 2
    assert (
        model_flops_per_iteration(moe, 128) - model_flops_per_iteration(dense, 128)
        == 4 * 32 * 3 * 2 * extra_mlp
    )
    assert work.router_flops(moe) == 4 * 32 * 3 * 2 * (2 * 64 * 4)
    assert work.router_flops(dense) == 0.0


def test_the_dispatchers_collectives_by_hand() -> None:
    """ep 2, micro-batch 1 x 32 tokens (N = 32), H 64, E 4, top-2, fp32. alltoall: the E counts
    (int64) once, R x H = 64 x 64 x 4 bytes 4 times. allgather over G = 2: x (64, 64) fp32 gathered
    twice and reduce-scattered twice, p (64, 4) fp32 gathered and reduce-scattered, the map (64, 4)
    uint8 gathered."""
    layout = Layout(2, ep=2, global_batch_size=2)
    a2a = parse_args(f"{TINY} --global-batch-size 2 {MOE} --moe-token-dispatcher-type alltoall".split())
    assert work.dispatch_collectives(a2a, layout) == [("all_to_all", 32, 1), ("all_to_all", 64 * 64 * 4, 4)]
    ag = parse_args(f"{TINY} --global-batch-size 2 {MOE} --moe-token-dispatcher-type allgather".split())
    x = 64 * 64 * 4
    assert sorted(work.dispatch_collectives(ag, layout)) == sorted(
        [("all_gather", x, 2), ("all_gather", 64 * 4 * 4, 1), ("all_gather", 64 * 4, 1),
         ("reduce_scatter", x, 2), ("reduce_scatter", 64 * 4 * 4, 1)]
    )  # fmt: skip


def test_expert_gradients_are_reduced_over_their_own_group() -> None:
    """2 layers x 2 of the 4 experts per rank, each fc1 (256, 64) + fc2 (64, 256) + biases 256 + 64;
    ep 2 of dp 4: the dense gradients all-reduced over 4 ranks, the experts' over dp / ep = 2."""
    args = parse_args(f"{TINY} --global-batch-size 4 {MOE}".split())
    layout = Layout(4, ep=2, global_batch_size=4)
    experts = 2 * 2 * (256 * 64 + 64 * 256 + 256 + 64)
    assert work.expert_parameters(args, layout) == experts
    hw = Hardware("test", 8, 1e12, 1.0, 2**34, Link(100e9, 1e-5), Link(10e9, 1e-4), flash_attention=False)
    dp = [
        (c.op, c.n, c.nbytes)
        for c in predict_step(args, layout, hw, 128, experts + 1000).costs
        if c.dim == "dp"
    ]
    assert dp == [("all_reduce", 4, 1000 * 4), ("all_reduce", 2, experts * 4)]


def test_the_elementwise_figure_reads_back_and_gpu_files_have_none() -> None:
    hw = Hardware("x", 2, 1e11, 0.5, 2**32, Link(1e9, 1e-4), Link(1e9, 1e-4), False, "", Link(5e9, 2e-6))
    back = Hardware.from_dict(hw.to_dict()).elementwise
    assert (back.bandwidth, back.latency) == pytest.approx((5e9, 2e-6))
    assert load("h100_sxm_node").elementwise is None


def test_the_update_costs_its_bytes_over_the_measured_bandwidth() -> None:
    """dp 2, n = 1e6 fp32 parameters, 1 GB/s: the norm, clipping and AdamW pass 40 bytes per
    parameter, the buckets' copy in, division and copy back 24; the distributed optimizer updates half of them."""
    n, el = 1e6, Link(bandwidth=1e9, latency=1e-6)
    hw = Hardware("t", 8, 1e12, 1.0, 2**34, Link(100e9, 1e-5), Link(10e9, 1e-4), False, "", memory=el)
    args = parse_args(f"{TINY} --global-batch-size 2".split())
    layout = Layout(2, global_batch_size=2)
    assert predict_step(args, layout, hw, 128, n).optimizer == pytest.approx((40 * n + 24 * n) / 1e9)
    sharded = predict_step(args, layout, hw, 128, n, distributed_optimizer=True)
    assert sharded.optimizer == pytest.approx((40 * n / 2 + 24 * n) / 1e9)
    one = predict_step(args, Layout(1, global_batch_size=2), hw, 128, n)
    assert one.optimizer == pytest.approx(40 * n / 1e9)  # no buckets with one data-parallel rank

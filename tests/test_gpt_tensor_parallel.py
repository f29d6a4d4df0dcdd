"""Tensor-parallel layers against unsharded references and against PyTorch's DTensor TP.

One group of 2 gloo processes runs every check (spawning costs seconds on 2 cores); a failing
check raises in its rank and ``torch.multiprocessing.spawn`` re-raises it here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from distlab.distributed import DistContext
from distlab.gpt.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from distlab.gpt.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
    parallel_lm_logits,
    shard,
)
from distlab.gpt.tensor_parallel.mappings import gather_from_tensor_parallel
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(180)

B, T, H, FF, V = 2, 3, 8, 16, 12  # tiny: batch, sequence, hidden, MLP width, vocabulary


def check_mlp(group: dist.ProcessGroup, rank: int, p: int) -> None:
    """Column -> GeLU -> Row equals the unsharded MLP: output, input grad, weight grads."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(H, FF), nn.Linear(FF, H)
    x = torch.randn(B, T, H, requires_grad=True)
    y = fc2(F.gelu(fc1(x)))
    y.square().sum().backward()

    col = ColumnParallelLinear(H, FF, group=group)
    row = RowParallelLinear(FF, H, group=group)
    col.load_full_(fc1.weight, fc1.bias)
    row.load_full_(fc2.weight, fc2.bias)
    xp = x.detach().clone().requires_grad_()
    yp = row(F.gelu(col(xp)))
    yp.square().sum().backward()

    assert_close(yp, y)
    assert_close(xp.grad, x.grad)
    assert_close(col.weight.grad, fc1.weight.grad.chunk(p, 0)[rank])
    assert_close(col.bias.grad, fc1.bias.grad.chunk(p, 0)[rank])
    assert_close(row.weight.grad, fc2.weight.grad.chunk(p, 1)[rank])
    assert_close(row.bias.grad, fc2.bias.grad)


def check_gather_scatter_and_stride(group: dist.ProcessGroup, rank: int, p: int) -> None:
    """gather_output / input_is_parallel=False paths, and stride=3 keeps q, k, v heads together."""
    torch.manual_seed(1)
    lin = nn.Linear(H, 3 * H)
    x = torch.randn(B, T, H, requires_grad=True)
    lin(x).sin().sum().backward()
    col = ColumnParallelLinear(H, 3 * H, group=group, stride=3)
    col.load_full_(lin.weight, lin.bias)
    xp = x.detach().clone().requires_grad_()
    y_local = col(xp)  # (B, T, 3H/p) = [q_r, k_r, v_r]
    q, k, v = lin(x.detach()).split(H, dim=-1)
    expected = torch.cat([t.chunk(p, -1)[rank] for t in (q, k, v)], dim=-1)
    assert_close(y_local, expected)
    # The full gradient of x needs every rank's slice: sin on the local slice is elementwise.
    y_local.sin().sum().backward()
    assert_close(xp.grad, x.grad)
    assert_close(col.weight.grad, shard(lin.weight.grad, 0, p, rank, stride=3))

    col_g = ColumnParallelLinear(H, FF, group=group, gather_output=True)
    row_s = RowParallelLinear(FF, H, group=group, input_is_parallel=False)
    fc1, fc2 = nn.Linear(H, FF), nn.Linear(FF, H)
    col_g.load_full_(fc1.weight, fc1.bias)
    row_s.load_full_(fc2.weight, fc2.bias)
    x2 = torch.randn(B, T, H)
    assert_close(col_g(x2), fc1(x2))
    h = torch.randn(B, T, FF, requires_grad=True)
    hp = h.detach().clone().requires_grad_()
    fc2(h).sum().backward()
    row_s(hp).sum().backward()
    assert_close(hp.grad, h.grad)


def check_vocab(group: dist.ProcessGroup, rank: int, p: int) -> None:
    """Vocab-parallel embedding, tied logits and cross-entropy equal the plain ones."""
    torch.manual_seed(2)
    emb = nn.Embedding(V, H)
    tokens = torch.randint(0, V, (B, T))
    target = torch.randint(0, V, (B, T))
    h = emb(tokens)
    logits = F.linear(h * 2.0, emb.weight)  # tied output layer
    loss = F.cross_entropy(logits.view(-1, V), target.view(-1))
    loss.backward()

    pemb = VocabParallelEmbedding(V, H, group=group)
    pemb.load_full_(emb.weight)
    hp = pemb(tokens)
    assert_close(hp, h)
    logits_p = parallel_lm_logits(hp * 2.0, pemb.weight, group)  # (B, T, V_p)
    assert_close(gather_from_tensor_parallel(logits_p, group), logits)
    loss_p = vocab_parallel_cross_entropy(logits_p, target, group).mean()
    assert_close(loss_p, loss)
    loss_p.backward()
    assert_close(pemb.weight.grad, emb.weight.grad.chunk(p, 0)[rank])

    # Large logits: the max subtraction keeps exp finite.
    big = torch.randn(5, V) * 1000
    tgt = torch.randint(0, V, (5,))
    assert_close(
        vocab_parallel_cross_entropy(big.chunk(p, -1)[rank].contiguous(), tgt, group),
        F.cross_entropy(big, tgt, reduction="none"),
    )


def check_dtensor(group: dist.ProcessGroup, rank: int, p: int) -> None:
    """Same output and gradients as torch.distributed.tensor.parallel Colwise/RowwiseParallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("tp",))
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(H, FF), nn.GELU(), nn.Linear(FF, H))
    full = [t.detach().clone() for t in (ref[0].weight, ref[0].bias, ref[2].weight, ref[2].bias)]
    ref = parallelize_module(ref, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    col, row = ColumnParallelLinear(H, FF, group=group), RowParallelLinear(FF, H, group=group)
    col.load_full_(full[0], full[1])
    row.load_full_(full[2], full[3])

    x = torch.randn(B, T, H)  # the same on both ranks (same seed)
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = ref(xd)
    yp = row(F.gelu(col(xp)))
    assert_close(yp, yd)
    (yd * yd).sum().backward()
    (yp * yp).sum().backward()
    assert_close(xp.grad, xd.grad)
    assert_close(col.weight.grad, ref[0].weight.grad.to_local())
    assert_close(col.bias.grad, ref[0].bias.grad.to_local())
    assert_close(row.weight.grad, ref[2].weight.grad.to_local())
    assert_close(row.bias.grad, ref[2].bias.grad.full_tensor())


def _worker(ctx: DistContext) -> None:
    group = dist.new_group(list(range(ctx.world_size)))
    for check in (check_mlp, check_gather_scatter_and_stride, check_vocab, check_dtensor):
        check(group, ctx.rank, ctx.world_size)
    dist.barrier()


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_layers_match_unsharded_and_dtensor(tp: int) -> None:
    run_gloo(_worker, tp)


def test_single_rank_layers_are_plain_layers() -> None:
    """With no group the layers are the plain ones (the code path of a TP=1 run)."""
    torch.manual_seed(4)
    lin = nn.Linear(H, FF)
    col = ColumnParallelLinear(H, FF, group=None)
    col.load_full_(lin.weight, lin.bias)
    x = torch.randn(B, T, H)
    assert_close(col(x), lin(x))
    logits, target = torch.randn(6, V), torch.randint(0, V, (6,))
    assert_close(
        vocab_parallel_cross_entropy(logits, target, None), F.cross_entropy(logits, target, reduction="none")
    )


def test_pad_vocab_size_and_messages() -> None:
    assert pad_vocab_size(50257, 128, 1) == 50304  # GPT-2, as Megatron pads it
    assert pad_vocab_size(50257, 128, 2) == 50432
    assert pad_vocab_size(256, 64, 2) == 256
    with pytest.raises(
        ValueError, match="out_features 10 is not divisible by tensor-parallel size 1 x stride 3"
    ):
        ColumnParallelLinear(H, 10, group=None, stride=3)
    with pytest.raises(ValueError, match="must be >= 1"):
        pad_vocab_size(100, 0, 2)

"""Cross-entropy over a vocabulary split across the tensor-parallel ranks (Megatron Core's
``tensor_parallel/cross_entropy.py``).

Rank ``r`` of the ``p`` in the group holds the logits ``z_r`` (N, V_p) of its vocabulary rows
``[r V_p, (r + 1) V_p)`` (``layers.py``'s ``parallel_lm_logits``); the loss of a token with target
``t`` is ``log sum_v exp(z_v) - z_t`` over all V, computed without gathering the (N, V) logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.gpt.tensor_parallel.mappings import group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        p, r = group_size(group), group_rank(group)
        v_p = logits.shape[-1]
        logits = logits.float()  # (N, V_p)
        top = logits.max(dim=-1).values  # (N,)
        if p > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)  # (N, V_p), <= 0: exp cannot overflow
        start = r * v_p
        outside = (target < start) | (target >= start + v_p)  # (N,)
        local = (target - start).masked_fill(outside, 0)  # (N,)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)  # (N,)
        exp = shifted.exp()  # (N, V_p)
        sum_exp = exp.sum(dim=-1)  # (N,)
        if p > 1:
            both = torch.stack([picked, sum_exp])  # one all-reduce for the two sums
            dist.all_reduce(both, group=group)
            picked, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)  # softmax_r
        return sum_exp.log() - picked  # (N,)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d logits = softmax - onehot(target)
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """loss_t = log sum_v exp(z_tv) - z_t,target, with z split by vocabulary over the group.

    Two all-reduces of (N,) vectors (the max, then the target's logit and the sum of exponentials
    stacked into one) replace gathering the (N, V) logits. With one rank it is plain cross-entropy.
    logits (..., V_p), target (...) -> per-token loss (...), fp32.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: "
            f"logits must be target's shape plus the vocabulary dimension"
        )
    if group_size(group) == 1:  # the whole vocabulary is here: PyTorch's fused kernel, in fp32
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none").view_as(
            target
        )
    n_shape = target.shape
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group)
    return loss.view(n_shape)

"""The experts of one MoE layer on this rank, each an MLP split over the expert-tensor-parallel
ranks (Megatron Core's ``moe/experts.py``, ``SequentialMLP``).

One expert on its n routed tokens x (n, H)::

    GeLU     y = fc2(gelu(fc1(x)))                 fc1: H -> F, fc2: F -> H
    SwiGLU   y = fc2(silu(x W_g^T) * (x W_u^T))    fc1 = [W_g; W_u]: H -> 2F (``gated_linear_unit``)

Expert tensor parallelism (``--expert-tensor-parallel-size``, megatron-core's default and the only
size here: etp = tp): fc1 is split by output features and fc2 by input features over the tp
ranks, as the dense MLP, but *without* the MLP's all-reduce: rank r returns its partial sum
``fc2_r(act(fc1_r(x)))`` (n, H) and the token dispatcher's combine sums the tp partials together
with the experts' outputs (Megatron's ``explicit_expert_comm``: a reduce-scatter or the return
all-to-all). fc1's rows are split gate and up alike (stride 2), so each rank holds ``[W_g,r; W_u,r]``.
fc2's bias (H,) is whole on every rank and added by tp rank 0 only (times 0 elsewhere, so every
rank has its gradient); tagged ``sequence_parallel``, its gradient is summed over tp.

Every local expert runs in turn (``--moe-grouped-gemm`` names the CUDA grouped GEMM of
Transformer Engine; here it is this same loop over the local experts, which computes the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab.gpt.tensor_parallel.layers import mark_sequence_parallel


class ExpertMLP(nn.Module):
    """One expert's shard: fc1 (g F / etp, H), fc2 (H, F / etp), g = 2 when gated, else 1."""

    #: Its forward reads fc1's and fc2's parameters itself (F.linear), never calling theirs: the
    #: distributed optimizer's --overlap-param-gather waits for their buckets in this module's hook.
    reads_parameters_of = ("fc1", "fc2")

    def __init__(
        self,
        hidden: int,
        ffn: int,
        *,
        etp: int = 1,
        etp_rank: int = 0,
        gated: bool = False,
        bias: bool = True,
        openai_gelu: bool = False,
    ) -> None:
        super().__init__()
        self.gelu = "tanh" if openai_gelu else "none"  # --openai-gelu (``mlp.py``)
        if ffn % etp:
            raise ValueError(
                f"the experts' FFN width {ffn} is not divisible by the expert-tensor-parallel size {etp}: "
                f"choose --ffn-hidden-size a multiple of {etp}"
            )
        self.gated = gated
        width = (2 if gated else 1) * ffn // etp
        self.fc1 = nn.Linear(hidden, width, bias=bias)  # (g F / etp, H)
        self.fc2 = nn.Linear(ffn // etp, hidden, bias=bias)  # (H, F / etp)
        fc1_stride = 2 if gated else 1  # [W_g; W_u]: each half cut in etp
        for p, dim, stride in (
            (self.fc1.weight, 0, fc1_stride),
            (self.fc1.bias, 0, fc1_stride),
            (self.fc2.weight, 1, 1),
        ):
            if p is not None:  # the initialiser draws the whole tensor and keeps this rank's shard
                p.partition_dim, p.partition_stride = dim, stride
        self.bias_share = 1.0 if etp_rank == 0 else 0.0  # fc2's bias counted once in the tp sum
        if bias and etp > 1:
            mark_sequence_parallel(self.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, H) -> this rank's partial (n, H)
        h = F.linear(x, self.fc1.weight, self.fc1.bias)  # (n, g F / etp)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)  # (n, F / etp) each
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu)
        y = F.linear(h, self.fc2.weight)  # (n, H)
        if self.fc2.bias is not None:  # in y's dtype, as F.linear adds it under autocast
            y = y + (self.bias_share * self.fc2.bias).to(y.dtype)
        return y

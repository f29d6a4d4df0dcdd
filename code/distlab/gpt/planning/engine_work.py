"""What a step executes beyond the model FLOPs and the blocks' tensor-parallel collectives
(``step_model.py``): ring attention, the experts and their dispatch, the tensor-parallel embedding
and loss head. Each count is read off the engine's code that the paragraph names.

**Ring attention** (``context_parallel/ring_attention.py``). A sample's s tokens are cut into 2 cp
chunks of c = s / (2 cp); rank i holds chunks i and 2cp-1-i. At ring step t it computes the pairs
(q chunk a, k chunk b) with b <= a of its chunks against those of rank i - t: three at step 0 (its
two diagonals, computed whole and masked, and (2cp-1-i, i)), two at every other step, so
``2 cp + 1`` blocks of c x c scores per pass (:func:`ring_blocks`), where a kernel that skips the
masked halves does 2 cp. Per block, with n' = n / tp heads of d channels::

    forward     Q K^T, P V                                    4 b n' d c^2 FLOPs
    backward    Q K^T recomputed, dV, dP, dQ, dK              10 b n' d c^2
    unfused     fp32 scores: forward 12 passes over (b, n', c, c) (x scale 2, logsumexp 6, - lse 2,
                exp 2) and 7 over (b, n', c, d) (the online-softmax merge); backward 13 over the
                scores (x scale 2, - lse 2, exp 2, dP - delta 2, P x (.) 3, x scale 2) and 9 over
                (b, n', c, d) (dV, dQ, dK accumulated in place); 17 + 9 kernels, and 3 + 3 more
                (2 + 2 passes) to build and apply the mask of a diagonal block (each pass 4 bytes
                an element, read or written)

Rounds per layer and pass, sequential along the ring (one ``batch_isend_irecv`` each): forward
cp - 1 of K and V (2 b (s/cp) n' d elements: the engine repeats grouped K/V to n' heads before the
ring; a fused ring sends the g / tp groups); backward cp - 1 of K and V again and cp of their fp32
gradient accumulator. K/V rounds are posted before a step's blocks and waited after them; the
engine waits for a gradient round as soon as it is posted.

**Experts** (``transformer/moe/``): every block's MLP is E experts of the dense MLP's shape, each token goes to
k of them (``--moe-router-topk``); the model FLOPs count the k MLPs (``training/flops.py``, as
Megatron-LM), not the router's 2 H E per token, which the experts also execute. Per layer and
micro-batch of N tokens (R = k N routed pairs, bytes of the run's dtype), over the G = tp x ep
ranks of the expert group::

    alltoall    all-to-all of the E counts (int64), 2 of the R x H rows (dispatch, combine) and 2
                in backward                                   (``expert_parallel.py``)
    allgather   all-gather x (G N, H), p (G N, E) fp32, map (G N, E) uint8, and in backward
                the combine's; reduce-scatter of y (G N, H), and in backward of x's and p's
                gradients                                     (``token_dispatcher.py``)
    unfused     forward: gather the pairs' rows 2, regroup 2, concatenate 2, regroup back 2,
                weight 2, index-add 2: 12 passes over (R, H); backward: the index-add's gather 2,
                the weighting's two products 5, the regroups' concatenations 4 and the split's 1,
                the gather's accumulation 2: 14 (:data:`PERMUTE`); about 50 kernels with the
                router's softmax, top-k, scatters and load-balancing loss (:data:`PERMUTE_KERNELS`)

**Tensor-parallel embedding and head** (``tensor_parallel/``): per micro-batch, the vocab-parallel
embedding's all-reduce (a reduce-scatter under sequence parallelism, all-gathered in backward), the
output layer's input gradient all-reduced (sequence parallelism: gathered forward, gathered again
for the weight gradient, reduce-scattered in backward), and the cross entropy's two all-reduces of
b s fp32 values (max; predicted logit with the sum of exponentials); per step the sequence-parallel
norms' gradients all-reduced over tp.
"""

from __future__ import annotations

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.from_args import recomputed_layers
from distlab.gpt.context_parallel.ring_attention import chunk_ids
from distlab.gpt.layout import Layout
from distlab.gpt.planning.hardware import Link

#: Passes over the (R, H) routed rows of one MoE layer's dispatch and combine, forward 12 + backward 14.
PERMUTE = 26
#: Kernels of one MoE layer's routing, dispatch and combine, forward and backward (about).
PERMUTE_KERNELS = 50


def act_bytes(args: PretrainArgs) -> int:
    """Bytes of an activation: 2 in bf16 or fp16, else 4."""
    return 2 if (args.bf16 or args.fp16) else 4


def ring_blocks(cp: int) -> tuple[int, int]:
    """(blocks, diagonal blocks) of c x c scores one rank computes per pass: the pairs b <= a of
    its chunks against each rank's (``ring_attention._pairs``): 2 cp + 1, two of them diagonal."""
    blocks = diagonal = 0
    for step in range(cp):
        theirs = chunk_ids(cp, (0 - step) % cp)
        pairs = [(a, b) for a in chunk_ids(cp, 0) for b in theirs if b <= a]
        blocks += len(pairs)
        diagonal += sum(a == b for a, b in pairs)
    return blocks, diagonal


def ring_attention_flops(args: PretrainArgs, cp: int) -> float:
    """Q K^T and P V as the ring executes them in one step, all ranks: ``B cp (2 cp + 1) c^2 n d
    (14 l + 4 r)`` (forward 4, backward 10 per block; recomputed blocks run the forward again)."""
    c = args.seq_length / (2 * cp)
    nd = (args.kv_channels or args.hidden_size // args.num_attention_heads) * args.num_attention_heads
    blocks, _ = ring_blocks(cp)
    return (
        args.global_batch_size
        * cp
        * blocks
        * c**2
        * nd
        * (14 * args.num_layers + 4 * recomputed_layers(args))
    )


def ring_unfused_seconds(b: int, heads: float, c: float, d: int, cp: int, elementwise: Link) -> float:
    """One layer's forward plus backward of unfused elementwise work of the engine's ring, per rank:
    passes x 4 bytes x elements / bandwidth + kernels x latency (module docstring)."""
    blocks, diagonal = ring_blocks(cp)
    scores, rows = b * heads * c * c, b * heads * c * d  # elements of (b, n', c, c), (b, n', c, d)
    nbytes = 4 * (blocks * (25 * scores + 16 * rows) + diagonal * 4 * scores)
    kernels = blocks * 26 + diagonal * 6
    return kernels * elementwise.latency + nbytes / elementwise.bandwidth


def ring_round_bytes(args: PretrainArgs, layout: Layout, fused: bool) -> tuple[float, float]:
    """Bytes of one K/V round and of one gradient round: 2 b (s / cp) (heads / tp) d elements,
    heads n (the engine repeats grouped K/V) or g (a fused ring); gradients fp32 (the engine's
    accumulator) or the run's dtype (fused)."""
    act = act_bytes(args)
    d = args.kv_channels or args.hidden_size // args.num_attention_heads
    heads = args.num_attention_heads
    if fused and args.group_query_attention:
        heads = args.num_query_groups
    elements = 2 * layout.micro_batch_size * (args.seq_length / layout.cp) * (heads / layout.tp) * d
    return elements * act, elements * (act if fused else 4)


def router_flops(args: PretrainArgs) -> float:
    """The router's FLOPs in one step, which the model FLOPs leave out: ``B s (3 l + r) 2 H E``."""
    if args.num_experts is None:
        return 0.0
    blocks = 3 * args.num_layers + recomputed_layers(args)
    return float(args.global_batch_size * args.seq_length) * blocks * 2 * args.hidden_size * args.num_experts


def dispatch_collectives(args: PretrainArgs, layout: Layout) -> list[tuple[str, float, int]]:
    """(op, bytes, calls) of one MoE layer's dispatch and combine per micro-batch (module docstring),
    over G = tp x ep ranks; none when G = 1."""
    G = layout.tp * layout.ep
    if args.num_experts is None or G == 1:
        return []
    act = act_bytes(args)
    sp = layout.tp if layout.sequence_parallel else 1
    N = layout.micro_batch_size * args.seq_length / layout.cp / sp  # this rank's tokens
    E, H = args.num_experts, args.hidden_size
    if args.moe_token_dispatcher_type == "alltoall":
        rows = args.moe_router_topk * N * H * act
        return [("all_to_all", 8 * E, 1), ("all_to_all", rows, 4)]
    x = G * N * H * act
    return [
        ("all_gather", x, 2),
        ("all_gather", G * N * E * 4, 1),
        ("all_gather", G * N * E, 1),
        ("reduce_scatter", x, 2),
        ("reduce_scatter", G * N * E * 4, 1),
    ]


def permute_unfused_seconds(args: PretrainArgs, layout: Layout, elementwise: Link) -> float:
    """One MoE layer's dispatch and combine, forward and backward, per micro-batch on one rank:
    :data:`PERMUTE` passes over the R = k N routed rows of H values, :data:`PERMUTE_KERNELS` kernels."""
    if args.num_experts is None:
        return 0.0
    act = act_bytes(args)
    sp = layout.tp if layout.sequence_parallel else 1
    R = args.moe_router_topk * layout.micro_batch_size * args.seq_length / layout.cp / sp
    return (
        PERMUTE_KERNELS * elementwise.latency + PERMUTE * R * args.hidden_size * act / elementwise.bandwidth
    )


def head_collectives(args: PretrainArgs, layout: Layout, S: float) -> list[tuple[str, float, int]]:
    """(op, bytes, calls) over tp of the embedding (first stage), output layer and cross entropy
    (last stage) per micro-batch, on the stage that holds both (pp = 1) or the last."""
    if layout.tp == 1:
        return []
    first = layout.pp == 1  # the embedding is on this stage too
    tokens = layout.micro_batch_size * args.seq_length / layout.cp
    loss = [("all_reduce", tokens * 4, 1), ("all_reduce", 2 * tokens * 4, 1)]
    if layout.sequence_parallel:
        return [("all_gather", S, 2 + first), ("reduce_scatter", S, 1 + first), *loss]
    return [("all_reduce", S, 1 + first), *loss]


def expert_parameters(args: PretrainArgs, layout: Layout) -> float:
    """One rank's expert parameters on its stage: (l / pp) (E / ep) experts of fc1 (g F / tp, H) and
    fc2 (H, F / tp), g = 2 with SwiGLU, with their biases (``transformer/moe/experts.py``); their gradients are
    reduced over the expert-data-parallel group, not with the dense ones."""
    if args.num_experts is None or layout.ep == 1:
        return 0.0
    H, F, g = (
        args.hidden_size,
        (args.ffn_hidden_size or 4 * args.hidden_size) / layout.tp,
        2 if args.swiglu else 1,
    )
    per_expert = g * F * H + H * F + (g * F + H if args.add_bias_linear else 0)
    return args.num_layers / layout.pp * args.num_experts / layout.ep * per_expert


#: Bytes per parameter of a step's update, fp32 (``optimizer/clip_grads.py``, ``optimizer/optimizer.py``):
#: the norm reads the gradient (4), clipping scales it (8), fused AdamW reads the parameter, the
#: gradient and both moments and writes the parameter and the moments (28).
UPDATE_BYTES = 40
#: Per dense parameter when dp x cp > 1 (``grad_buckets.py``): its gradient concatenated into the
#: flat bucket (8), the sum divided by dp x cp (8), copied back (8).
BUCKET_BYTES = 24


def optimizer_seconds(updated: float, bucketed: float, memory: Link) -> float:
    """The step's memory-bound work after backward, per rank: ``updated`` parameters normed,
    clipped and updated (the stage's, or the distributed optimizer's shard of them), ``bucketed``
    ones copied through the gradient buckets. Per-kernel latencies (a few kernels per tensor) and
    half-precision runs' extra copies are left out."""
    return (UPDATE_BYTES * updated + BUCKET_BYTES * bucketed) / memory.bandwidth

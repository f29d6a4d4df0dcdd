"""What a block keeps for its backward: Megatron-LM's attention backends and recomputation flags.

Torch-free, so that the argument checks, the model and the memory estimate share one reading of
the flags. Activation recomputation (Korthikanti et al. 2022) trades memory for a second forward::

    --recompute-activations             = --recompute-granularity selective (as Megatron sets it)
    --recompute-granularity selective   every block checkpoints its core attention,
                                        softmax(Q K^T / sqrt(d)) V: the scores are rebuilt in
                                        backward (the 5as/h term of s b h (34 + 5as/h)), for the
                                        cost of that product only: a few % more compute
    --recompute-granularity full        whole blocks are checkpointed: a group of blocks keeps its
                                        input (b, T, H) only and runs forward again in backward,
                                        4 forward-equivalents per step instead of 3 (~33% more)
      --recompute-method uniform        the stage's L / pp blocks in groups of N consecutive
      --recompute-num-layers N          blocks (the last may be shorter), each group rebuilt whole
      --recompute-method block          the stage's first N blocks, each on its own; the other
      --recompute-num-layers N          L / pp - N store everything

(Megatron-LM's ``--recompute-modules``, default ``core_attn``, chooses what selective
recomputation rebuilds; here it is always the core attention.) What each mode keeps, in bytes:
``memory_estimate``.

``--attention-backend`` (Megatron's choices) picks how the core attention is computed here:
auto, flash and fused run PyTorch's ``scaled_dot_product_attention`` (a fused kernel that keeps
its output and a log-sum-exp, never the T x T scores); unfused and local run the explicit
product, which stores the scores' softmax as Korthikanti's formula counts it.
"""

from __future__ import annotations

#: ``--recompute-granularity``'s choices.
GRANULARITIES = ("full", "selective")
#: ``--recompute-method``'s choices.
METHODS = ("uniform", "block")
#: ``--attention-backend``'s choices (Megatron's AttnBackend), and those computed explicitly here.
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
EXPLICIT_BACKENDS = ("unfused", "local")


def granularity_of(recompute_activations: bool, recompute_granularity: str | None) -> str | None:
    """The granularity a run uses: ``--recompute-activations`` means selective, as in Megatron-LM."""
    return "selective" if recompute_activations else recompute_granularity


def recompute_errors(
    granularity: str | None, method: str | None, num_layers: int | None, layers_per_stage: int
) -> list[str]:
    """Megatron-LM's rules for the three flags, each message naming the values and the fix."""
    g, m, n = granularity, method, num_layers
    if g not in (None, *GRANULARITIES):
        return [f"--recompute-granularity {g} must be full or selective"]
    if m not in (None, *METHODS):
        return [f"--recompute-method {m} must be uniform or block"]
    errors = []
    if g == "full" and m is None:
        errors.append(
            "--recompute-granularity full needs --recompute-method uniform (groups of N blocks) or "
            "block (the first N blocks of each stage)"
        )
    if g == "full" and n is None:
        errors.append(
            f"--recompute-granularity full needs --recompute-num-layers N, 1 <= N <= {layers_per_stage} "
            f"(the blocks of a pipeline stage)"
        )
    if g != "full" and (m is not None or n is not None):
        flags = (("--recompute-method", m), ("--recompute-num-layers", n))
        given = " ".join(f"{flag} {v}" for flag, v in flags if v is not None)
        what = f"--recompute-granularity {g}" if g else "no --recompute-granularity"
        errors.append(
            f"{given} with {what}: a method and a number of layers choose the blocks of full "
            f"recomputation only; add --recompute-granularity full or drop them"
        )
    if n is not None and not 1 <= n <= layers_per_stage:
        errors.append(
            f"--recompute-num-layers {n} must be between 1 and the {layers_per_stage} blocks of a "
            f"pipeline stage (--num-layers / --pipeline-model-parallel-size)"
        )
    return errors


def checkpoint_groups(
    layers_per_stage: int, granularity: str | None, method: str | None, num_layers: int | None
) -> list[tuple[int, int, bool]]:
    """The stage's blocks ``0 .. L/pp - 1`` as ``(first, end, checkpointed)`` runs, in order.

    e.g. 4 blocks: full uniform N=3 -> [(0, 3, True), (3, 4, True)]; full block N=1 ->
    [(0, 1, True), (1, 4, False)]; selective or none -> [(0, 4, False)].
    """
    n_stage = layers_per_stage
    if granularity != "full":
        return [(0, n_stage, False)]
    if method == "uniform":
        return [(i, min(i + num_layers, n_stage), True) for i in range(0, n_stage, num_layers)]
    groups = [(i, i + 1, True) for i in range(num_layers)]
    return groups + ([(num_layers, n_stage, False)] if num_layers < n_stage else [])

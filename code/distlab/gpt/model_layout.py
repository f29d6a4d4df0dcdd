"""A model against a layout: every rule that ties the model's sizes to the parallel sizes, named
and written once, here.

A :class:`~distlab.gpt.layout.Layout` checks what depends on the ranks alone (the world size over
tp x cp x pp, ep over dp x cp, the batch arithmetic). Whether a *model* can be cut along that
layout is the set of rules below, with T the sequence, n the heads, g the query groups, H the
hidden size, F the MLP width, V the padded vocabulary, E the experts, L the layers::

    head size          n | H                 every head has H / n channels
    heads over tp      tp | n                each tp rank computes n / tp whole heads (so tp | H)
    FFN over tp        tp | F                fc1's columns, fc2's rows
    vocabulary over tp tp | V                each tp rank holds V / tp rows of the embedding
    query groups       tp | g or g | tp      K/V heads split (tp | g) or replicated (g | tp)
    sequence over 2cp  2 cp | T              two of the 2 cp chunks per cp rank (balanced causal split)
    sequence over SP   cp tp | T             under SP each cp rank's T / cp tokens split over tp
    SP needs tp        tp > 1                sequence parallelism splits over the tp ranks
    no ring dropout    cp > 1 -> p_attn = 0  ring attention has no attention dropout
    experts over ep    ep | E                each ep rank holds E / ep whole experts
    MoE under tp       tp > 1 -> SP          megatron-core's MoELayer: the tp ranks route T / tp tokens
    layers over stages pp v | L              even stages and virtual chunks (interleaved 1F1B)

:func:`model_layout_errors` applies them all; :func:`check_model_layout` raises one
``ValueError`` naming each broken rule with its values and a fix. ``validate_args``, the model,
the memory estimate, the planner, the dry run, the exercise graders, torch pipelining and the
converter call it, and nothing else checks these rules. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distlab.gpt.layout import Layout, sequence_parallel_error


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model the rules read; a size left None is not checked (a model built without
    knowing its sequence, a what-if without a vocabulary)."""

    num_layers: int
    """L, blocks in the whole model."""
    hidden_size: int
    """H."""
    num_attention_heads: int
    """n."""
    seq_length: int | None = None
    """T, tokens of one sample."""
    ffn_hidden_size: int | None = None
    """F; None: 4H."""
    num_query_groups: int | None = None
    """g, K/V heads; None: n (multi-head)."""
    vocab_size: int | None = None
    """V, the padded vocabulary."""
    num_experts: int | None = None
    """E, experts per MoE layer; None: dense MLPs."""
    attention_dropout: float = 0.0

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @classmethod
    def of(cls, config, seq_length: int | None = None) -> ModelShape:
        """The shape of a ``GPTConfig`` (whose MoE, if any, gives the experts)."""
        moe = getattr(config, "moe", None)
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            seq_length=seq_length,
            ffn_hidden_size=config.ffn_hidden_size,
            num_query_groups=config.num_query_groups,
            vocab_size=config.vocab_size,
            num_experts=None if moe is None else moe.num_experts,
            attention_dropout=config.attention_dropout,
        )


# --- the rules: each takes (model, layout) and returns its message, or None when it holds. ---
TP = "--tensor-model-parallel-size"
CP = "--context-parallel-size"


def head_size(m: ModelShape, lay: Layout) -> str | None:
    if m.hidden_size % m.num_attention_heads:
        return (
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
            f"{m.num_attention_heads}: head size must be an integer"
        )
    return None


def _over_tp(flag: str, value: int | None, lay: Layout, what: str) -> str | None:
    if value is None or value % lay.tp == 0:
        return None
    fits = [t for t in range(1, value + 1) if value % t == 0 and t <= max(lay.tp, 8)]
    return f"{flag} {value} is not divisible by {TP} {lay.tp} ({what}): choose tp among {fits} or resize"


def heads_over_tp(m: ModelShape, lay: Layout) -> str | None:
    return _over_tp("--num-attention-heads", m.num_attention_heads, lay, "each tp rank computes n / tp heads")


def ffn_over_tp(m: ModelShape, lay: Layout) -> str | None:
    return _over_tp("--ffn-hidden-size", m.ffn, lay, "the MLP width, F / tp columns of fc1 per rank")


def vocabulary_over_tp(m: ModelShape, lay: Layout) -> str | None:
    return _over_tp("the padded vocabulary", m.vocab_size, lay, "V / tp rows of the embedding per rank")


def query_groups(m: ModelShape, lay: Layout) -> str | None:
    """megatron-core's rule with this engine's replicated K/V heads: tp | g (split) or g | tp."""
    g, tp, n = m.num_query_groups, lay.tp, m.num_attention_heads
    if g is None or g < 1 or g % tp == 0 or tp % g == 0:
        return None
    ok = [d for d in range(1, n + 1) if n % d == 0 and (d % tp == 0 or tp % d == 0)]
    return (
        f"--num-query-groups {g} with {TP} {tp}: the K/V heads are split over the tp ranks when tp "
        f"divides the groups and replicated when the groups divide tp; {g} is neither a multiple nor a "
        f"divisor of {tp}: choose --num-query-groups in {ok} or another tp"
    )


def sequence_over_2cp(m: ModelShape, lay: Layout) -> str | None:
    """Context parallelism cuts the sequence into 2 cp equal chunks, two per cp rank (the
    load-balanced causal split of ``context_parallel/ring_attention.py``)."""
    return context_chunks_error(m.seq_length, lay.cp) if m.seq_length is not None else None


def context_chunks_error(seq_length: int, cp: int) -> str | None:
    """:func:`sequence_over_2cp` on a sequence length alone (ring attention checks the tokens it gets)."""
    if cp > 1 and seq_length % (2 * cp):
        return (
            f"--seq-length {seq_length} is not divisible by 2 x {CP} {cp} = {2 * cp} (each cp rank "
            f"holds two of the 2 cp equal chunks): use a multiple of {2 * cp}"
        )
    return None


def sequence_over_sp(m: ModelShape, lay: Layout) -> str | None:
    T, tp, cp = m.seq_length, lay.tp, lay.cp
    if not lay.sequence_parallel or T is None or T % (cp * tp) == 0:
        return None
    sizes, what = f"{TP} {tp}", "it"
    if cp > 1:
        sizes, what = f"{sizes} x {CP} {cp}", "each context-parallel rank's tokens"
    return (
        f"--seq-length {T} is not divisible by {sizes}, as --sequence-parallel splits {what} over tp: "
        f"use a multiple of {cp * tp}"
    )


def sequence_parallel_needs_tp(m: ModelShape, lay: Layout) -> str | None:
    return sequence_parallel_error(lay.sequence_parallel, lay.tp)


def no_ring_dropout(m: ModelShape, lay: Layout) -> str | None:
    if lay.cp > 1 and m.attention_dropout > 0:
        return (
            f"{CP} {lay.cp} with --attention-dropout {m.attention_dropout}: ring attention has no "
            f"dropout; set it to 0"
        )
    return None


def experts_over_ep(m: ModelShape, lay: Layout) -> str | None:
    E, ep = m.num_experts, lay.ep
    if E is None:
        if ep > 1:
            return (
                f"--expert-model-parallel-size {ep} needs --num-experts: expert parallelism splits the "
                f"experts of a mixture-of-experts MLP"
            )
        return None
    if E % ep:
        return (
            f"--num-experts {E} is not divisible by --expert-model-parallel-size {ep}: each rank holds "
            f"E / ep whole experts; choose a multiple of {ep} experts or an ep that divides {E}"
        )
    return None


def moe_needs_sp(m: ModelShape, lay: Layout) -> str | None:
    """megatron-core's rule (``MoELayer.forward``): MoE with tp > 1 trains with sequence parallelism."""
    if m.num_experts is not None and lay.tp > 1 and not lay.sequence_parallel:
        return (
            f"--num-experts with {TP} {lay.tp} needs --sequence-parallel (as in megatron-core: the tp "
            f"ranks route different T / tp tokens, and the experts are split over them); add --sequence-parallel"
        )
    return None


def layers_over_stages(m: ModelShape, lay: Layout) -> str | None:
    """The layers split evenly over the pp stages and, interleaved, over their v chunks each."""
    L, pp, vp = m.num_layers, lay.pp, lay.vp
    if L % (pp * vp) == 0:
        return None
    chunks = f" x {vp} virtual stages per rank = {pp * vp}" if vp > 1 else ""
    fits = [p for p in range(1, L + 1) if L % (p * vp) == 0 and lay.world_size % p == 0]
    return (
        f"--num-layers {L} is not divisible by --pipeline-model-parallel-size {pp}{chunks}: every stage "
        f"holds the same number of layers; use a multiple of {pp * vp} layers or pp in {fits}"
    )


#: Every rule, by name, in the order messages list them.
RULES: dict[str, Callable[[ModelShape, Layout], str | None]] = {
    "head size": head_size,
    "heads over tp": heads_over_tp,
    "FFN over tp": ffn_over_tp,
    "vocabulary over tp": vocabulary_over_tp,
    "query groups against tp": query_groups,
    "sequence over 2cp": sequence_over_2cp,
    "sequence over cp x tp under SP": sequence_over_sp,
    "sequence parallelism needs tp": sequence_parallel_needs_tp,
    "no attention dropout under cp": no_ring_dropout,
    "experts over ep": experts_over_ep,
    "MoE under tp needs SP": moe_needs_sp,
    "layers over pp x vp": layers_over_stages,
}


def model_layout_errors(model: ModelShape, layout: Layout) -> list[str]:
    """The message of every rule of :data:`RULES` that ``model`` on ``layout`` breaks."""
    return [error for rule in RULES.values() if (error := rule(model, layout))]


def check_model_layout(model: ModelShape, layout: Layout) -> None:
    """Raise one ``ValueError`` naming every broken rule (values and fix), before any compute."""
    errors = model_layout_errors(model, layout)
    if errors:
        raise ValueError(
            f"the model does not fit the layout (tp {layout.tp}, cp {layout.cp}, pp {layout.pp}"
            f"{f' x vp {layout.vp}' if layout.vp > 1 else ''}, dp {layout.dp}, ep {layout.ep}): "
            + "; ".join(errors)
        )

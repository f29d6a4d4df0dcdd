"""Llama 3.1 / 3.2's RoPE frequencies in ``config.json`` <-> Megatron-LM's ``--use-rope-scaling``.

transformers reads ``rope_parameters`` (``rope_scaling`` in older files, its kind spelt
``rope_type`` or ``type``: ``llama.standard`` makes both ``rope_parameters`` with ``rope_type``)::

    "rope_type": "llama3", "factor": 8.0 (3.1) or 32.0 (3.2),
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192

megatron-core computes the same frequencies (``transformer/rope.py``'s ``llama3_frequencies``)
with ``factor`` its one flag, ``--rope-scaling-factor`` (default 8.0), and the other three fixed at
those values. A file with other values, or another kind of scaling (linear, dynamic, yarn, longrope),
is refused by name: the course would compute other angles.
"""

from __future__ import annotations

from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.rope import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_CONTEXT,
)

#: The llama3 fields megatron-core fixes: name -> its value.
FIXED = {
    "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
    "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
    "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
}


def _kind(rope: dict) -> str:
    return rope.get("rope_type") or rope.get("type") or "default"


def refused(rope: dict) -> list[str]:
    """What of a standard ``rope_parameters`` the course cannot compute, each naming the field."""
    kind = _kind(rope)
    if kind == "default":
        return []
    if kind != "llama3":
        return [f"rope_parameters.rope_type {kind!r} (the course computes default RoPE, or llama3's "
                f"with --use-rope-scaling)"]  # fmt: skip
    return [
        f"rope_parameters.{name} {rope.get(name)!r} (megatron-core's llama3 scaling fixes it at {value:g})"
        for name, value in FIXED.items()
        if rope.get(name) != value
    ]


def course_args(rope: dict) -> dict:
    """``--use-rope-scaling --rope-scaling-factor f`` for llama3, nothing for default RoPE."""
    if _kind(rope) != "llama3":
        return {}
    return {"use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}


def hf_rope(cfg: GPTConfig) -> dict:
    """``rope_parameters`` of a course run."""
    rope = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    if cfg.rope_scaling:
        rope |= {"rope_type": "llama3", "factor": float(cfg.rope_scaling_factor)} | {
            k: float(v) if k != "original_max_position_embeddings" else v for k, v in FIXED.items()
        }
    return rope

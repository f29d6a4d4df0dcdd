"""Where and how the run saves and loads: Megatron-LM's checkpointing flags as one typed config.

Built from the command line once, by ``arguments/to_configs.py``; read by ``checkpointer.py``,
``checkpointing.py`` (``--ckpt-format torch``) and ``dist_checkpointing.py`` (``torch_dist``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The formats written here (``--ckpt-format``).
CKPT_FORMATS = ("torch", "torch_dist")


@dataclass(frozen=True)
class CheckpointConfig:
    """The folders, the format, and what a load restores; with the run's arguments, which every
    checkpoint carries (its ``"args"``, as Megatron-LM's) and a load is checked against."""

    save: str | None = None
    """The folder saves write to (None: no saves)."""
    load: str | None = None
    """The folder a run resumes from."""
    ckpt_format: str = "torch_dist"
    """The saves': torch_dist (DCP: every rank writes its part) or torch (one file per tp x pp x ep
    rank); a load reads the format it finds (``Checkpointer.load``)."""
    async_save: bool = False
    """torch_dist: stage to CPU memory, write in a thread while training goes on."""
    no_load_optim: bool = False
    """Load without the optimizer state (fresh moments, fresh loss scale)."""
    no_load_rng: bool = False
    """Load without the random-number generators' states."""
    distributed_timeout_minutes: float = 5.0
    """The timeout of ``async_save``'s own gloo group."""
    arguments: dict = field(default_factory=dict)
    """The run's arguments by name (``dataclasses.asdict`` of the command line): saved in every
    checkpoint; a load checks the saved ones against them (``checkpointing.MUST_MATCH``, and the
    padded vocabulary's ``--make-vocab-size-divisible-by`` x tp for torch_dist)."""

    def __post_init__(self) -> None:
        if self.ckpt_format not in CKPT_FORMATS:
            raise ValueError(f"ckpt_format {self.ckpt_format!r}: choose one of {', '.join(CKPT_FORMATS)}")

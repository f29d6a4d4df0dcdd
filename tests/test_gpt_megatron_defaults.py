"""Every flag the engine shares with Megatron-LM has Megatron-LM's spelling and default, against a
snapshot of Megatron-LM's own parser (``megatron_defaults.py`` makes it); the few that differ are
listed with the reason, and a default that changes on either side fails here."""

from __future__ import annotations

import signal

import pytest

from distlab.gpt.arguments.parser import build_parser
from tests.megatron_defaults import load

#: Defaults that differ in spelling only: (ours, Megatron's), the same meaning.
SAME_MEANING = {
    "attention_backend": ("auto", "<AttnBackend.auto: 5>"),  # Megatron's enum member, here its name
    "exit_signal": ("SIGTERM", int(signal.SIGTERM)),  # Megatron parses the name into the number
    "no_load_optim": (False, None),  # a switch: not given is false either way
    "no_load_rng": (False, None),
}

#: Defaults that differ on purpose, and why.
DIFFERENT = {
    "distributed_backend": "None picks the backend from the hardware (nccl with CUDA, else gloo), so one "
    "command runs on the GPU cluster and on the CPU cluster; Megatron-LM always defaults to nccl",
}


def ours() -> dict:
    """dest -> (the flags of every action writing it, the first action's default)."""
    table: dict = {}
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            flags, default = table.get(action.dest, ([], action.default))
            table[action.dest] = ([*flags, *action.option_strings], default)
    return table


SNAPSHOT = load()["defaults"]


@pytest.mark.engine_fast
@pytest.mark.parametrize("dest", sorted(SNAPSHOT))
def test_a_shared_flag_has_megatrons_spelling_and_default(dest):
    flags, default = ours()[dest]
    theirs = SNAPSHOT[dest]
    assert theirs["flags"][0] in flags, f"Megatron-LM spells it {theirs['flags']}; here {flags}"
    if dest in DIFFERENT:
        assert default != theirs["default"], f"{dest} now equals Megatron-LM's: drop it from DIFFERENT"
    elif dest in SAME_MEANING:
        assert (default, theirs["default"]) == SAME_MEANING[dest]
    else:
        assert default == theirs["default"], (
            f"--{dest.replace('_', '-')}: {default!r} here, Megatron-LM's {theirs['default']!r}"
        )


@pytest.mark.engine_fast
def test_the_snapshot_covers_the_flags_it_should():
    """Flags here that Megatron-LM lacks are the engine's own (DeepSpeed's, the dry run, the course's
    profiler switch), and Megatron-LM's older name of the virtual pipeline size (its current one,
    --num-virtual-stages-per-pipeline-rank, writes the same field here): a Megatron-LM flag renamed
    here would show up in that list, not pass silently."""
    own = sorted(set(ours()) - set(SNAPSHOT))
    assert own == [
        "data_impl", "deepspeed", "deepspeed_config", "device_memory_gib", "dry_run_rank", "dry_run_world_size",
        "log_batch_size_to_tensorboard", "pipeline_schedule", "pipeline_timeline", "profile_execution",
        "profile_name", "tensor_parallel_impl", "torch_compile", "torch_fsdp2_cpu_offload",
        "virtual_pipeline_model_parallel_size", "zero_stage",
    ]  # fmt: skip

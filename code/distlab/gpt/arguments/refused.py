"""Megatron's flags that this engine parses only to refuse, before any compute, each with why
and what to use instead: FP8 (Transformer Engine on Hopper GPUs), Weights & Biases (no network,
no package)."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.arguments.fields import _f


@dataclass
class RefusedArgs:
    """Flags of Megatron-LM's example scripts refused here (Megatron's names and defaults)."""

    fp8: str = _f(
        None, "FP8 GEMMs through Transformer Engine (e4m3 or hybrid): refused here", flag="--fp8-format",
        choices=["e4m3", "hybrid"],
    )  # fmt: skip
    fp8_amax_history_len: int = _f(1, "FP8 delayed scaling's amax history: refused here")
    fp8_amax_compute_algo: str = _f(
        "most_recent", "FP8 delayed scaling's amax choice: refused here", choices=["most_recent", "max"]
    )
    fp8_param_gather: bool = _f(False, "all-gather FP8 parameters: refused here")
    wandb_project: str = _f(None, "Weights & Biases project: refused here (use --tensorboard-dir)")
    wandb_exp_name: str = _f(None, "Weights & Biases run name: refused here (use --tensorboard-dir)")


def refused_errors(args: RefusedArgs, cuda: bool) -> list[str]:
    """One message per refused flag given: what it asks for, why not here, what instead."""
    errors = []
    fp8 = [
        flag
        for flag, given in (
            (f"--fp8-format {args.fp8}", args.fp8 is not None),
            (f"--fp8-amax-history-len {args.fp8_amax_history_len}", args.fp8_amax_history_len != 1),
            (f"--fp8-amax-compute-algo {args.fp8_amax_compute_algo}", args.fp8_amax_compute_algo != "most_recent"),
            ("--fp8-param-gather", args.fp8_param_gather),
        )
        if given
    ]  # fmt: skip
    if fp8:
        where = "" if cuda else "; this machine has no GPU at all"
        errors.append(
            f"{' '.join(fp8)}: FP8 GEMMs run in NVIDIA Transformer Engine's layers on Hopper (sm_90) or "
            f"newer GPUs, and this engine's layers are PyTorch's, without Transformer Engine{where}: drop "
            f"the --fp8-* flags and train in --bf16"
        )
    wandb = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in ("wandb_project", "wandb_exp_name")
             if getattr(args, n) is not None]  # fmt: skip
    if wandb:
        errors.append(
            f"{' '.join(wandb)}: Weights & Biases is not installed and the cluster's nodes reach no "
            f"outside server: drop the --wandb-* flags; --tensorboard-dir DIR writes the same scalars"
        )
    return errors

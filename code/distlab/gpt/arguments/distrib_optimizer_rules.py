"""What ``--use-distributed-optimizer`` and ``--overlap-param-gather`` need (checked before compute).

Megatron-LM's own rules: ``--overlap-param-gather`` only with the distributed optimizer, and only
with ``--overlap-grad-reduce``. This engine's: the distributed optimizer is its own back end's
(not DeepSpeed's or FSDP2's, which shard in their own ways), over the hand-written tensor
parallelism. Everything else is built as Megatron's (``optimizer/distrib_optimizer.py``): fp32,
bf16 and fp16 parameters (fp16 with loss scaling on the shards), interleaved pipelining (each
model chunk its own buckets), and expert parallelism (the experts' buckets sharded over their
expert-data-parallel group).
"""

from __future__ import annotations

from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.layout import Layout


def distributed_optimizer_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    errors = []
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        errors.append(
            "--overlap-param-gather is only supported with the distributed optimizer: add "
            "--use-distributed-optimizer or drop --overlap-param-gather"
        )
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        errors.append("--overlap-param-gather must be used with --overlap-grad-reduce: add it")
    if not args.use_distributed_optimizer:
        return errors
    refused = (
        ("--deepspeed", args.deepspeed, "DeepSpeed's ZeRO stage 1 (--zero-stage 1) is its own"),
        ("--use-torch-fsdp2", args.use_torch_fsdp2, "FSDP2 shards the optimizer state itself"),
        ("--tensor-parallel-impl dtensor", args.tensor_parallel_impl == "dtensor" and layout.tp > 1,
         "use the default --tensor-parallel-impl local"),
    )  # fmt: skip
    for flag, given, fix in refused:
        if given:
            errors.append(f"--use-distributed-optimizer with {flag}: not supported by this engine; {fix}")
    return errors

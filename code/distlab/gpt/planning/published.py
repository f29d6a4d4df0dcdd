"""Published runs the step-time model must predict (syllabus sections 11 and 13), and its predictions.

    torchtitan Llama 3.1 8B, FSDP on 8 H100, local batch 2 x 8,192 tokens, selective activation
        checkpointing: 5,762 tokens/s/GPU (benchmarks/llama3_h100_202412_torchtitan.md, Table 1;
        Grand Teton H100s with 96 GB HBM2e at 500 W, whose peak lies between SXM's and NVL's)
    Megatron-LM GPT-3 175B (vocabulary 131,072) on 96 H100, batch 1,152 x 2,048: ~47% MFU (its
        README's strong scaling). The layout is not in the README's text; assumed: NeMo's GPT-3
        175B layout on DGX H100, tp 4, pp 8, v 6, micro batch 1
    Llama 3 405B (Llama 3 paper, 2024, Table 4), tp 8, pp 16, micro batch 1, 16M tokens a step:
        8,192 GPUs, dp 64, 8,192 tokens: 43%; 16,384 GPUs, dp 128: 41%;
        16,384 GPUs, cp 16, dp 8, 131,072 tokens: 38%. The paper interleaves its pipeline stages but
        its table gives no v: v = 2 is assumed (126 layers: about 4 per chunk)

The runs' own parameter counts give the gradients reduced per rank, N / (tp x pp). MFU is
compared as Megatron-LM counts it (causal attention at half, no recomputation: ``utilization.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.arguments import PretrainArgs, parse_args
from distlab.gpt.layout import Layout
from distlab.gpt.planning.hardware import load
from distlab.gpt.planning.step_model import StepPrediction, predict_step

LLAMA = (
    "--swiglu --group-query-attention --num-query-groups 8 --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256 --bf16 --lr 1e-4"
)
LLAMA_8B = f"--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 {LLAMA}"
LLAMA_405B = f"--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 {LLAMA}"
GPT3_175B = (
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --vocab-size 131072 --bf16 --lr 1e-4"
)
MEGATRON = "--sequence-parallel --overlap-grad-reduce"


@dataclass(frozen=True)
class PublishedRun:
    """A run as published: flags of the model and batch, layout, machine, parameters, figure."""

    name: str
    argv: str
    world: int
    sizes: dict  # tp, pp, cp, vp
    micro_batch_size: int
    parameters: float
    metric: str  # "tokens/s/GPU" or "MFU"
    published: float
    hardware: str = "h100_sxm_node"
    distributed_optimizer: bool = True

    def args(self) -> PretrainArgs:
        return parse_args(self.argv.split())

    def layout(self) -> Layout:
        args = self.args()
        sp = self.sizes.get("tp", 1) > 1
        return Layout(self.world, **self.sizes, micro_batch_size=self.micro_batch_size,
                      global_batch_size=args.global_batch_size, sequence_parallel=sp)  # fmt: skip

    def predict(self) -> StepPrediction:
        args, layout = self.args(), self.layout()
        per_rank = self.parameters / (layout.tp * layout.pp)
        return predict_step(args, layout, load(self.hardware), args.vocab_size, per_rank,
                            distributed_optimizer=self.distributed_optimizer)  # fmt: skip

    def predicted(self, prediction: StepPrediction | None = None) -> float:
        """The published metric of ``prediction`` (default: :meth:`predict`)."""
        p = prediction or self.predict()
        return p.tokens_per_s_per_device if self.metric == "tokens/s/GPU" else p.mfu

    def error(self, prediction: StepPrediction | None = None) -> float:
        """(predicted - published) / published."""
        return (self.predicted(prediction) - self.published) / self.published


RUNS = (
    PublishedRun("torchtitan Llama 3.1 8B FSDP, 8 H100",
                 f"{LLAMA_8B} --seq-length 8192 --micro-batch-size 2 --global-batch-size 16 --use-torch-fsdp2",
                 8, {}, 2, 8.03e9, "tokens/s/GPU", 5762.0, distributed_optimizer=False),
    PublishedRun("Megatron-LM GPT-3 175B, 96 H100",
                 f"{GPT3_175B} {MEGATRON} --seq-length 2048 --micro-batch-size 1 --global-batch-size 1152",
                 96, {"tp": 4, "pp": 8, "vp": 6}, 1, 175e9, "MFU", 0.47),
    PublishedRun("Llama 3 405B, 8,192 H100 (tp 8 pp 16 dp 64)",
                 f"{LLAMA_405B} {MEGATRON} --seq-length 8192 --micro-batch-size 1 --global-batch-size 2048",
                 8192, {"tp": 8, "pp": 16, "vp": 2}, 1, 405e9, "MFU", 0.43),
    PublishedRun("Llama 3 405B, 16,384 H100 (tp 8 pp 16 dp 128)",
                 f"{LLAMA_405B} {MEGATRON} --seq-length 8192 --micro-batch-size 1 --global-batch-size 2048",
                 16384, {"tp": 8, "pp": 16, "vp": 2}, 1, 405e9, "MFU", 0.41),
    PublishedRun("Llama 3 405B, 16,384 H100, 131k tokens (cp 16 dp 8)",
                 f"{LLAMA_405B} {MEGATRON} --seq-length 131072 --micro-batch-size 1 --global-batch-size 128",
                 16384, {"tp": 8, "pp": 16, "cp": 16, "vp": 2}, 1, 405e9, "MFU", 0.38),
)  # fmt: skip


def table(predictions: list[StepPrediction] | None = None) -> list[str]:
    """One line per published run: published, predicted, error, and where the predicted step goes
    (``predictions``: those of :data:`RUNS`, in order, when already made)."""
    predictions = predictions or [run.predict() for run in RUNS]
    lines = [
        f"{'run':52s} {'metric':>13s} {'published':>10s} {'predicted':>10s} {'error':>7s}  step, bubble, exposed"
    ]
    for run, p in zip(RUNS, predictions, strict=True):
        exposed = ", ".join(f"{k} {v:.2f}" for k, v in p.exposed.items() if v > 0) or "none"
        fmt = "{:10.0f}" if run.metric == "tokens/s/GPU" else "{:10.3f}"
        lines.append(
            f"{run.name:52s} {run.metric:>13s} {fmt.format(run.published)} {fmt.format(run.predicted(p))} "
            f"{100 * run.error(p):+6.1f}%  {p.step:.2f} s, {100 * p.bubble_fraction:.0f}%, {exposed} s"
        )
    return lines

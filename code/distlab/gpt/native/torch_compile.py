"""``--torch-compile``: every transformer block compiled with ``torch.compile`` (inductor).

``torch.compile`` traces a module's forward into an FX graph (TorchDynamo), derives the backward
(AOTAutograd) and generates fused kernels for both (inductor: C++/OpenMP on a CPU, which needs a C
compiler at run time; Triton on a GPU). Compiling each block, not the whole model, is torchtitan's
choice (``compile.enable``): the L blocks have the same code and shapes, and their parameters are
graph inputs, so one graph serves them all (traced and compiled once, on the first block of the
first iteration), and FSDP2's per-block all-gathers and reduce-scatters stay outside the graph::

    first iteration   trace + generate + compile the kernels (seconds), then run
    later iterations  run the cached kernels: the steady-state step time

The arithmetic is the same up to the order of floating-point operations inside fused kernels:
fp32 losses agree with eager ones to about 1e-6 (relative), not to the bit. Dropout draws from
inductor's own random stream, not eager's: with --hidden-dropout or --attention-dropout > 0 the
two runs drop out different units (same expectation, other losses).
"""

from __future__ import annotations

import statistics

from torch import nn

from distlab.log_line import LogLine

#: The end of a --torch-compile run (``torch_compile.timing_line``): the first iteration's time
#: (it compiles) and the median of the others, from the iteration lines' elapsed times.
COMPILE = LogLine(
    "> torch.compile: first iteration {first_ms:.1f} ms (tracing and code generation included) | "
    "steady state {steady_ms:.1f} ms per iteration (median of the {n:d} after it)"
)


def compile_blocks(layers: nn.ModuleDict) -> str:
    """Compile every block in place (``nn.Module.compile``: the module keeps its parameters and
    state-dict keys, so checkpoints, FSDP2 and DTensor plans see the same names); the start-up line."""
    for block in layers.values():
        block.compile()
    return (
        f"> torch.compile: each of the {len(layers)} blocks compiled (inductor, one graph for all), "
        f"on its first forward"
    )


def timing_line(iteration_ms: list[float]) -> str | None:
    """The end-of-training line: the first iteration (which compiles) and the median of the
    others; None with fewer than 2 iterations (no steady state to show)."""
    if len(iteration_ms) < 2:
        return None
    rest = iteration_ms[1:]
    return COMPILE.format(first_ms=iteration_ms[0], steady_ms=statistics.median(rest), n=len(rest))

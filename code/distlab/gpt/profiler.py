"""torch.profiler traces of training steps, in the layout TensorBoard's PyTorch Profiler reads."""

from __future__ import annotations

import os

import torch

from distlab.gpt.arguments import PretrainArgs


class StepProfiler:
    """torch.profiler over the first three steps of rank 0: one warm-up, two traced.

    The trace lands in ``<tensorboard-dir>/<profile-name>/rank0.<time>.pt.trace.json``, the layout
    TensorBoard's PyTorch Profiler plugin reads (``tensorboard --logdir <tensorboard-dir>``).
    """

    def __init__(self, args: PretrainArgs, rank: int) -> None:
        self.folder = os.path.join(
            args.tensorboard_dir or os.path.join("runs", "tensorboard"), args.profile_name
        )
        self.prof, self.steps = None, 0
        if not args.profile_execution or rank != 0:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=acts, schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.folder, "rank0"), record_shapes=True,
        )  # fmt: skip
        self.prof.start()
        print(
            f"> profiling two training steps of rank 0 into {self.folder} (TensorBoard PyTorch Profiler)",
            flush=True,
        )

    def step(self) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self.steps += 1
        if self.steps == 3:
            self.stop()
            print(f"> profiler trace written under {self.folder}", flush=True)

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

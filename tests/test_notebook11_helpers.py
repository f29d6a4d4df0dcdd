"""Notebook 11's helpers: GPT-2 -> Llama one change at a time (``tools.architecture_steps``), a
launch script's command line without running it (``tools.launch_script``), and bytes per
parameter per rank from the memory lines (``logs.memory.bytes_per_parameter``)."""

from __future__ import annotations

import pytest
import torch

from distlab.gpt.memory.meters import MEMORY, RANK_COORDS
from distlab.gpt.optimizer.distrib_optimizer import bytes_per_parameter as table
from distlab.gpt.tools import architecture_steps
from distlab.gpt.tools.launch_script import script_argv
from distlab.logs.memory import bytes_per_parameter


def test_the_steps_end_at_llama3_8b() -> None:
    """Meta-device parameters land on Llama 3 8B's released count; GQA's 8 K/V heads of 32 cut the
    cache per token 4x (2 L g d values: 512 KiB -> 128 KiB in bf16); untying adds no FLOPs."""
    shape = architecture_steps.LLAMA3_8B
    arch = {k: v for _, change in architecture_steps.STEPS for k, v in change.items()}
    assert architecture_steps.parameters(shape, arch) == 8_030_261_248
    assert architecture_steps.kv_bytes_per_token(shape, arch) == 2 * 32 * 8 * 128 * 2
    assert architecture_steps.kv_bytes_per_token(shape, {}) == 2 * 32 * 32 * 128 * 2
    untied = {k: v for k, v in arch.items() if k != "untie_embeddings_and_output_weights"}
    assert architecture_steps.flops_per_token(shape, untied) == architecture_steps.flops_per_token(
        shape, arch
    )


def test_flops_of_two_blocks_extrapolate_exactly() -> None:
    """f(1) + (L - 1)(f(2) - f(1)) equals FlopCounterMode's count of the L-block model."""
    from distlab.gpt.training.flops import counted_flops

    shape = dict(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32)
    arch = dict(swiglu=True, num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm")
    direct = counted_flops(**shape, batch=1, **arch) / 32
    assert architecture_steps.flops_per_token(shape, arch) == direct


def test_script_argv_prints_what_the_script_passes(tmp_path) -> None:
    script = tmp_path / "train.sh"
    script.write_text(
        "ARGS=(--num-layers $LAYERS \"--split '99,1,0'\")\n"
        'torchrun --nproc_per_node 2 $CODE/pretrain_gpt.py ${ARGS[@]} --save "$1"\n'
    )
    words = script_argv(str(script), "ckpt dir", env={"LAYERS": "2", "CODE": "/x"})
    assert words == ["--num-layers", "2", "--split", "'99,1,0'", "--save", "ckpt dir"]
    (tmp_path / "none.sh").write_text("echo no launch\n")
    with pytest.raises(ValueError, match="no torchrun"):
        script_argv(str(tmp_path / "none.sh"))


def test_bytes_per_parameter_from_the_memory_lines() -> None:
    """bf16 with bf16 gradients and the distributed optimizer over d = 4: 2 + 2 + 16/4 = 8 bytes per
    parameter, the table's 4 + 16/d, told apart from 6 + 12/d = 9 and 8 + 8/d = 10 (at d = 2 all three
    give 12)."""
    values, mib = 100_000, 100_000 / 2**20
    lines = [MEMORY.format(rank=r, coords=RANK_COORDS.format(tp=0, pp=0, dp=r), params_mib=2 * mib, values=values,
                           grads_mib=2 * mib, optim_mib=4 * mib, peak_kind="peak RSS", peak_mib=800.0)
             for r in range(4)]  # fmt: skip
    got, rounding = bytes_per_parameter("\n".join(lines))
    bf16, fp32 = torch.bfloat16, torch.float32
    assert abs(got - table(bf16, 4, bf16)) <= rounding < 0.2
    assert all(abs(got - other) > rounding for other in (table(bf16, 4, fp32), table(fp32, 4, fp32)))
    assert table(bf16, 2, bf16) == table(bf16, 2, fp32) == table(fp32, 2, fp32) == 12
    with pytest.raises(ValueError, match="memory"):
        bytes_per_parameter("no such line")

"""``--ckpt-format torch_dist`` with the hand-written tensor parallelism and context parallelism
(``checkpointing/tp_chunks.py``), on the Llama architecture (RMSNorm, RoPE, SwiGLU, GQA with 2
groups, untied output layer, no biases).

- tp 2 on 2 gloo ranks (a random Llama's shards, and a Llama-MoE's with 4 SwiGLU experts; one Adam
  step) saved, then loaded into one process at tp 1: every weight and Adam moment equal to the bit
  to the tp ranks' parts put back together (``unshard``; SwiGLU's fc1 by its halves); a run that
  pads the vocabulary otherwise is refused with both sizes; ``convert_checkpoint.py --to hf`` reads the same checkpoint and
  transformers' ``LlamaForCausalLM`` (``MixtralForCausalLM``) computes the model's logits (within
  1e-5, fp32).
- ``pretrain`` at tp 2 x cp 2 on 4 ranks, fp32, with AdamW and with the distributed optimizer and
  both overlaps (Megatron's Llama 3 script's): saved with ``--async-save`` (DCP's stager keeps the
  chunks' places) at iteration 3 and resumed there at tp 2 x cp 2, the losses and gradient norms
  of iterations 4-6 equal to the bit (the whole state comes back: weights, moments, step, fp32
  shards, RNG, data position; the same sums in the same order).
  Loaded at tp 1 on one process: AdamW's run gives the losses within 1e-5 (one process sums over
  tp and cp in another order: the layouts' tolerance, ``test_gpt_llama_layouts.py``); the
  distributed optimizer's state is refused (dp_reshardable) naming the fix, and with
  ``--no-load-optim`` iteration 4's loss, a function of the weights alone, is within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distlab.distributed import DistContext
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import checkpoint_config, model_config, optimizer_config
from distlab.gpt.checkpointing import dist_checkpointing
from distlab.gpt.checkpointing.checkpointing import Snapshot
from distlab.gpt.layout import Layout
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.layers import shard, unshard
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_runs import prepare_data, spawn_pretrain
from tests.conftest import TINY_GPT_ARGV, entry_script, run_gloo
from tests.test_gpt_dist_checkpoint import _resume_from_3
from tests.test_gpt_hf_llama import FAMILIES, LLAMA_ARGS, VOCAB, course_model, tokens

transformers = pytest.importorskip("transformers")
convert_checkpoint = entry_script("convert_checkpoint")
pytestmark = pytest.mark.timeout(600)

LLAMA = (
    "--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights"
).split()
STEPS = ["--train-iters", "6", "--lr-decay-iters", "6", "--eval-interval", "100", "--eval-iters", "0"]
TP2_CP2 = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "3000"]  # fmt: skip


def _args(family: str, tp: int, root: str, **more) -> PretrainArgs:
    """V = 128: padded so by --make-vocab-size-divisible-by 64 at tp 2 and 128 at tp 1 (the default)."""
    return PretrainArgs(**LLAMA_ARGS, **FAMILIES[family][1], untie_embeddings_and_output_weights=True,
                        tensor_model_parallel_size=tp, save=root, load=root, ckpt_format="torch_dist", lr=0.1,
                        **more)  # fmt: skip


def _tags(model: GPTModel) -> dict[str, tuple[int | None, int]]:
    return {
        n: (getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
        for n, p in model.named_parameters()
    }


def _tp2_scenario(ctx: DistContext, root: str, family: str) -> None:
    """tp 2: the random one-process Llama's (Llama-MoE's, with SP as MoE with tp needs) shards, one
    Adam step on whole gradients' shards, saved; each rank's parameters and moments dumped beside."""
    state = ParallelState.build(Layout(2, tp=2, sequence_parallel=family == "mixtral"))
    args = _args(family, 2, root, make_vocab_size_divisible_by=64, sequence_parallel=family == "mixtral")
    whole = course_model(family)[0].state_dict()
    model = GPTModel(model_config(args, VOCAB, sequence_parallel=family == "mixtral"), state)
    with torch.no_grad():
        for name, p in model.named_parameters():
            dim, stride = _tags(model)[name]
            grad = torch.randn(whole[name].shape, generator=torch.Generator().manual_seed(len(name)))
            p.copy_(whole[name] if dim is None else shard(whole[name], dim, 2, state.tp_rank, stride))
            p.grad = grad if dim is None else shard(grad, dim, 2, state.tp_rank, stride)
    optimizer = build_optimizer(model, optimizer_config(args))
    optimizer.step()
    dist_checkpointing.save_checkpoint(checkpoint_config(args), state, Snapshot(model, optimizer, None, 1, 8))
    moments = {n: optimizer.state[p] for n, p in model.named_parameters()}
    torch.save(
        {"params": dict(model.named_parameters()), "moments": moments}, Path(root, f"rank{ctx.rank}.pt")
    )


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def tp2(request, tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp(request.param)
    run_gloo(_tp2_scenario, 2, str(root), request.param)
    return root, request.param


def test_a_tp2_checkpoint_loads_at_tp1_equal_to_its_shards(tp2) -> None:
    tp2, family = tp2
    args = _args(family, 1, str(tp2))
    model = GPTModel(model_config(args, VOCAB))
    optimizer = build_optimizer(model, optimizer_config(args))
    assert dist_checkpointing.load_checkpoint(
        checkpoint_config(args), ParallelState(Layout(1), rank=0), model, optimizer
    ) == (
        1,
        8,
        None,
    )
    ranks = [torch.load(tp2 / f"rank{r}.pt", weights_only=False) for r in range(2)]
    tags = _tags(model)  # where the initialiser cuts each tensor for tp ranks (SwiGLU's fc1 by its halves)
    for name, p in model.named_parameters():
        dim, stride = tags[name]
        parts = [r["params"][name].detach() for r in ranks]
        assert torch.equal(p.detach(), unshard(parts, dim, stride) if dim is not None else parts[0]), name
        for key in ("exp_avg", "exp_avg_sq"):
            moment = [r["moments"][name][key] for r in ranks]
            want = unshard(moment, dim, stride) if dim is not None else moment[0]
            assert torch.equal(optimizer.state[p][key], want), f"{name} {key}"
        assert optimizer.state[p]["step"] == 1
    split = [name for name, (dim, _) in tags.items() if dim is not None]
    experts = 4 if family == "mixtral" else 1  # SwiGLU's fc1 and fc2 in each expert
    assert len(split) == 2 + (2 + 2 * experts) * 2  # E, output; qkv, proj, fc1s and fc2s of both blocks
    assert sum(stride == 2 for _, stride in tags.values()) == experts * 2


def test_a_vocabulary_padded_otherwise_is_refused(tp2) -> None:
    tp2, family = tp2
    args = _args(family, 1, str(tp2), make_vocab_size_divisible_by=64)
    model = GPTModel(model_config(args, 64))
    with pytest.raises(
        ValueError,
        match=r"holds a padded vocabulary of 128 rows .* pads to 64 .*divisible-by 64 x tp 1\): .*give --make-vocab-size-divisible-by 128$",
    ):
        dist_checkpointing.load_checkpoint(
            checkpoint_config(args),
            ParallelState(Layout(1), rank=0),
            model,
            build_optimizer(model, optimizer_config(args)),
        )


def test_convert_to_hf_reads_a_tp2_torch_dist_checkpoint(tp2, tmp_path) -> None:
    tp2, family = tp2
    assert convert_checkpoint.main(["--to", "hf", "--load", str(tp2), "--save", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == FAMILIES[family][0].hf_class
    args = _args(family, 1, str(tp2))
    model = GPTModel(model_config(args, VOCAB))
    dist_checkpointing.load_checkpoint(
        checkpoint_config(args),
        ParallelState(Layout(1), rank=0),
        model,
        build_optimizer(model, optimizer_config(args)),
    )
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model.eval()(tokens()), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=40).argv()


@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distributed-optimizer"])
def test_tp2_cp2_resumes_exactly_and_loads_at_tp1(data, tmp_path, distopt) -> None:
    argv = [
        *TINY_GPT_ARGV,
        *data,
        *LLAMA,
        *STEPS,
        *(DISTOPT if distopt else []),
        "--ckpt-format",
        "torch_dist",
    ]
    save = [
        "--save",
        str(tmp_path / "full"),
        "--save-interval",
        "3",
        "--async-save",
    ]  # DCP's stager keeps the chunks
    full = spawn_pretrain([*argv, *TP2_CP2, *save], 4, tmp_path / "f")
    same = _resume_from_3(tmp_path / "full", tmp_path / "same", [*argv, *TP2_CP2], 4)
    assert same.last["iterations"] == [4, 5, 6]
    assert same.last["losses"] == full.last["losses"][3:]  # bit-equal: the same state, the same sums
    assert same.last["grad_norms"] == full.last["grad_norms"][3:]
    if not distopt:  # Adam's moments reshard with their parameters: one process trains on alike
        one = _resume_from_3(tmp_path / "full", tmp_path / "tp1", argv, 1)
        assert one.last["iterations"] == [4, 5, 6]
        torch.testing.assert_close(one.last["losses"], full.last["losses"][3:], rtol=0, atol=1e-5)
        return
    with pytest.raises(
        Exception, match="written with --tensor-model-parallel-size 2 and this run has 1: .* --no-load-optim"
    ):
        _resume_from_3(tmp_path / "full", tmp_path / "tp1", argv, 1)
    one = [*argv, "--no-load-optim", "--train-iters", "4"]  # the last --train-iters counts
    weights = _resume_from_3(tmp_path / "full", tmp_path / "weights", one, 1)
    assert weights.last["iterations"] == [4]  # its loss is computed before the (fresh) optimizer steps
    torch.testing.assert_close(weights.last["losses"][0], full.last["losses"][3], rtol=0, atol=1e-5)

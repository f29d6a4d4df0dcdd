"""Sequence parallelism (``--sequence-parallel``): equal to one process, other collectives, refusals.

Whole runs: the tiny GPT of ``test_gpt_parallel_equivalence.py`` (4 layers, hidden 32, 4 heads,
sequence 16, global batch 8 of micro-batches of 2, 3 fp32 iterations) with TP2+SP on 2 ranks and
TP2+SP x PP2 on 4 ranks must give the single-process losses, gradient norms and validation loss
to ``rtol = atol = 1e-6``: the LayerNorm, bias and position-table gradients summed over the tp
group are sums of the same terms in another order.

One block, counted: on 2 ranks, a block without SP runs 2 all-reduces forward and 2 backward;
with SP none, but 2 all-gathers and 2 reduce-scatters forward, and backward 2 reduce-scatters and
4 all-gathers (the GEMM inputs gathered again for the weight gradients). The forward moves the
same ring bytes either way; its output is the no-SP output's sequence shard.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.arguments.implementations import implementation_lines
from distlab.gpt.distributed.gradients import reduce_gradients
from distlab.gpt.layout import Layout
from distlab.gpt.memory.activation_memory import measure_block, parse
from distlab.gpt.memory.memory_estimate import MemorySetup, block_bytes, korthikanti_layer_bytes
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import init_parameters
from distlab.gpt.transformer.transformer_layer import Block
from distlab.local_ranks import free_port, spawn_ranks
from distlab.local_runs import prepare_data, pretrain_as_rank
from tests.conftest import TINY_GPT_ARGV as MODEL
from tests.conftest import assert_same_training, run_gloo

pytestmark = pytest.mark.timeout(180)

RTOL = 1e-6
#: name: (first rank, ranks, extra flags). The reference (on rank 2) and TP2+SP (ranks 0, 1) run
#: at the same time, then TP2+SP x PP2 on all 4.
RUNS = {
    "reference": (2, 1, []),
    "tp2-sp": (0, 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-sp-pp2": (0, 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--sequence-parallel"]),
}  # fmt: skip


def _worker(rank: int, plan: list, out: str) -> None:
    torch.set_num_threads(1)
    for name, first, ranks, argv, port in plan:
        if first <= rank < first + ranks:
            local = rank - first  # this process's rank in that run
            log = Path(out, f"{name}.rank{local}.log")
            history = pretrain_as_rank(local, ranks, port, argv, log)
            history["log"] = log.read_text()
            Path(out, f"{name}.rank{local}.json").write_text(json.dumps(history))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gpt_sp")
    data = prepare_data(base / "data", vocab_size=512, max_files=40).argv()
    plan = [(name, *where, [*MODEL, *data, *flags], free_port()) for name, (*where, flags) in RUNS.items()]
    spawn_ranks(_worker, (plan, str(base)), 4)
    return base


def _history(folder: Path, name: str, rank: int) -> dict:
    return json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize("name", ["tp2-sp", "tp2-sp-pp2"])
def test_sequence_parallel_matches_single_process(runs: Path, name: str) -> None:
    ref, world = _history(runs, "reference", 0), RUNS[name][1]
    last = _history(runs, name, world - 1)
    assert len(last["losses"]) == 3
    assert_same_training(last, ref, name, tol=RTOL)
    assert ref["losses"][-1] < ref["losses"][0]  # the reference learns: the comparison is not vacuous
    assert "tensor-model-parallel size: 2" in _history(runs, name, 0)["log"]


def _args(*flags: str):
    return parse_args([*MODEL, *flags])


def test_sequence_parallel_without_tensor_parallelism_is_turned_off_as_megatron_does() -> None:
    """Megatron's validate_args disables --sequence-parallel when tp is 1 (its Llama 3 example
    passes it with tp 1); the start-up log says so."""
    args = _args(
        "--sequence-parallel", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"
    )
    layout = validate_args(args, world_size=2)
    assert not layout.sequence_parallel and layout.tp == 1
    lines = implementation_lines(args, cuda=False)
    assert any("--sequence-parallel with --tensor-model-parallel-size 1: off" in line for line in lines)


def test_sequence_not_divisible_by_tp_is_refused() -> None:
    args = _args("--sequence-parallel", "--tensor-model-parallel-size", "4", "--seq-length", "18",
                 "--max-position-embeddings", "18")  # fmt: skip
    with pytest.raises(ValueError, match=r"--seq-length 18 is not divisible by --tensor-model-parallel-size 4.*"
                                         r"use a multiple of 4"):  # fmt: skip
        validate_args(args, world_size=4)
    without_sp = _args(
        "--tensor-model-parallel-size", "4", "--seq-length", "18", "--max-position-embeddings", "18"
    )
    with pytest.raises(ValueError) as plain:  # only the missing data files: T = 18 is fine without SP
        validate_args(without_sp, world_size=4)
    assert "--data-path is required" in str(plain.value) and "--seq-length" not in str(plain.value)


def test_sequence_parallel_with_context_parallelism_splits_each_cp_ranks_tokens() -> None:
    """SP with cp (Megatron's Llama 3 script at tp 2 x cp 2): accepted, and the sequence must split
    into 2 cp chunks and each cp rank's T / cp tokens over tp. T = 20, cp 2, tp 4: 4 chunks of 5,
    but 10 tokens per cp rank do not split over 4 tp ranks."""
    mock = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64")
    layout = validate_args(
        _args(
            "--sequence-parallel", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", *mock
        ),
        world_size=4,
    )
    assert layout.sequence_parallel and (layout.tp, layout.cp) == (2, 2)
    args = _args("--sequence-parallel", "--tensor-model-parallel-size", "4", "--context-parallel-size", "2",
                 "--seq-length", "20", "--max-position-embeddings", "20", *mock)  # fmt: skip
    with pytest.raises(ValueError, match=r"--seq-length 20 is not divisible by --tensor-model-parallel-size 4 "
                                         r"x --context-parallel-size 2.*use a multiple of 8"):  # fmt: skip
        validate_args(args, world_size=8)


# --- one block, its collectives counted -------------------------------------------------------
B, T, H, HEADS = 2, 8, 16, 4


class _Counting:
    """Wraps ``dist.all_reduce``, ``all_gather`` and ``reduce_scatter``: calls and ring bytes."""

    NAMES = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self) -> None:
        self.calls, self.ring_values, self.originals = Counter(), 0.0, {}

    def __enter__(self) -> _Counting:
        p = dist.get_world_size()
        for name in self.NAMES:
            original = self.originals[name] = getattr(dist, name)

            def wrapped(*args, _name=name, _original=original, **kw):
                self.calls[_name] += 1
                if _name == "all_reduce":
                    full = args[0].numel()  # all_reduce(tensor)
                else:  # all_gather(list, shard), reduce_scatter(shard, list): the list is the full tensor
                    full = sum(t.numel() for t in args[_name == "reduce_scatter"])
                hops = 2 if _name == "all_reduce" else 1  # ring: all-reduce = reduce-scatter + all-gather
                self.ring_values += hops * (p - 1) / p * full
                return _original(*args, **kw)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _block_run(
    state: ParallelState, sp: bool, x: torch.Tensor
) -> tuple[torch.Tensor, Block, Counter, Counter, float]:
    cfg = GPTConfig(2, H, HEADS, 128, T, sequence_parallel=sp)
    block = Block(cfg, state.tp_group)
    init_parameters(block, cfg, state)
    if sp:
        x = x.chunk(state.tp, dim=1)[state.tp_rank]  # (B, T/tp, H): this rank's positions
    x = x.detach().clone().requires_grad_()
    with _Counting() as fwd:
        y = block(x)
    with _Counting() as bwd:
        y.square().sum().backward()
    reduce_gradients(block.parameters(), None, state)  # SP: sums the LayerNorm and bias gradients
    return y, block, fwd.calls, bwd.calls, fwd.ring_values


def _block_worker(ctx) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, T, H)
    plain_state = ParallelState.build(Layout(2, tp=2))
    y, plain, fwd, bwd, plain_bytes = _block_run(plain_state, False, x)
    assert (fwd, bwd) == (Counter(all_reduce=2), Counter(all_reduce=2)), (fwd, bwd)
    sp_state = ParallelState.build(Layout(2, tp=2, sequence_parallel=True))
    y_sp, blk, fwd, bwd, sp_bytes = _block_run(sp_state, True, x)
    assert fwd == Counter(all_gather=2, reduce_scatter=2), fwd
    assert bwd == Counter(all_gather=4, reduce_scatter=2), bwd
    assert sp_bytes == plain_bytes  # the same bytes on the wire, in other collectives
    r = sp_state.tp_rank
    assert y_sp.shape == (B, T // 2, H)
    assert_close(y_sp, y.chunk(2, dim=1)[r])
    for (name, p_sp), p in zip(blk.named_parameters(), plain.parameters(), strict=True):
        assert_close(p_sp.grad, p.grad, msg=lambda m, name=name: f"{name}: {m}")
    _check_memory()


def _check_memory() -> None:
    """Bytes autograd keeps for one block, per rank, against the estimator (within 3%: the
    LayerNorm statistics and the attention's log-sum-exp are left out of it), split by the
    engine's layers and by DTensor's plan."""
    measured = {}
    for sp in (False, True):  # fp32: 4 sbh (16) / 2 with SP, 4 sbh (4 + 12 / 2) without: 20% apart
        state = ParallelState.build(Layout(2, tp=2, sequence_parallel=sp))
        for impl in ("megatron", "dtensor"):
            for precision, backend in (("fp32", "auto"), ("bf16", "unfused")):
                row = measure_block(state, s=64, b=4, h=32, a=4, precision=precision, attention_backend=backend,
                                    tensor_parallel_impl=impl)  # fmt: skip
                assert row["measured"] == pytest.approx(row["estimated"], rel=0.03), (impl, row)
                measured[impl, sp, precision] = row["measured"]
    # DTensor's SP keeps the gathered LayerNorm outputs (2 sbh, fp32: 4 sbh (18) / 2 against (16) / 2)
    sbh = 64 * 4 * 32
    gathered = measured["dtensor", True, "fp32"] - measured["megatron", True, "fp32"]
    assert gathered == pytest.approx(4 * sbh, rel=0.03), gathered
    assert measured["dtensor", False, "fp32"] == pytest.approx(measured["megatron", False, "fp32"], rel=0.03)


def test_one_block_collectives_gradients_and_memory() -> None:
    """Counted collectives, output and gradients against the block without SP, and the bytes the
    block keeps against the estimator: with SP the residual stream and the LayerNorm outputs are
    T / tp of the sequence, fp32 4 sbh (16) / t instead of 4 sbh (4 + 12 / t), which a 3%
    tolerance tells apart at t = 2."""
    run_gloo(_block_worker, 2)


def test_estimator_divides_every_term_by_tp() -> None:
    s, b, h, a = 2048, 1, 12288, 96  # Korthikanti's 175B row: 5 a s / h = 80
    assert korthikanti_layer_bytes(s, b, h, a, tp=8, sequence_parallel=True) == s * b * h / 8 * 114
    assert korthikanti_layer_bytes(s, b, h, a, tp=8) == s * b * h * (10 + 3 + 10)
    setup = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=256,
                 micro_batch_size=2, tp=4)  # fmt: skip
    sbh = 128 * 2 * 64
    for precision, fp32_residual, per_sbh in (
        ("fp32", False, 4 * 16),
        ("bf16", False, 32),
        ("bf16", True, 36),
    ):
        sp = MemorySetup(
            **setup, precision=precision, sequence_parallel=True, fp32_residual_connection=fp32_residual
        )
        assert block_bytes(sp) == sbh * per_sbh / 4
    tp_only = block_bytes(MemorySetup(**setup))
    assert tp_only == sbh * 4 * (4 + 12 / 4)  # residual and LayerNorm outputs whole on every rank
    with pytest.raises(ValueError, match="--sequence-parallel needs --tensor-model-parallel-size > 1, got 1"):
        MemorySetup(**{**setup, "tp": 1}, sequence_parallel=True)


def test_activation_memory_lines_parse() -> None:
    line = (
        "activations per layer: rank 1 tp 2 sequence-parallel True s 128 b 2 h 256 a 4: "
        "measured 1968128 B, estimated 1966080 B, Korthikanti 1769472 B"
    )
    assert parse(f"noise\n{line}\n") == [dict(rank=1, tp=2, s=128, b=2, h=256, a=4, measured=1968128,
                                               estimated=1966080, korthikanti=1769472, sp=True)]  # fmt: skip

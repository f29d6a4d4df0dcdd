"""Context parallelism: ring attention against full causal attention, the GPT against one process.

Unit level (cp = 2 and 4, both splits): every rank's output and dQ, dK, dV of its own tokens
equal those of ``F.scaled_dot_product_attention(is_causal=True)`` on the whole sequence, and
every p2p operation is posted in a batch of one send to the next rank and one receive from the
previous one. Whole run: a tiny GPT (sequence 16) trains 3 iterations in fp32 with cp = 2,
cp = 4, cp 2 x tp 2 and cp 2 x pp 2 (one spawn of 4 ranks); losses, gradient norms and the
validation loss equal the single-process run within 1e-6. RoPE under cp 2: every parameter's
gradient of a Llama whose attention is far from uniform (init std 0.2) equals one process's within
1e-5, and the same comparison fails when each cp rank rotates its tokens by local positions (or by
those of a contiguous split). On tp 2 x cp 2 (with and without
sequence parallelism) the bytes autograd keeps for the blocks match the memory estimate. Bad
layouts are refused before any process group exists; notebook 09's exercise check passes only a right run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.checks import ExerciseError
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.context_parallel.ring_attention import (
    Ring,
    describe,
    pair_work,
    ring_attention,
    ring_of,
    split_sequence,
)
from distlab.gpt.distributed.gradients import reduce_gradients
from distlab.gpt.layout import Layout
from distlab.gpt.memory.cp_measure import saved_bytes
from distlab.gpt.memory.memory_estimate import MemorySetup, activation_bytes, stage_layers_bytes
from distlab.gpt.memory.meters import PREDICTION
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.log import ITERATION
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_ranks import free_port, spawn_ranks
from distlab.local_runs import prepare_data
from distlab.logs.exercise import (
    check_long_sequence_run,
    long_sequence_budget,
    long_sequence_predictions,
    long_sequence_run,
)
from tests.conftest import assert_same_training, run_gloo, train_plan

pytestmark = pytest.mark.timeout(300)

RTOL = ATOL = 1e-6


def _ring_vs_full(rank: int, ring: Ring) -> None:
    """cp rank ``rank`` of ``ring``: its output and gradients against the whole sequence's."""
    cp = ring.size
    gen = torch.Generator().manual_seed(cp)
    q, k, v, dout = (torch.randn(2, 3, 8 * cp, 8, generator=gen) for _ in range(4))  # (b, n, T, d)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*ref, is_causal=True)
    out_ref.backward(dout)

    posted = []
    batch = dist.batch_isend_irecv

    def recording(ops):
        posted.append([(op.op.__name__, op.peer) for op in ops])
        return batch(ops)

    dist.batch_isend_irecv = recording
    mine = [split_sequence(t, ring, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, ring)
    out.backward(split_sequence(dout, ring, dim=2))
    dist.batch_isend_irecv = batch

    what = f"cp {cp} rank {rank} balanced={ring.balanced}"
    torch.testing.assert_close(out, split_sequence(out_ref, ring, dim=2), rtol=RTOL, atol=ATOL, msg=what)
    for name, local, full in zip("qkv", mine, ref, strict=True):
        torch.testing.assert_close(
            local.grad, split_sequence(full.grad, ring, dim=2), rtol=RTOL, atol=ATOL, msg=f"{what}: d{name}"
        )
    nxt, prev = ring.ranks[(rank + 1) % cp], ring.ranks[(rank - 1) % cp]
    # forward: cp-1 K/V hops; backward: cp-1 K/V hops and cp dK/dV hops; each one send + one receive
    assert len(posted) == 3 * cp - 2, posted
    assert all(ops == [("isend", nxt), ("irecv", prev)] for ops in posted), posted


def _ring_cases(ctx) -> None:
    """Two rings of 2 ([0, 1] and [2, 3], side by side) and one ring of 4, both splits."""
    pairs = [[0, 1], [2, 3]]
    groups = [dist.new_group(p) for p in pairs]
    pair = ctx.rank // 2
    for balanced in (True, False):
        _ring_vs_full(ctx.rank % 2, Ring(groups[pair], tuple(pairs[pair]), ctx.rank % 2, balanced))
        _ring_vs_full(ctx.rank, Ring(None, (0, 1, 2, 3), ctx.rank, balanced))


def test_ring_attention_equals_full_causal_attention() -> None:
    run_gloo(_ring_cases, 4)


def test_balanced_split_gives_every_rank_the_same_work() -> None:
    """Chunk pairs per rank and ring step: balanced, equal after step 0; contiguous, rank 0 idles."""
    balanced, contiguous = pair_work(4, True), pair_work(4, False)
    assert all(sum(row) == sum(balanced[0]) for row in balanced)
    assert [sum(row) for row in contiguous] == [2.0, 6.0, 10.0, 14.0]  # 1 + 3 + 5 + 7 = 16 + 16 total
    assert sum(map(sum, balanced)) == sum(map(sum, contiguous)) == 32.0  # (2cp)^2 / 2: half the scores
    assert contiguous[0][1:] == [0.0, 0.0, 0.0]  # rank 0 waits for the others after its first step
    for cp in (2, 3, 4, 8):  # contiguous: rank i does 4i + 2 pairs, the last (2cp - 1) times rank 0's
        per_rank = [sum(row) for row in pair_work(cp, False)]
        assert per_rank == [4.0 * i + 2 for i in range(cp)] and per_rank[-1] / per_rank[0] == 2 * cp - 1


# --- the whole GPT ---------------------------------------------------------------------------
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 "
    "--make-vocab-size-divisible-by 128 --seed 1234 --split 949,50,1 --log-interval 1 "
    "--eval-interval 3 --eval-iters 1 --distributed-backend gloo"
    " --attention-dropout 0 --hidden-dropout 0"
).split()
#: name: (world, tp, cp, pp); the reference runs on rank 0 alone.
RUNS = {
    "reference": (1, 1, 1, 1),
    "cp2": (2, 1, 2, 1),
    "cp4": (4, 1, 4, 1),
    "cp2-tp2": (4, 2, 2, 1),
    "cp2-pp2": (4, 1, 2, 2),  # stages exchange (b, T/cp, H)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gpt_cp")
    data = prepare_data(base / "data", vocab_size=512, max_files=40).argv()
    plan = []
    for name, (world, tp, cp, pp) in RUNS.items():
        argv = [*MODEL, *data, "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
                "--pipeline-model-parallel-size", str(pp)]  # fmt: skip
        plan.append((name, world, argv, free_port()))
    spawn_ranks(train_plan, (plan, str(base)), 4)
    return base


def _history(folder: Path, name: str, rank: int) -> dict:
    return json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize("name", ["cp2", "cp4", "cp2-tp2", "cp2-pp2"])
def test_context_parallel_gpt_matches_single_process(runs: Path, name: str) -> None:
    world, tp, cp, pp = RUNS[name]
    ref, last = _history(runs, "reference", 0), _history(runs, name, world - 1)
    assert len(ref["losses"]) == 3 and ref["losses"][-1] < ref["losses"][0]  # it learns: not vacuous
    assert_same_training(last, ref, name, tol=RTOL)
    first = (runs / f"{name}.rank0.log").read_text()
    assert f"> context parallelism: {cp} ranks, sequence 16 in {2 * cp} chunks" in first


# --- RoPE at global positions -------------------------------------------------------------------
#: A Llama (RoPE, RMSNorm, SwiGLU, 2 K/V groups, untied, no biases) whose attention is far from
#: uniform: at std 0.2 the scores q.k spread over several units, so where RoPE puts each token
#: changes every gradient (at Megatron's 0.0134 the losses of wrong positions still agree to 1e-6)
ROPE_LLAMA = GPTConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16,
    position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
    num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True,
    init_method_std=0.2,
)  # fmt: skip


def _gradients(state: ParallelState, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the mean loss over (b, T) tokens: with cp, this rank's T / cp
    (its two chunks), then averaged over the cp ranks (``reduce_gradients``)."""
    model = GPTModel(ROPE_LLAMA, state)
    ring = ring_of(state)
    if ring is not None:
        tokens, labels = split_sequence(tokens, ring), split_sequence(labels, ring)
    model(tokens, labels).mean().backward()
    if state.cp > 1:
        reduce_gradients(list(model.parameters()), None, state)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _worst(grads: dict, ref: dict) -> float:
    """The largest error of any parameter's gradient, relative to that gradient's largest element."""
    return max(((grads[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)


def _rope_cp_rank(ctx) -> None:
    state = ParallelState.build(Layout(2, cp=2))
    data = torch.randint(0, ROPE_LLAMA.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens, labels = data[:, :-1], data[:, 1:]  # (b, T) = (2, 16): chunks [0, 3] on rank 0, [1, 2] on rank 1
    ref = _gradients(ParallelState(Layout(1), rank=0), tokens, labels)
    assert _worst(_gradients(state, tokens, labels), ref) < 1e-5  # seen: 1.1e-6
    right = GPTModel.positions
    wrong = {
        "local positions 0 .. T/cp - 1": lambda self, length, device, first=0: torch.arange(length, device=device),
        "a contiguous split's": lambda self, length, device, first=0: (
            torch.arange(length, device=device) + length * self.ring.index
        ),
    }  # fmt: skip
    try:
        for why, positions in wrong.items():
            GPTModel.positions = positions  # every cp rank rotates its tokens as if they sat there
            error = _worst(_gradients(state, tokens, labels), ref)  # seen: 1.9 and 3.1
            assert error > 0.1, f"RoPE with {why} gives one process's gradients (error {error:.1e})"
    finally:
        GPTModel.positions = right


def test_rope_under_cp_gives_every_gradient_of_one_process_and_fails_at_wrong_positions() -> None:
    run_gloo(_rope_cp_rank, 2)


# --- refusals ---------------------------------------------------------------------------------
def test_sequence_not_divisible_by_twice_cp_is_refused(tmp_path) -> None:
    argv = [*MODEL, "--seq-length", "12", "--max-position-embeddings", "16", "--context-parallel-size", "4"]
    with pytest.raises(
        ValueError, match=r"--seq-length 12 is not divisible by 2 x --context-parallel-size 4 = 8"
    ):
        validate_args(parse_args(argv), world_size=4)


def test_layout_that_does_not_fill_the_world_names_cp() -> None:
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by .*context-parallel size 4.* = 4"):
        Layout(6, cp=4)


def test_context_parallel_with_sharded_back_ends_is_refused() -> None:
    argv = [*MODEL, "--context-parallel-size", "2", "--use-torch-fsdp2", "--attention-dropout", "0.1"]
    with pytest.raises(ValueError) as err:
        validate_args(parse_args(argv), world_size=2)
    assert "--context-parallel-size 2 with --use-torch-fsdp2" in str(err.value)
    assert "--context-parallel-size 2 with --attention-dropout 0.1" in str(err.value)


def _sp_cp_memory_worker(ctx) -> None:
    """tp 2 x cp 2 (4 ranks): the bytes autograd keeps for the blocks of one rank's (b, s / (cp tp), H)
    against the estimator, with and without SP (within 3%: the LayerNorm statistics and ring
    attention's log-sum-exp are left out of it; fp32, the two estimates are 20% apart)."""
    b, s, shape = 2, 64, dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128)
    predicted = {}
    for sp in (True, False):
        layout = Layout(4, tp=2, cp=2, sequence_parallel=sp, micro_batch_size=b, global_batch_size=b)
        model = GPTModel(GPTConfig(**shape, max_position_embeddings=s, sequence_parallel=sp),
                         ParallelState.build(layout))  # fmt: skip
        x = torch.randn(b, s // (2 * (2 if sp else 1)), 32, requires_grad=True)  # (b, s/cp[/tp], H)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        measured = saved_bytes(_blocks, model, x, exclude=params)
        predicted[sp] = stage_layers_bytes(MemorySetup.from_layout(layout, **shape, seq_length=s))
        assert measured == pytest.approx(predicted[sp], rel=0.03), (sp, measured, predicted[sp])
    assert predicted[True] < 0.85 * predicted[False]  # fp32: 4 sbh (16) / t against 4 sbh (4 + 12 / t), t = 2


def _blocks(model: GPTModel, x: torch.Tensor) -> torch.Tensor:
    for block in model.layers.values():
        x = block(x)  # ring attention over cp, SP's gathers and scatters over tp
    return x


def test_sequence_parallel_with_cp_memory_matches_the_estimate() -> None:
    run_gloo(_sp_cp_memory_worker, 4)


def test_predicted_activation_memory_falls_as_one_over_cp() -> None:
    shape = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=4096, vocab_size=512,
                 micro_batch_size=1)  # fmt: skip
    one, two, four = (activation_bytes(MemorySetup(**shape, cp=cp)) for cp in (1, 2, 4))
    assert two == pytest.approx(one / 2) and four == pytest.approx(one / 4)


# --- notebook 09's exercise check ---------------------------------------------------------------
#: notebook 09's models, without dropout as its runs (ring attention has none)
LOCAL_MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --attention-dropout 0 --hidden-dropout 0"
)
GPU_MODEL = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --attention-dropout 0 --hidden-dropout 0"
)


def _long_run_log(
    tp: int, cp: int, predicted: float, last_it: int = 2, seq: int = 2048, world: int = 4
) -> str:
    gbs, ms = world // (tp * cp), 937.3
    lines = [ParallelState(Layout(world, tp=tp, cp=cp), rank=0).banner()]
    if cp > 1:
        lines.append(describe(seq, Ring(None, tuple(range(cp)), 0)))
    lines.append(PREDICTION.format(predicted=predicted, measured=predicted + 3, how="peak RSS", error=8.0))
    for it in range(1, last_it + 1):
        lines.append(ITERATION.format(it=it, total=2, samples=it * gbs, ms=ms, lr=1e-3, gbs=gbs, loss=8.0,
                                      scale=1.0, gnorm=1.0, skipped=0, nan=0, tokens_per_s=gbs * seq / (ms / 1000),
                                      tflops=0.01))  # fmt: skip
    return "\n".join(lines) + "\n"


def test_exercise_check_passes_only_a_finished_run_within_the_budget(capsys) -> None:
    kw = dict(world_size=4, seq_length=2048, budget_mib=39, max_tp=2)
    assert check_long_sequence_run(None, **kw) is False
    assert "[not yet]" in capsys.readouterr().out
    assert check_long_sequence_run(_long_run_log(1, 4, 36.0), **kw)
    assert check_long_sequence_run(_long_run_log(2, 2, 36.9), **kw)
    assert long_sequence_run(_long_run_log(2, 1, 71.4))["seq_length"] == 2048  # cp = 1: from tokens/s
    wrong = {
        "over the budget (cp 2 x dp 2)": _long_run_log(1, 2, 66.8),
        "tp 4 crosses the node": _long_run_log(4, 1, 37.0),
        "did not finish": _long_run_log(1, 4, 36.0, last_it=1),
        "another sequence": _long_run_log(1, 4, 9.0, seq=512),
        "cp = 1 with a shortened sequence (no context-parallel line)": _long_run_log(2, 1, 30.0, seq=1024),
        "cp = 1, tp 2, sequence 2040": _long_run_log(2, 1, 37.0, seq=2040),
        "no iteration line to read the sequence from": _long_run_log(1, 4, 36.0, last_it=0),
    }
    for why, log in wrong.items():
        with pytest.raises(ExerciseError):
            check_long_sequence_run(log, **kw)
            pytest.fail(why)


def test_exercise_budget_is_the_runs_own_prediction_and_needs_cp() -> None:
    """The budget comes from the estimate the run prints: 39 MiB for the local model (95% of tp 4's
    40.7, the smallest peak without CP); on a GPU site's larger model (s = 32768, 2 nodes of 2, 4
    or 8 GPUs) it also leaves some layout with CP and tp inside a node, and none without CP."""
    local = long_sequence_predictions(LOCAL_MODEL, world_size=4, seq_length=2048)
    assert {k: round(v, 1) for k, v in local.items() if k in ((1, 4), (2, 2), (4, 1), (2, 1))} == {
        (1, 4): 36.0, (2, 2): 36.9, (4, 1): 40.7, (2, 1): 71.4}  # fmt: skip
    assert long_sequence_budget(local) == 39
    for per_node in (2, 4, 8):
        world = 2 * per_node
        predicted = long_sequence_predictions(GPU_MODEL, world_size=world, seq_length=32768)
        budget = long_sequence_budget(predicted)
        fits = sorted(k for k, mib in predicted.items() if mib <= budget and k[0] <= per_node)
        assert fits and all(cp > 1 for _, cp in fits), (world, budget, fits)
        tp, cp = fits[0]
        log = _long_run_log(tp, cp, predicted[tp, cp], seq=32768, world=world)
        assert check_long_sequence_run(
            log, world_size=world, seq_length=32768, budget_mib=budget, max_tp=per_node
        )


@pytest.mark.parametrize("notebook", ["notebooks/09_context_and_expert_parallelism.ipynb",
                                      "solutions/09_context_and_expert_parallelism_solution.ipynb"])  # fmt: skip
def test_notebook_cells_of_the_exercise_budget_and_check(notebook: str, monkeypatch, capsys) -> None:
    """The notebook's own cells, as they run on the local cluster: the budget cell gives 39 MiB, the
    check cell says what to do before the run, passes the solution's run and fails a cp = 1 run
    with a shortened sequence."""
    import contextlib
    import io
    import os

    import distlab.logs.exercise as exercise

    cells = [
        "".join(c["source"]) for c in json.loads((Path(__file__).parents[1] / notebook).read_text())["cells"]
    ]
    budget = next(c for c in cells if "BUDGET_MIB = long_sequence_budget(" in c)
    check_cell = next(c for c in cells if c.startswith("check_long_sequence_run("))
    monkeypatch.setenv("GPT_ARGS", f"{LOCAL_MODEL} --train-iters 3 --lr 1e-3")
    names = {k: getattr(exercise, k) for k in exercise.__dict__ if "long_sequence" in k}
    base = {"os": os, "WORLD": 4, "PROCS": 2, "LONG_SEQ": 2048, **names}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(budget, base)
    assert base["BUDGET_MIB"] == 39

    def run(log: str | None) -> str:
        job = None if log is None else type("Job", (), {"log": lambda self: log})()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(check_cell, {**base, "long_job": job})
        return out.getvalue()

    assert "[not yet]" in run(None)
    assert "[ok]" in run(_long_run_log(1, 4, 36.0))
    with pytest.raises(ExerciseError):
        run(_long_run_log(2, 1, 30.0, seq=1024))

"""The step-time model's formulas against values computed by hand (planning/step_model.py)."""

from __future__ import annotations

import dataclasses

import pytest

from distlab.gpt.arguments import parse_args
from distlab.gpt.layout import Layout
from distlab.gpt.planning.hardware import Hardware, Link, load
from distlab.gpt.planning.step_model import bubble_fraction, collective_seconds, group_link, predict_step
from distlab.gpt.planning.utilization import hardware_flops, model_flops

LINK = Link(bandwidth=100e9, latency=1e-5)
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --lr 1e-3"
)
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def _hw(gpus_per_node: int = 8) -> Hardware:
    slow = Link(bandwidth=10e9, latency=1e-4)
    return Hardware("test", gpus_per_node, 1e12, 1.0, 2**34, LINK, slow, flash_attention=False)


def test_each_collective_costs_alpha_plus_its_ring_factor_times_bytes_over_bandwidth() -> None:
    assert collective_seconds("all_reduce", 4, 1e9, LINK) == pytest.approx(1e-5 + 1.5 * 1e9 / 100e9)
    assert collective_seconds("all_gather", 4, 1e9, LINK) == pytest.approx(1e-5 + 0.75 * 0.01)
    assert collective_seconds("reduce_scatter", 8, 1e9, LINK) == pytest.approx(1e-5 + 7 / 8 * 0.01)
    assert collective_seconds("all_to_all", 2, 1e9, LINK) == pytest.approx(1e-5 + 0.5 * 0.01)
    assert collective_seconds("send", 2, 1e9, LINK) == pytest.approx(1e-5 + 0.01)
    assert collective_seconds("all_reduce", 1, 1e9, LINK) == 0.0


def test_the_bubble_is_a_share_of_the_whole_pipelined_time() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 8) == 0.0


def test_a_group_spanning_two_nodes_uses_the_inter_node_link() -> None:
    hw = _hw(gpus_per_node=8)
    layout = Layout(16, tp=8, pp=2)  # tp groups [0..7] [8..15]; pp groups [0, 8] ...
    assert group_link(layout.groups("tp"), hw) is hw.intra_node
    assert group_link(layout.groups("pp"), hw) is hw.inter_node
    assert group_link(Layout(16, tp=4).groups("dp"), hw) is hw.inter_node  # dp [0, 4, 8, 12]


def test_tensor_parallel_step_by_hand() -> None:
    """tp 2, one micro-batch of 1 x 32 tokens: compute F / 2 / 1e12 plus 4 all-reduces per layer
    of S = b s H x 4 bytes, each 1e-5 + 2 (1/2) S / 100e9; per micro-batch the embedding's and the
    output layer's all-reduce of S and the cross entropy's of 32 and 2 x 32 fp32 values."""
    args = parse_args(f"{TINY} --global-batch-size 1 --vocab-size 128".split())
    layout = Layout(2, tp=2, global_batch_size=1)
    F = 24 * 32 * 64**2 * (1 + 32 / (6 * 64)) * (3 * 2) + 6 * 32 * 64 * 128
    S = 32 * 64 * 4
    head = 2 * (1e-5 + S / 100e9) + (1e-5 + 32 * 4 / 100e9) + (1e-5 + 64 * 4 / 100e9)
    expected = F / 2 / 1e12 + 2 * 4 * (1e-5 + S / 100e9) + head
    p = predict_step(args, layout, _hw(), 128, parameters_per_rank=1000)
    assert p.step == pytest.approx(expected)
    assert p.compute == pytest.approx(F / 2 / 1e12)
    F_model = 24 * 32 * 64**2 * (1 + 32 / (12 * 64)) * (3 * 2) + 6 * 32 * 64 * 128  # causal attention at half
    assert p.mfu == p.hfu == pytest.approx(F_model / (2 * 1e12 * expected))  # no recomputation: equal


def test_mfu_counts_gpt3_175b_as_the_paper_and_megatron_do_by_hand() -> None:
    """GPT-3 175B (l 96, h 12288, s 2048, V 51200), per token: a block's forward 24 h^2 + 2 s h
    (causal attention at half) = 3,674,210,304; x 3 x 96 = 1,058,172,567,552; the output layer
    6 h V = 3,774,873,600; = 72 l h^2 (1 + s/(12h) + V/(12lh)) (Narayanan et al. 2021 with
    Megatron-LM's causal half). Full recomputation adds the forward once more: + 96 x 3,674,210,304."""
    gpt3 = "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --lr 1e-4"
    args = parse_args(f"{gpt3} --micro-batch-size 1 --global-batch-size 1".split())
    assert model_flops(args, 51200) / 2048 == 1_061_947_441_152
    L, h, s, V = 96, 12288, 2048, 51200
    assert model_flops(args, V) / s == pytest.approx(72 * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h)))
    full = parse_args(f"{gpt3} --micro-batch-size 1 --global-batch-size 1 {RECOMPUTE}".split())
    assert hardware_flops(full, 51200) / 2048 == 1_061_947_441_152 + 96 * 3_674_210_304
    assert hardware_flops(args, 51200) == model_flops(args, 51200)


def test_full_recomputation_raises_hfu_above_mfu_by_the_recomputed_forward() -> None:
    """HFU / MFU - 1 = B s l f / (B s (3 l f + 6 h V)): the rerun forward's share of the model FLOPs."""
    base = f"{TINY} --global-batch-size 1 --vocab-size 128"
    plain, full = parse_args(base.split()), parse_args(f"{base} {RECOMPUTE}".split())
    layout = Layout(1, global_batch_size=1)
    p = predict_step(full, layout, _hw(), 128, parameters_per_rank=1000)
    f = 24 * 64**2 + 2 * 32 * 64  # one block's forward a token, attention at half
    share = 2 * f / (3 * 2 * f + 6 * 64 * 128)
    assert p.hfu / p.mfu - 1 == pytest.approx(share)
    q = predict_step(plain, layout, _hw(), 128, parameters_per_rank=1000)
    assert q.hfu == q.mfu


def test_pipeline_and_data_parallel_step_by_hand() -> None:
    """pp 2 x dp 2 over nodes of 2: m = 4 micro-batches; per micro-batch a stage computes its
    blocks (compute minus the output layer's share, / 4) and 2 sends of b s H x 4 bytes over the
    inter-node link (pp ranks 0 and 2 lie on two nodes); the last stage also the output layer
    (6 B s h V over its 2 ranks, / 4). 1F1B: 4 t_last + t_first. dp (ranks 0, 1: one node)
    all-reduces n x 4 bytes once, exposed without overlap."""
    args = parse_args(f"{TINY} --global-batch-size 8 --vocab-size 128".split())
    layout = Layout(4, pp=2, global_batch_size=8)
    n = 50_000
    head = 6 * 8 * 32 * 64 * 128
    F = 24 * 8 * 32 * 64**2 * (1 + 32 / (6 * 64)) * (3 * 2) + head
    compute = F / 4 / 1e12
    t_first = (compute - head / 4 / 1e12) / 4 + 2 * (1e-4 + 32 * 64 * 4 / 10e9)
    t_last = t_first + head / 2 / 1e12 / 4
    dp = 1e-5 + 2 * (1 / 2) * n * 4 / 100e9
    p = predict_step(args, layout, _hw(gpus_per_node=2), 128, parameters_per_rank=n)
    assert p.step == pytest.approx(4 * t_last + t_first + dp)
    assert p.bubble == pytest.approx(t_first)
    assert p.exposed["dp"] == pytest.approx(dp)
    assert p.last_stage == pytest.approx(head / 2 / 1e12 / 2)  # its output layer above the stages' mean
    parts = p.compute + p.last_stage + p.bubble + sum(p.exposed.values()) + p.unfused + p.optimizer
    assert p.step == pytest.approx(parts)
    overlapped = parse_args(f"{TINY} --global-batch-size 8 --vocab-size 128 --overlap-grad-reduce".split())
    assert predict_step(overlapped, layout, _hw(2), 128, n).exposed["dp"] == 0.0  # under 2/3 t_mb


def test_a_measured_sweep_prices_its_group_size_and_alpha_beta_the_others() -> None:
    """Between two measured sizes the time is interpolated, below them the smallest's, above them
    the last segment extended; another operation or group size falls back to alpha-beta."""
    link = dataclasses.replace(LINK, measured_ranks=2, measured={"all_reduce": ((1024, 1e-3), (4096, 3e-3))})
    assert collective_seconds("all_reduce", 2, 2048, link) == pytest.approx(1e-3 + 2e-3 / 3)
    assert collective_seconds("all_reduce", 2, 16, link) == pytest.approx(1e-3)
    assert collective_seconds("all_reduce", 2, 7168, link) == pytest.approx(5e-3)
    assert collective_seconds("all_reduce", 4, 2048, link) == collective_seconds("all_reduce", 4, 2048, LINK)
    assert collective_seconds("send", 2, 2048, link) == collective_seconds("send", 2, 2048, LINK)
    hw = dataclasses.replace(_hw(), intra_node=link, memory=Link(30e9, 1e-6))
    back = Hardware.from_dict(hw.to_dict())
    assert back.intra_node.measured == link.measured and back.memory == hw.memory


def test_the_distributed_optimizer_reduce_scatters_and_gathers_instead_of_all_reducing() -> None:
    args = parse_args(f"{TINY} --global-batch-size 4 --vocab-size 128 --bf16".split())
    layout = Layout(4, global_batch_size=4)
    n = 1_000_000
    plain = predict_step(args, layout, _hw(), 128, n)
    sharded = predict_step(args, layout, _hw(), 128, n, distributed_optimizer=True)
    assert [(c.op, c.nbytes) for c in plain.costs] == [("all_reduce", 4 * n)]
    assert [(c.op, c.nbytes) for c in sharded.costs] == [("reduce_scatter", 4 * n), ("all_gather", 2 * n)]
    # 2 (3/4) 4n against (3/4) (4n + 2n), plus one alpha more
    assert sharded.exposed["dp"] - plain.exposed["dp"] == pytest.approx(1e-5 + 0.75 * (6 * n - 8 * n) / 100e9)


def test_the_hardware_files_read_back() -> None:
    h100 = load("h100_sxm_node")
    assert h100.gpus_per_node == 8 and h100.peak_flops == 989e12
    assert h100.intra_node.bandwidth == 450e9 and h100.inter_node.bandwidth == 50e9
    assert Hardware.from_dict(h100.to_dict()) == h100
    with pytest.raises(FileNotFoundError, match="a100_node"):
        load("no_such_machine")


RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


NO_DROPOUT = "--attention-dropout 0 --hidden-dropout 0"


@pytest.mark.parametrize(
    "flags",
    ["", "--sequence-parallel", RECOMPUTE, f"--sequence-parallel {RECOMPUTE}", f"{NO_DROPOUT} {RECOMPUTE}",
     f"{NO_DROPOUT} --sequence-parallel {RECOMPUTE}"],
)  # fmt: skip
def test_the_tensor_parallel_counts_per_layer_are_what_a_dry_run_records(flags: str) -> None:
    """Dry runs (rank 0 of tp 2) of 4 and 8 layers: the collectives of size S = b s H x 4 bytes
    that 4 more layers add, per layer and micro-batch, are the model's counts (full recomputation
    reruns the block's last collective only under the hidden dropout, Megatron's default 0.1)."""
    from distlab.gpt.arguments import validate_args
    from distlab.gpt.planning.collectives import summarize
    from distlab.gpt.planning.dry_run import dry_run

    def run(layers: int):
        argv = (
            f"--num-layers {layers} --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--global-batch-size 4 --lr 1e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
            f"--vocab-size 200 --tensor-model-parallel-size 2 {flags}"
        ).split()
        args = parse_args(argv)
        layout = validate_args(args, 2)
        S = 2 * 32 * 64 * 4
        found = {
            c.op: n
            for c, n in summarize(dry_run(args, layout, 0).collectives)
            if c.group == "tp" and c.nbytes == S
        }
        costs = predict_step(args, layout, _hw(), 256, 1000).costs
        model = {c.op: c.count for c in costs if c.dim == "tp" and c.what == "layers"}
        return found, model, layout.num_micro_batches

    (four, model, m), (eight, _, _) = run(4), run(8)
    assert {op: (eight[op] - four[op]) / (4 * m) for op in eight} == {op: k / 4 for op, k in model.items()}


def test_the_gradient_bytes_reduced_over_dp_are_what_a_dry_run_records() -> None:
    from distlab.gpt.arguments import validate_args
    from distlab.gpt.planning.dry_run import dry_run

    argv = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 200 --pipeline-model-parallel-size 2 --ddp-bucket-size 50000"
    ).split()
    args = parse_args(argv)
    layout = validate_args(args, 4)  # pp 2 x dp 2
    dry = dry_run(args, layout, 0)
    recorded = sum(
        c.nbytes for c in dry.collectives if c.group == "dp" and c.op == "all_reduce" and c.nbytes > 4
    )
    model = [c for c in predict_step(args, layout, _hw(), 256, dry.parameters).costs if c.dim == "dp"]
    assert recorded == sum(c.nbytes * c.count for c in model) == 4 * dry.parameters
    calls = [c for c in dry.collectives if c.group == "dp" and c.op == "all_reduce" and c.nbytes > 4]
    assert model[0].count == len(calls)  # --ddp-bucket-size 50000: as many buckets


def test_context_parallel_rounds_by_hand() -> None:
    """cp 2, 2 layers, one micro-batch of 1 x 32 tokens, 4 heads of 16 channels in 2 groups: the
    engine repeats K/V to the 4 heads, so a round moves 2 x 1 x 16 x 4 x 16 fp32 values = 8192 bytes;
    per layer 1 K/V round forward, 1 K/V and 2 gradient rounds backward. A fused ring (flash) sends
    the 2 groups' K/V, 4096 bytes."""
    flags = f"{TINY} --global-batch-size 1 --vocab-size 128 --group-query-attention --num-query-groups 2"
    layout = Layout(2, cp=2, global_batch_size=1)
    p = predict_step(parse_args(flags.split()), layout, _hw(), 128, 1000)
    rounds = [(c.op, c.nbytes, c.count) for c in p.costs if c.dim == "cp"]
    assert rounds == [("send", 8192, 2 * 2), ("send", 8192, 2 * 2)]
    # gradient rounds waited at once: 4 x (1e-5 + 8192 / 100e9); K/V rounds hidden under a ring step
    assert p.exposed["cp"] >= 4 * (1e-5 + 8192 / 100e9)
    fused = dataclasses.replace(_hw(), flash_attention=True)
    p = predict_step(parse_args(flags.split()), layout, fused, 128, 1000)
    assert [c.nbytes for c in p.costs if c.dim == "cp"] == [4096, 4096]


def test_the_ring_rounds_are_what_a_dry_run_records() -> None:
    """A dry run of cp 2 (rank 0, 4 layers, grouped K/V) records one send per ring round: the model's
    rounds, bytes and counts, over the micro-batches."""
    from distlab.gpt.arguments import validate_args
    from distlab.gpt.planning.collectives import summarize
    from distlab.gpt.planning.dry_run import dry_run

    argv = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 4 --lr 1e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 200 --context-parallel-size 2 --group-query-attention --num-query-groups 2 --attention-dropout 0"
    ).split()
    args = parse_args(argv)
    layout = validate_args(args, 2)
    sends = {c.nbytes: n for c, n in summarize(dry_run(args, layout, 0).collectives) if c.op == "send"}
    model: dict[float, int] = {}
    for c in predict_step(args, layout, _hw(), 256, 1000).costs:
        if c.dim == "cp":
            model[c.nbytes] = model.get(c.nbytes, 0) + c.count * layout.num_micro_batches
    assert sends == model


def test_the_tensor_parallel_step_is_what_a_dry_run_records() -> None:
    """Every tp collective of a dry run's step (tp 2 + SP, 2 micro-batches) is in the model with
    its bytes and count, blocks and head together, except the two the model leaves out: the
    gradient norm's scalar and the sequence-parallel parameters' gradient all-reduce."""
    from distlab.gpt.arguments import validate_args
    from distlab.gpt.planning.collectives import summarize
    from distlab.gpt.planning.dry_run import dry_run

    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 4 --lr 1e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 200 --tensor-model-parallel-size 2 --sequence-parallel"
    ).split()
    args = parse_args(argv)
    layout = validate_args(args, 2)
    recorded = {
        (c.op, c.nbytes): n for c, n in summarize(dry_run(args, layout, 0).collectives) if c.group == "tp"
    }
    model: dict = {}
    for c in predict_step(args, layout, _hw(), 256, 1000).costs:
        if c.dim == "tp":
            model[(c.op, c.nbytes)] = model.get((c.op, c.nbytes), 0) + c.count * layout.num_micro_batches
    left_out = {key: n for key, n in recorded.items() if key not in model}
    assert {key: recorded[key] for key in model} == model
    # sequence-parallel parameters, fp32: positions 32 x 64, per layer two LayerNorms (2 x 2 x 64)
    # and the two row-parallel biases (2 x 64), the final LayerNorm (2 x 64)
    sp_params = 32 * 64 + 2 * 6 * 64 + 2 * 64
    assert left_out == {("all_reduce", 4): 1, ("all_reduce", 4 * sp_params): 1}


def test_the_local_sweep_times_every_collective_the_model_prices() -> None:
    """Two spawned gloo ranks: each operation of the step model at every size of the sweep,
    ascending, each a positive time; the model then prices a 2-rank collective from the sweep."""
    from distlab.gpt.planning.local_cluster import SIZES, measure_link

    link = measure_link(2)
    assert set(link.measured) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"}
    for points in link.measured.values():
        assert [b for b, _ in points] == SIZES and all(t > 0 for _, t in points)
    (b0, t0), (b1, t1) = link.measured["all_reduce"][-2:]
    middle = collective_seconds("all_reduce", 2, (b0 + b1) / 2, link)
    assert middle == pytest.approx(max((t0 + t1) / 2, link.measured["all_reduce"][0][1]))

"""Profiler traces of real runs read through torch-tb-profiler: the plugin's own loader finds the run
and its Overview step breakdown; gloo all-reduces count as communication; the memory curve rises in
forward and falls in backward; a missing trace names the run that should have written it."""

from __future__ import annotations

import pytest
import torch

from distlab.gpt.training.log import ProfilerConfig, StepProfiler
from distlab.local_runs import prepare_data, spawn_pretrain
from distlab.profiling.plots import plot_breakdown, plot_memory, plot_top_operators
from distlab.profiling.traces import GROUPS, find_traces, load_run
from tests.test_gpt_training import TINY

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def dp2_trace(tmp_path_factory):
    """tensorboard dir of a DP=2 run (gloo) profiled with --profile-execution True: rank 0, iterations
    2 and 3 (warm-up on 1)."""
    tmp = tmp_path_factory.mktemp("prof")
    data = prepare_data(tmp / "data", vocab_size=512, max_files=80).argv()
    tb = tmp / "tb"
    argv = [*TINY, *data, "--global-batch-size", "4", "--train-iters", "4", "--tensorboard-dir", str(tb)]
    prof = [
        "--profile-execution",
        "True",
        "--profile-step-start",
        "1",
        "--profile-step-end",
        "3",
        "--profile-ranks",
        "0",
    ]
    spawn_pretrain([*argv, *prof, "--profile-name", "dp2"], 2, tmp / "run")
    return tb


@pytest.fixture(scope="module")
def memory_trace(tmp_path_factory):
    """A run folder with the engine's profiler trace (StepProfiler: memory, shapes, stacks) of an
    MLP's iterations 2 and 3, after the warm-up on iteration 1."""
    tb = tmp_path_factory.mktemp("mem")
    config = ProfilerConfig(profile_execution=True, profile_name="mlp", tensorboard_dir=str(tb), profile_step_start=1,
                            profile_step_end=3)  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = StepProfiler(config, rank=0)
    for _ in range(3):  # the warm-up, then the traced iterations 2 and 3
        model(torch.randn(128, 256)).square().mean().backward()  # activations: 2 x (128, 2048) fp32
        opt.step()
        opt.zero_grad()
        profiler.step()
    profiler.stop()
    return tb / "mlp"


def test_the_plugins_loader_finds_the_run_and_its_step_breakdown(dp2_trace):
    from torch_tb_profiler.io import Cache
    from torch_tb_profiler.profiler.loader import RunLoader

    with Cache() as cache:
        run = RunLoader("dp2", str(dp2_trace / "dp2"), cache).load()
    assert run.name == "dp2" and run.get_workers("Overview") == ["rank0"]
    assert run.get_workers("Distributed") == ["All"]  # the view that compares ranks
    (profile,) = run.get_profiles(worker="rank0")  # one span: the trace file of rank 0
    assert [v.display_name for v in profile.views][:2] == ["Overview", "Operator"]
    overview = profile.overview
    assert [c["name"] for c in overview["steps"]["columns"][1::2]] == [
        "Communication",
        "DataLoader",
        "CPU Exec",
        "Other",
    ]
    assert [row[0] for row in overview["steps"]["rows"]] == ["2", "3"]  # iterations 2, 3 (defaults 1, 3)


def test_profile_ranks_choose_which_ranks_write_a_trace(tmp_path):
    """--profile-ranks 1: only rank 1 traces, as worker ``rank1`` (a pipelined run names one rank
    per stage); none named: every rank, Megatron's default."""
    data = prepare_data(tmp_path / "data", vocab_size=512, max_files=80).argv()
    run = ["--global-batch-size", "4", "--train-iters", "2", "--tensorboard-dir", str(tmp_path)]
    prof = ["--profile-execution", "True", "--profile-step-start", "1", "--profile-step-end", "2"]
    spawn_pretrain(
        [*TINY, *data, *run, *prof, "--profile-name", "r1", "--profile-ranks", "1"], 2, tmp_path / "r1run"
    )
    assert list(find_traces(tmp_path / "r1")) == ["rank1"]
    spawn_pretrain([*TINY, *data, *run, *prof, "--profile-name", "all"], 2, tmp_path / "allrun")
    assert sorted(find_traces(tmp_path / "all")) == ["rank0", "rank1"]


def test_breakdown_counts_gloo_as_communication(dp2_trace):
    traces = load_run(dp2_trace / "dp2")
    assert list(traces) == ["rank0"]
    t = traces["rank0"]
    b = t.breakdown_us()
    parts = sum(v for k, v in b.items() if k != "Average Step Time")
    assert parts == pytest.approx(b["Average Step Time"], abs=len(b))  # the plugin rounds to 1 us
    groups = t.groups_ms()
    assert list(groups) == list(GROUPS) and groups["communication"] > 0 and groups["computation"] > 0
    assert sum(groups.values()) == pytest.approx(t.step_ms(), abs=0.01)
    names = [r["name"] for r in t.top_operators(n=10_000)]
    assert "c10d::allreduce_" in names and "aten::mm" in names
    assert plot_breakdown({"DP=2": traces}).get_xlabel() == "average step time (ms)"
    assert len(plot_top_operators(t, n=5).patches) == 5


def test_memory_rises_in_forward_and_falls_in_backward(memory_trace):
    t = load_run(memory_trace)["rank0"]
    times, mib = t.memory_curve()
    steps = t.steps_ms()
    assert [s["step"] for s in steps] == ["ProfilerStep#2", "ProfilerStep#3"]  # iterations 2 and 3
    for s in steps:
        assert s["start"] < s["backward"] < s["end"]
        inside = [(x, m) for x, m in zip(times, mib, strict=True) if s["start"] <= x <= s["end"]]
        at_peak = max(inside, key=lambda p: p[1])
        activations = 2 * 128 * 2048 * 4 / 2**20  # MiB of the two (128, 2048) activations
        assert at_peak[1] - inside[0][1] >= activations  # held until backward begins
        assert inside[-1][1] < at_peak[1] - activations  # released by the end of backward
    assert plot_memory(t).get_ylabel() == "allocated (MB)"


def test_missing_trace_names_the_run(tmp_path):
    (tmp_path / "dp4-accum").mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"run 'dp4-accum' should have written it .*--profile-name dp4-accum"
    ):
        find_traces(tmp_path / "dp4-accum")


def test_exercise_check_reads_both_traces(dp2_trace, memory_trace, capsys):
    """Decided on what the variant removes (communication, to exactly 0), not on the size of a move
    (identical DP=4 runs differ by 23 points here): both true readings pass, every other answer and
    a variant that still communicates fail, whatever the load."""
    from distlab.checks import FIXME, ExerciseError
    from distlab.profiling.exercise import check_changed_part, share_table

    baseline = dp2_trace / "dp2"
    assert check_changed_part(baseline, None, FIXME, FIXME) is False  # untouched: a note, no failure
    assert "[not yet]" in capsys.readouterr().out
    table = share_table(baseline, memory_trace)
    assert table["communication"][0] > 0 and table["communication"][1] == 0  # the MLP does not communicate
    assert table["computation"][1] > table["computation"][0]
    assert check_changed_part(baseline, memory_trace, "communication", "down") is True  # it vanished
    assert "variant" in capsys.readouterr().out  # the shares, printed once the answer is right
    assert check_changed_part(baseline, memory_trace, "computation", "up") is True  # it gained the share
    capsys.readouterr()
    for part, direction in (("communication", "up"), ("computation", "down"), ("data loading", "down"),
                            ("other", "up"), ("other", "down")):  # fmt: skip
        with pytest.raises(ExerciseError, match=f"{part} {direction} is not what your variant does"):
            check_changed_part(baseline, memory_trace, part, direction)
    assert "variant " not in capsys.readouterr().out  # a wrong answer does not print the shares
    with pytest.raises(ExerciseError, match="your variant still spends .* in communication"):
        check_changed_part(baseline, baseline, "communication", "down")  # a DP=2 "variant": nothing vanished
    with pytest.raises(ValueError, match="part must be one of"):
        check_changed_part(baseline, memory_trace, "kernels", "up")


@pytest.mark.parametrize("backend, stores", [("auto", False), ("unfused", True)])
def test_only_the_unfused_backend_has_attention_scores_in_a_trace(tmp_path, backend, stores):
    """Notebook 06's check on the scores: with the fused backend no operator of a traced step takes a
    (b, a, s, s) tensor; with --attention-backend unfused the softmax does."""
    import json

    from distlab.gpt.transformer.config import GPTConfig
    from distlab.gpt.transformer.gpt_model import GPTModel

    b, a, s = 2, 4, 32
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=a, vocab_size=128,
                    max_position_embeddings=s, attention_backend=backend)  # fmt: skip
    model, tokens = GPTModel(cfg), torch.randint(0, 128, (b, s))
    with torch.profiler.profile(record_shapes=True, profile_memory=True) as prof:
        model(tokens, tokens).mean().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    on_scores = {
        e["name"]
        for e in events
        if e.get("ph") == "X" and [b, a, s, s] in e.get("args", {}).get("Input Dims", [])
    }
    assert ("aten::softmax" in on_scores) is stores and bool(on_scores) is stores

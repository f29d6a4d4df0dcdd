"""distlab.course: the GPT notebooks' settings per site, their arguments, and the data made once."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from distlab import REPO_ROOT, course
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.data.indexed_dataset import IndexedDataset


def test_each_notebook_gets_its_local_model_and_arguments_the_engine_reads():
    for notebook, (_, local) in course.SIZES.items():
        lab = course.gpt_notebook(notebook, prepare=False)  # LAB_SITE unset: the local cluster
        assert (lab.backend, lab.procs) == ("gloo", 2)
        assert (lab.model, lab.iters, lab.micro) == (local.model, local.iters, local.micro)
        assert lab.data == REPO_ROOT / "data" / "gpt" and (lab.code / "pretrain_gpt.py").is_file()
        args = parse_args(lab.gpt_args("--log-timers-to-tensorboard", log_interval=2).split())
        shape = (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length)
        assert shape == dataclasses.astuple(local.model)
        assert (args.train_iters, args.eval_interval, args.log_interval) == (lab.iters, lab.iters, 2)
        assert args.log_timers_to_tensorboard and args.data_path == str(lab.data / course.DATASET)


def test_an_unknown_notebook_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"'08'.*\['04', '05', '06', '07', '13'\]"):
        course.gpt_notebook("08")


def test_export_sets_and_prints_the_variables(monkeypatch, capsys):
    monkeypatch.delenv("GPT_MICRO", raising=False)
    course.gpt_notebook("05", prepare=False).export(GPT_MICRO=2)
    assert capsys.readouterr().out == "backend gloo, 2 processes per node\nGPT_MICRO=2\n"
    assert os.environ["GPT_MICRO"] == "2"


def test_the_data_is_made_when_missing_and_only_then(tmp_path, capsys):
    data = tmp_path / "gpt"
    assert course.prepare_data(sys.executable, REPO_ROOT / "code", data) is True
    out = capsys.readouterr().out
    assert "train_tokenizer.py" in out and "preprocess_data.py" in out  # the commands, shown
    docs = IndexedDataset(str(data / course.DATASET))
    assert len(docs) > 1000 and docs.num_tokens > 100_000
    lab = dataclasses.replace(course.gpt_notebook("04", prepare=False), data=data)
    validate_args(parse_args([*lab.gpt_args().split(), "--micro-batch-size", "2"]), world_size=1)
    assert course.prepare_data(sys.executable, REPO_ROOT / "code", data) is False  # all there: nothing runs
    assert capsys.readouterr().out == ""


def test_a_failing_step_names_the_command_and_the_fix(tmp_path):
    (tmp_path / "stdlib_docstrings.jsonl").mkdir()  # the tokenizer cannot write its corpus there
    with pytest.raises(
        course.DataPreparationError, match=r"(?s)train_tokenizer\.py.*IsADirectoryError.*Fix: run"
    ):
        course.prepare_data(sys.executable, REPO_ROOT / "code", tmp_path)


def test_a_gpu_site_gets_the_reference_models(monkeypatch):
    monkeypatch.setenv("LAB_SITE", "example-gpu")  # sites/example-gpu.sh: nccl, 4 GPUs per node
    lab = course.gpt_notebook("07", prepare=False)
    assert (lab.backend, lab.procs) == ("nccl", 4)
    assert (lab.model, lab.micro) == (course.ModelShape(12, 768, 12, 1024), 8)  # GPT-2 small

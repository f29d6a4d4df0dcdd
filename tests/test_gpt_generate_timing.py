"""``generate.py``'s speed line: one untimed warm-up, then the median of ``--repeat`` generations
(a first pass pays for allocation and kernel choice, and one pass on a busy machine is noise)."""

from __future__ import annotations

import pytest

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import model_config
from distlab.gpt.inference import course_checkpoint
from distlab.gpt.inference.generation import Generation
from distlab.gpt.transformer.gpt_model import GPTModel
from tests.conftest import entry_script

generate_py = entry_script("generate")
pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(60)]


def test_timed_warms_up_then_keeps_the_median_run(monkeypatch):
    seconds = iter([100.0, 3.0, 1.0, 2.0])  # the warm-up's step is the slowest: it is not kept
    calls = []

    def fake_generate(model, prompt, max_new_tokens, **run):
        calls.append(run)
        return Generation(list(prompt), 1, [next(seconds)])

    monkeypatch.setattr(generate_py, "generate", fake_generate)
    kept = generate_py.timed(None, [1, 2], 1, 3, use_cache=True)
    assert len(calls) == 4 and all(c == {"use_cache": True} for c in calls)
    assert kept.step_s == [2.0]  # 1/3, 1/1, 1/2 tokens/s: the median is 1/2
    seconds = iter([9.0, 1.0, 2.0])
    assert generate_py.timed(None, [1], 1, 2, use_cache=False).step_s == [2.0]  # even: the lower one


def test_the_speed_line_names_the_repetitions(tmp_path, capsys):
    args = PretrainArgs(num_layers=1, hidden_size=16, num_attention_heads=2, max_position_embeddings=16)
    model = GPTModel(model_config(args, 64))
    course_checkpoint.write_release(str(tmp_path / "c"), args, model.cfg, model.state_dict())
    argv = ["--load", str(tmp_path / "c"), "--prompt-ids", "1 2", "--max-new-tokens", "4"]
    assert generate_py.main([*argv, "--repeat", "2"]) == 0
    assert "> tokens/s (median of 2 after a warm-up): " in capsys.readouterr().out
    assert generate_py.main([*argv, "--repeat", "0"]) == 2
    assert "--repeat 0" in capsys.readouterr().err

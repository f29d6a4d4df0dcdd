"""Published architectures beyond GPT-2 / Llama / Mixtral's defaults, each against transformers' own
model (small random configurations that transformers builds, nothing downloaded): Llama 3.1 / 3.2's
RoPE scaling (``rope_type`` llama3, both spellings: ``--use-rope-scaling``), GPT-2's own
``gelu_new`` (``--openai-gelu``), Qwen2's q/k/v biases (``--add-qkv-bias``) and Mistral (read as a
Llama; its sliding window refused by name). Each converts in (transformers' logits within 1e-5,
its greedy tokens) and out again (transformers loads it and computes the same); a converted Qwen2
continues on tp 2 x pp 2 with the flags the converter prints."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.inference import course_checkpoint, llama
from distlab.gpt.inference.generation import Sampling, generate
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.rope import llama3_frequencies
from distlab.local_runs import spawn_pretrain
from tests.conftest import entry_script

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: every model here is built locally
transformers = pytest.importorskip("transformers")
convert_checkpoint = entry_script("convert_checkpoint")
pytestmark = pytest.mark.timeout(300)

VOCAB = 128
PROMPT = [5, 17, 42, 9]
#: H 64, n 4 query heads in g 2 groups of d 16, F 96, RMSNorm 1e-6, untied output.
LLAMA_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
#: Llama 3.1's (factor 8) and 3.2's (factor 32) RoPE; base 500000 as both: with d 16 the 8
#: frequencies fall in all three of llama3's bands (kept, interpolated, divided by the factor).
LLAMA3 = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def rope(factor: float | None, theta: float = 500000.0) -> dict:
    if factor is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, **LLAMA3}


def hf_model(config, folder, seed: int = 0) -> torch.nn.Module:
    """transformers' own model of ``config``, every weight random (norms and biases too), saved."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def edit_config(folder, **change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text()) | change
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))


def tokens(T: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


def convert_in(folder, save, *extra: str):
    argv = ["--from", "hf", "--load", str(folder), "--save", str(save), "--make-vocab-size-divisible-by", "64",
            *extra]  # fmt: skip
    assert convert_checkpoint.main(argv) == 0
    ckpt = course_checkpoint.inspect(str(save))
    return ckpt, course_checkpoint.read_model(ckpt)


def check_in_and_out(hf, folder, tmp_path, T: int = 32):
    """``folder`` (``hf`` saved) -> course -> logits and greedy tokens as ``hf``'s -> transformers
    again: it loads, and computes ``hf``'s logits. Returns the course model and its checkpoint."""
    ckpt, model = convert_in(folder, tmp_path / "course")
    x = tokens(T)
    with torch.no_grad():
        expected = hf(x).logits
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)
    ours = generate(model, PROMPT, 16, Sampling(), use_cache=True)
    theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)
    assert ours.tokens == theirs[0].tolist()
    out = ["--to", "hf", "--load", str(tmp_path / "course"), "--save", str(tmp_path / "out")]
    assert convert_checkpoint.main(out) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, expected, rtol=0, atol=1e-5)
    return model, ckpt, again


def test_llama3_frequencies_are_transformers():
    """megatron-core's ``_apply_scaling`` as transformers' ``_compute_llama3_parameters``, for 3.1
    and 3.2, over all three bands."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for factor in (8.0, 32.0):
        config = transformers.LlamaConfig(**LLAMA_SHAPE, rope_parameters=rope(factor))
        theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        ours = llama3_frequencies(plain, factor)
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
        assert scale == 1.0
        kept, divided = ours == plain, torch.isclose(ours, plain / factor)
        assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling-type"])
def test_llama3_rope_scaling_in_and_out(spelling, tmp_path, capsys):
    """Llama 3.2 (factor 32, transformers 5's ``rope_parameters``) and 3.1 (factor 8, the older
    ``rope_scaling`` with ``type``, as published files have it) -> ``--use-rope-scaling
    --rope-scaling-factor f``; 128 positions, so that the scaled frequencies matter (checked)."""
    factor = 32.0 if spelling == "rope_parameters" else 8.0
    hf = hf_model(transformers.LlamaConfig(**LLAMA_SHAPE, rope_parameters=rope(factor)), tmp_path / "hf")
    if spelling != "rope_parameters":
        edit_config(tmp_path / "hf", rope_parameters=..., rope_theta=500000.0,
                    rope_scaling={"type": "llama3", "factor": factor, **LLAMA3})  # fmt: skip
    model, ckpt, again = check_in_and_out(hf, tmp_path / "hf", tmp_path, T=128)
    printed = capsys.readouterr().out
    assert f"--use-rope-scaling --rope-scaling-factor {factor}" in printed
    assert ckpt.args.use_rope_scaling and ckpt.args.rope_scaling_factor == factor
    assert again.config.rope_parameters["rope_type"] == "llama3"
    assert again.config.rope_parameters["factor"] == factor
    model.cfg.rope_scaling = False  # the same weights with plain RoPE: far from transformers' logits
    with torch.no_grad():
        assert (model(tokens(128)) - hf(tokens(128)).logits).abs().max() > 1e-3


def test_gpt2_gelu_new_in_and_out(tmp_path, capsys):
    """GPT-2's own activation (transformers' default) -> ``--openai-gelu``, and written back as it."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    assert config.activation_function == "gelu_new"
    hf = hf_model(config, tmp_path / "hf")
    model, ckpt, again = check_in_and_out(hf, tmp_path / "hf", tmp_path)
    assert "--openai-gelu" in capsys.readouterr().out and ckpt.args.openai_gelu
    assert again.config.activation_function == "gelu_new"
    for block in model.layers.values():
        block.mlp.gelu = "none"  # the exact GeLU on the same weights: not transformers' logits
    with torch.no_grad():
        assert (model(tokens()) - hf(tokens()).logits).abs().max() > 1e-5


def qwen2_config(**extra):
    shape = {k: v for k, v in LLAMA_SHAPE.items() if k != "head_dim"}  # Qwen2: d = H / n
    return transformers.Qwen2Config(**(shape | extra), rope_parameters=rope(None, 1e6))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen2_qkv_bias_in_and_out(tie, tmp_path, capsys):
    """Qwen2 (q/k/v biases, random) -> ``--disable-bias-linear --add-qkv-bias`` -> Qwen2ForCausalLM."""
    hf = hf_model(qwen2_config(tie_word_embeddings=tie), tmp_path / "hf")
    assert (
        hf.model.layers[0].self_attn.q_proj.bias is not None
        and hf.model.layers[0].self_attn.o_proj.bias is None
    )
    model, ckpt, again = check_in_and_out(hf, tmp_path / "hf", tmp_path)
    assert "--add-qkv-bias" in capsys.readouterr().out and ckpt.arch.hf_class == "Qwen2ForCausalLM"
    assert type(again).__name__ == "Qwen2ForCausalLM" and again.config.tie_word_embeddings is tie
    assert model.layers["0"].attn.qkv.bias is not None and model.layers["0"].attn.proj.bias is None
    assert model.layers["0"].mlp.fc1.bias is None


def test_mistral_without_a_window_in_and_out_as_llama(tmp_path):
    """A Mistral without sliding window (v0.2, v0.3) is a Llama: read, and written as LlamaForCausalLM."""
    config = transformers.MistralConfig(**LLAMA_SHAPE, sliding_window=None, rope_parameters=rope(None, 1e6))
    hf = hf_model(config, tmp_path / "hf")
    assert type(hf).__name__ == "MistralForCausalLM"
    _, ckpt, again = check_in_and_out(hf, tmp_path / "hf", tmp_path)
    assert ckpt.arch is llama.LLAMA and type(again).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_attention_is_refused_by_name(family, tmp_path, capsys):
    if family == "mistral":
        config = transformers.MistralConfig(**LLAMA_SHAPE, sliding_window=16)  # 16 of 256 positions
    else:
        config = qwen2_config(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    argv = ["--from", "hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "o")]
    assert convert_checkpoint.main(argv) != 0
    err = capsys.readouterr().err
    assert f"this {family} model uses sliding-window attention: sliding_window 16" in err, err
    assert "--window-size is not built" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "rope_parameters,error",
    [
        ({**rope(8.0), "original_max_position_embeddings": 4096}, "original_max_position_embeddings 4096"),
        ({**rope(8.0), "high_freq_factor": 2.0}, "high_freq_factor 2.0"),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, "rope_type 'yarn'"),
    ],
    ids=["context", "high-freq", "yarn"],
)
def test_rope_scaling_megatron_does_not_compute_is_refused(rope_parameters, error, tmp_path, capsys):
    transformers.LlamaConfig(**LLAMA_SHAPE).save_pretrained(tmp_path / "hf")  # no weights read
    edit_config(tmp_path / "hf", rope_parameters=rope_parameters)
    argv = ["--from", "hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "o")]
    assert convert_checkpoint.main(argv) != 0
    assert error in capsys.readouterr().err


def test_switches_where_their_part_is_not_built_are_refused():
    shape = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16
    )
    with pytest.raises(
        ValueError, match="--use-rope-scaling with --position-embedding-type learned_absolute"
    ):
        GPTConfig(**shape, rope_scaling=True)
    with pytest.raises(ValueError, match="--openai-gelu with --swiglu"):
        GPTConfig(**shape, openai_gelu=True, swiglu=True)
    from distlab.gpt.arguments.architecture import architecture_args_errors
    from distlab.gpt.layout import Layout

    args = PretrainArgs(**{k: v for k, v in shape.items() if k != "vocab_size"}, use_rope_scaling=True)
    args.kv_channels = 8
    assert any("--use-rope-scaling" in e for e in architecture_args_errors(args, Layout(1)))


def test_a_converted_qwen2_continues_on_tp2_pp2(tmp_path, capsys):
    """transformers' Qwen2 -> a tp 2 x pp 2 release (q/k/v biases split with their heads) ->
    ``pretrain_gpt.py`` with the printed flags on 4 gloo ranks, 2 steps at lr 0 -> out again:
    bit-equal weights."""
    from safetensors.torch import load_file

    hf_model(qwen2_config(), tmp_path / "hf")
    layout = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    convert_in(tmp_path / "hf", tmp_path / "c", *layout)
    printed = capsys.readouterr().out.split("> continue it with: pretrain_gpt.py ")[1].split()
    assert "--add-qkv-bias" in printed and "--tensor-model-parallel-size" in printed
    argv = [*printed, "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "0",
            "--min-lr", "0", "--train-iters", "2", "--eval-iters", "0", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64", "--distributed-backend",
            "gloo", "--save", str(tmp_path / "t")]  # fmt: skip
    run = spawn_pretrain(argv, 4, tmp_path / "run")
    assert f"> loaded checkpoint from {tmp_path / 'c'} at iteration 0" in run.log
    assert (
        convert_checkpoint.main(
            ["--to", "hf", "--load", str(tmp_path / "t"), "--save", str(tmp_path / "again")]
        )
        == 0
    )
    before, after = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "again"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

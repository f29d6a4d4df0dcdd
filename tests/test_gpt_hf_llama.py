"""The course's Llama and Llama-MoE against transformers' LlamaForCausalLM and MixtralForCausalLM
themselves (small random configurations that transformers builds, nothing downloaded): logits
within 1e-5 in fp32 both ways (grouped-query attention, RoPE with a base of its own, SwiGLU,
RMSNorm, tied and untied output, top-2 routing over 4 experts), greedy generation token for token
with and without the KV cache (``generate.py`` too), course -> HF -> course bit-equal from a tp 2
checkpoint, and a converted Llama that ``pretrain_gpt.py --load`` continues."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import model_config
from distlab.gpt.inference import course_checkpoint, hf_checkpoint
from distlab.gpt.inference.generation import Sampling, generate
from distlab.gpt.inference.llama import LLAMA
from distlab.gpt.inference.mixtral import MIXTRAL
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_runs import spawn_pretrain
from tests.conftest import entry_script

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: every model here is built locally
transformers = pytest.importorskip("transformers")
convert_checkpoint, generate_py = entry_script("convert_checkpoint"), entry_script("generate")
pytestmark = pytest.mark.timeout(300)

#: H 32, n 4 query heads in g 2 groups of d 8, F 48, RoPE base 50000, epsilon 1e-6, no biases.
LLAMA_ARGS = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
    kv_channels=8, ffn_hidden_size=48, max_position_embeddings=32, position_embedding_type="rope",
    rotary_base=50000, normalization="RMSNorm", layernorm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
)  # fmt: skip
MOE_ARGS = dict(num_experts=4, moe_router_topk=2)
VOCAB = 128
PROMPT = [5, 17, 42, 9]
FAMILIES = {"llama": (LLAMA, {}), "mixtral": (MIXTRAL, MOE_ARGS)}


def course_model(family: str, untie: bool = True, seed: int = 3, **layout) -> tuple[GPTModel, PretrainArgs]:
    """A course Llama (or Llama-MoE) whose weights are all random (the RMSNorms too, not 1)."""
    args = PretrainArgs(**LLAMA_ARGS, **FAMILIES[family][1], untie_embeddings_and_output_weights=untie,
                        seed=seed, **layout)  # fmt: skip
    model = GPTModel(model_config(args, VOCAB)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model, args


def hf_model(family: str, folder) -> torch.nn.Module:
    """transformers' own model of the family, random (norms too), saved to ``folder``."""
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                 rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                 tie_word_embeddings=False)  # fmt: skip
    if family == "llama":
        config = transformers.LlamaConfig(**shape)
    else:
        config = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "family,untie,one_p",
    [("llama", True, False), ("llama", False, False), ("mixtral", True, False), ("llama", True, True)],
    ids=["llama", "llama-tied", "mixtral", "llama-1p"],
)
def test_course_model_converted_out_computes_transformers_logits(family, untie, one_p, tmp_path):
    """llama-1p: --apply-layernorm-1p (Megatron's Llama 3 script) stores gamma - 1; written as gamma."""
    model, args = course_model(family, untie, layernorm_zero_centered_gamma=one_p)
    assert model.cfg.layernorm_zero_centered_gamma is one_p
    hf_checkpoint.write(str(tmp_path), FAMILIES[family][0], model.cfg, args, model.state_dict(), None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == FAMILIES[family][0].hf_class
    assert hf.config.tie_word_embeddings is not untie
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), hf(tokens()).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_transformers_model_converted_in_computes_and_generates_the_same(family, tmp_path, capsys):
    """transformers -> a tp 2 release checkpoint (K/V groups and the SwiGLU halves split per rank)
    -> read whole again: transformers' logits, and its greedy tokens with and without the cache."""
    hf = hf_model(family, tmp_path / "hf")
    argv = ["--from", "hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "course"),
            "--target-tensor-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]  # fmt: skip
    assert convert_checkpoint.main(argv) == 0
    ckpt = course_checkpoint.inspect(str(tmp_path / "course"))
    assert ckpt.arch is FAMILIES[family][0] and len(ckpt.files) == 2
    model = course_checkpoint.read_model(ckpt)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(1)), hf(tokens(1)).logits, rtol=0, atol=1e-5)
    for use_cache in (True, False):
        ours = generate(model, PROMPT, 24, Sampling(), use_cache=use_cache)
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, use_cache=use_cache)
        assert ours.tokens == theirs[0].tolist(), f"use_cache={use_cache}"
    capsys.readouterr()
    assert generate_py.main(["--load", str(tmp_path / "course"), "--prompt-ids", " ".join(map(str, PROMPT)),
                             "--max-new-tokens", "24"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"> {ckpt.arch.name} from" in out and "the same tokens with and without the cache: yes" in out
    assert out.strip().splitlines()[-1] == " ".join(map(str, ours.tokens))


@pytest.mark.parametrize("family,pp", [("llama", 2), ("mixtral", 1)], ids=["llama-tp2-pp2", "mixtral-tp2"])
def test_course_to_hf_to_course_is_bit_equal(family, pp, tmp_path):
    """A tp 2 (x pp 2: the untied output layer on the last stage) checkpoint, written for that
    layout from one random model (not trained), out and back in: every rank's file equal."""
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp)
    model, args = course_model(family, **layout)
    course_checkpoint.write_release(str(tmp_path / "ckpt"), args, model.cfg, model.state_dict())
    out = ["--to", "hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf")]
    assert convert_checkpoint.main(out) == 0
    argv = ["--from", "hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "back"),
            "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", str(pp),
            "--make-vocab-size-divisible-by", "64"]  # fmt: skip
    assert convert_checkpoint.main(argv) == 0
    ranks = sorted(p.name for p in (tmp_path / "ckpt" / "release").iterdir())
    assert len(ranks) == 2 * pp and ranks == sorted(p.name for p in (tmp_path / "back" / "release").iterdir())
    for rank in ranks:
        original, again = (torch.load(tmp_path / d / "release" / rank / "model_optim_rng.pt", weights_only=False)
                           for d in ("ckpt", "back"))  # fmt: skip
        assert original["model"].keys() == again["model"].keys()
        for name, tensor in original["model"].items():
            assert torch.equal(tensor, again["model"][name]), f"{rank} {name}"
        for name in LLAMA_ARGS | FAMILIES[family][1]:
            assert again["args"][name] == original["args"][name], name
        assert ("output_layer.weight" in again["model"]) is (pp == 1 or rank.endswith("_001"))  # last stage
        assert "output_weight" not in again["model"]  # untied: no copy of E


def test_a_converted_llama_continues_in_pretrain_gpt(tmp_path, capsys):
    """transformers -> course -> ``pretrain_gpt.py`` with the flags the converter prints (one
    process, mock data, lr 0) -> transformers again: the weights come back bit-equal."""
    hf_model("llama", tmp_path / "hf")
    assert (
        convert_checkpoint.main(
            ["--from", "hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "c")]
        )
        == 0
    )
    printed = capsys.readouterr().out.split("> continue it with: pretrain_gpt.py ")[1].split()
    assert "--swiglu" in printed and "--disable-bias-linear" in printed and "--rotary-base" in printed
    argv = [*printed, "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "0",
            "--min-lr", "0", "--train-iters", "2", "--eval-iters", "0", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "127", "--distributed-backend", "gloo", "--save", str(tmp_path / "t")]  # fmt: skip
    run = spawn_pretrain(argv, 1, tmp_path / "run")
    assert f"> loaded checkpoint from {tmp_path / 'c'} at iteration 0" in run.log
    assert len(run.last["losses"]) == 2 and all(torch.isfinite(torch.tensor(run.last["losses"])))
    assert (
        convert_checkpoint.main(
            ["--to", "hf", "--load", str(tmp_path / "t"), "--save", str(tmp_path / "again")]
        )
        == 0
    )
    before, after = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "again"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

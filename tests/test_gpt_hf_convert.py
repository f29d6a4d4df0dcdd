"""The course GPT against transformers' GPT2LMHeadModel itself (small random configurations that
transformers builds, nothing downloaded): equal logits in fp32, equal greedy generation with and
without the KV cache, course -> HF -> course bit-equal, a tp 2 run converted and generating the
tokens transformers generates, and a transformers model converted in and trained on by tp 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from distlab import REPO_ROOT
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.data.tokenizer import GPT2BPETokenizer
from distlab.gpt.data.tokenizers import TokenizerSpec
from distlab.gpt.inference import course_checkpoint, gpt2, hf_checkpoint
from distlab.gpt.inference.generation import Sampling, generate
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_runs import prepare_data, spawn_pretrain

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: every model here is built locally
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --seed 7 "
    "--hidden-dropout 0 --attention-dropout 0 --distributed-backend gloo"
).split()
PROMPT = [5, 17, 42, 9]


def script(name: str, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "code"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(REPO_ROOT / "code" / name), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=300, max_files=20)


@pytest.fixture(scope="module")
def tp2_ckpt(data, tmp_path_factory):
    """A checkpoint saved by a tp 2 run (2 gloo ranks, 3 iterations), --ckpt-format torch (its
    mp_rank files are what the converter's release for tp 2 must be); V = 384 (300 tokens padded to
    64 x tp), as one process pads them to 128."""
    root = tmp_path_factory.mktemp("tp2")
    argv = [*TINY, *data.argv(), "--train-iters", "3", "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64",
            "--save", str(root / "ckpt"), "--ckpt-format", "torch"]  # fmt: skip
    spawn_pretrain(argv, 2, root / "run")
    return root / "ckpt"


def random_course_model(vocab: int = 384, seed: int = 3) -> GPTModel:
    """A course GPT whose weights are all random (biases and LayerNorms too, not 0 and 1)."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=vocab,
                    max_position_embeddings=32, seed=seed)  # fmt: skip
    model = GPTModel(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def write_hf(model: GPTModel, folder, data=None) -> None:
    args = PretrainArgs(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=32)
    spec = TokenizerSpec("GPT2BPETokenizer", data.vocab_file, data.merge_file) if data else None
    hf_checkpoint.write(str(folder), gpt2.GPT2, model.cfg, args, model.state_dict(), spec)


def test_logits_equal_transformers_in_fp32(data, tmp_path):
    model = random_course_model()
    write_hf(model, tmp_path, data)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Return the number of items in the list."
    assert tok(text)["input_ids"] == GPT2BPETokenizer(data.vocab_file, data.merge_file).tokenize(text)


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
def test_greedy_generation_equals_transformers(data, tmp_path, use_cache):
    model = random_course_model()
    write_hf(model, tmp_path, data)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = generate(model, PROMPT, 24, Sampling(), use_cache=use_cache, vocab=300)
    theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, use_cache=use_cache)
    assert ours.tokens == theirs[0].tolist()
    assert max(ours.tokens[len(PROMPT) :]) < 300  # suppress_tokens: never a padded id


def test_the_cache_changes_no_sampled_token():
    model = random_course_model()
    sampling = Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=11)
    cached = generate(model, PROMPT, 24, sampling, use_cache=True)
    assert cached.tokens == generate(model, PROMPT, 24, sampling, use_cache=False).tokens
    assert cached.tokens != generate(model, PROMPT, 24, Sampling(seed=11), use_cache=True).tokens


def test_course_to_hf_to_course_is_bit_equal(tp2_ckpt, tmp_path):
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    assert (
        script(
            "convert_checkpoint.py", "--to", "hf", "--load", str(tp2_ckpt), "--save", str(hf_dir)
        ).returncode
        == 0
    )
    done = script("convert_checkpoint.py", "--from", "hf", "--load", str(hf_dir), "--save", str(back),
                  "--target-tensor-parallel-size", "2", "--make-vocab-size-divisible-by", "64")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for rank in ("mp_rank_00", "mp_rank_01"):
        original = torch.load(tp2_ckpt / "iter_0000003" / rank / "model_optim_rng.pt", weights_only=False)
        again = torch.load(back / "release" / rank / "model_optim_rng.pt", weights_only=False)
        assert original["model"].keys() == again["model"].keys()
        for name, tensor in original["model"].items():
            assert torch.equal(tensor, again["model"][name]), f"{rank} {name}"


@pytest.fixture(scope="module")
def pp2_ckpt(data, tmp_path_factory):
    """A checkpoint saved by a pp 2 run (2 gloo ranks, 1F1B, 2 iterations), torch_dist (the
    default): wte on the first stage, output_weight (its copy) on the last."""
    root = tmp_path_factory.mktemp("pp2")
    argv = [*TINY, *data.argv(), "--train-iters", "2", "--pipeline-model-parallel-size", "2",
            "--save", str(root / "ckpt")]  # fmt: skip
    spawn_pretrain(argv, 2, root / "run")
    return root / "ckpt"


@pytest.mark.parametrize("layout", ["tp2_ckpt", "pp2_ckpt"])
def test_a_parallel_checkpoint_generates_what_transformers_generates(layout, request, tmp_path):
    ckpt = request.getfixturevalue(layout)
    out = script("convert_checkpoint.py", "--to", "hf", "--load", str(ckpt), "--save", str(tmp_path))
    assert out.returncode == 0, out.stderr
    ids = " ".join(map(str, PROMPT))
    run = script("generate.py", "--load", str(ckpt), "--prompt-ids", ids, "--max-new-tokens", "20")
    assert run.returncode == 0, run.stderr
    ours = [int(x) for x in run.stdout.strip().splitlines()[-1].split()]
    assert (
        "with the KV cache" in run.stdout and "the same tokens with and without the cache: yes" in run.stdout
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)
    assert ours == theirs[0].tolist()


def test_tp2_and_one_process_from_the_same_weights_generate_the_same_tokens(data, tp2_ckpt, tmp_path):
    """The same run (seed, data, 3 iterations) on one process: the weights agree to round-off,
    the greedy tokens exactly."""
    argv = [*TINY, *data.argv(), "--train-iters", "3", "--save", str(tmp_path / "ckpt")]
    spawn_pretrain(argv, 1, tmp_path / "run")
    ids = " ".join(map(str, PROMPT))
    runs = [script("generate.py", "--load", str(c), "--prompt-ids", ids, "--max-new-tokens", "20")
            for c in (tp2_ckpt, tmp_path / "ckpt")]  # fmt: skip
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    tp2, one = (r.stdout.strip().splitlines()[-1] for r in runs)
    assert tp2 == one


def test_hf_model_converts_in_and_trains_on_tp2(data, tmp_path):
    eod = GPT2BPETokenizer(data.vocab_file, data.merge_file).eod
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=eod, eos_token_id=eod)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    for src, name in ((data.vocab_file, "vocab.json"), (data.merge_file, "merges.txt")):
        (tmp_path / "hf" / name).write_bytes(open(src, "rb").read())
    done = script("convert_checkpoint.py", "--from", "hf", "--load", str(tmp_path / "hf"),
                  "--save", str(tmp_path / "course"), "--target-tensor-parallel-size", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    # the course model from the release checkpoint computes transformers' logits
    model = course_checkpoint.read_model(course_checkpoint.inspect(str(tmp_path / "course")))
    tokens = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :300], hf(tokens).logits, rtol=0, atol=1e-5)
    # pretrain_gpt.py --load continues it on tp 2: with lr 0 its weights stay transformers' exactly
    argv = [*TINY, *data.argv(), "--tensor-model-parallel-size", "2", "--load", str(tmp_path / "course"),
            "--save", str(tmp_path / "trained")]  # fmt: skip
    run = spawn_pretrain([*argv, "--train-iters", "2", "--lr", "0", "--min-lr", "0"], 2, tmp_path / "run")
    assert f"> loaded checkpoint from {tmp_path / 'course'} at iteration 0" in run.log
    assert len(run.last["losses"]) == 2 and all(torch.isfinite(torch.tensor(run.last["losses"])))
    out = script(
        "convert_checkpoint.py",
        "--to",
        "hf",
        "--load",
        str(tmp_path / "trained"),
        "--save",
        str(tmp_path / "again"),
    )
    assert out.returncode == 0, out.stderr
    before, after = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "again" / "model.safetensors"),
    )
    rows = after.pop("transformer.wte.weight")  # V = 512: 300 padded for tp 2 x 128, last row copied
    assert rows.shape[0] == 512 and torch.equal(rows[:300], before["transformer.wte.weight"])
    assert torch.equal(rows[300:], before["transformer.wte.weight"][-1].expand(212, -1))
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), name
    # and with a learning rate it trains: the loss falls from transformers' weights
    run = spawn_pretrain(
        [*argv, "--train-iters", "6", "--save", str(tmp_path / "trained2")], 2, tmp_path / "run2"
    )
    losses = run.last["losses"]
    assert losses[-1] < losses[0], losses


def test_fsdp2_torch_dist_checkpoint_generates_what_transformers_generates(data, tmp_path):
    """FSDP2 over 2 ranks saves DTensor shards with torch.distributed.checkpoint: generate.py and
    the converter put them together in one process."""
    argv = [*TINY, *data.argv(), "--train-iters", "2", "--use-torch-fsdp2", "--ckpt-format", "torch_dist",
            "--save", str(tmp_path / "ckpt")]  # fmt: skip
    spawn_pretrain(argv, 2, tmp_path / "run")
    out = script(
        "convert_checkpoint.py",
        "--to",
        "hf",
        "--load",
        str(tmp_path / "ckpt"),
        "--save",
        str(tmp_path / "hf"),
    )
    assert out.returncode == 0, out.stderr
    run = script(
        "generate.py", "--load", str(tmp_path / "ckpt"), "--prompt", "Return the", "--max-new-tokens", "12"
    )
    assert run.returncode == 0, run.stderr
    assert "(torch_dist, saved with tp 1 x pp 1)" in run.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    theirs = hf.generate(**tok("Return the", return_tensors="pt"), max_new_tokens=12, do_sample=False)
    assert run.stdout.rstrip("\n").endswith(tok.decode(theirs[0]))

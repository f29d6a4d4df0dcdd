"""Generation and checkpoint reading without transformers: the KV cache runs the model on one
new position per token and gives the logits of the whole sequence; a release checkpoint written
for tp 2 x pp 2 reads back whole, bit for bit; top-k and top-p keep the ids they should."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.checkpointing.checkpoint_config import CheckpointConfig
from distlab.gpt.inference import course_checkpoint
from distlab.gpt.inference.generation import Sampling, generate, next_token
from distlab.gpt.inference.kv_cache import KVCache
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel

pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(120)]
CFG = GPTConfig(
    num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=32
)


def test_cached_logits_equal_the_whole_sequence():
    model = GPTModel(CFG).eval()
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(tokens)  # (2, 20, V)
        cache = KVCache(20)
        steps = []
        for chunk in (tokens[:, :7], tokens[:, 7:8], tokens[:, 8:15], *tokens[:, 15:].split(1, dim=1)):
            steps.append(model(chunk, cache=cache))
            cache.advance(chunk.shape[1])
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache.nbytes() == 2 * 4 * 2 * 4 * 20 * 8 * 4  # 2 L b n max_length d x 4 bytes
    with pytest.raises(ValueError, match="holds 20 positions: 20 cached \\+ 1 new do not fit"):
        model(tokens[:, :1], cache=cache)


def test_with_the_cache_each_new_token_runs_one_position():
    model = GPTModel(CFG).eval()
    seen = []
    model.wte.register_forward_hook(lambda module, inputs, output: seen.append(tuple(inputs[0].shape)))
    generate(model, [1, 2, 3, 4, 5], 6, Sampling(), use_cache=True)
    assert seen == [(1, 5)] + [(1, 1)] * 5  # the prompt once, then one position per token
    seen.clear()
    generate(model, [1, 2, 3, 4, 5], 6, Sampling(), use_cache=False)
    assert seen == [(1, 5 + t) for t in range(6)]  # without: the whole sequence every time


def test_top_k_and_top_p_keep_the_ids_they_should():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]]))
    gen = torch.Generator().manual_seed(0)
    draws = lambda s: {int(next_token(logits, s, gen)) for _ in range(300)}  # noqa: E731
    assert draws(Sampling(temperature=1.0, top_k=2)) == {1, 2}
    assert draws(Sampling(temperature=1.0, top_p=0.8)) == {1, 2}  # 0.5 + 0.3 reach 0.8
    assert draws(Sampling(temperature=1.0, top_p=0.81)) == {1, 2, 3}
    assert draws(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert int(next_token(logits, Sampling(), gen)) == 1


def test_a_release_checkpoint_for_tp2_pp2_reads_back_whole(tmp_path):
    model = GPTModel(CFG)
    args = PretrainArgs(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=32,
                        tensor_model_parallel_size=2, pipeline_model_parallel_size=2)  # fmt: skip
    course_checkpoint.write_release(str(tmp_path), args, CFG, model.state_dict())
    files = sorted(p.parent.name for p in (tmp_path / "release").glob("*/model_optim_rng.pt"))
    assert files == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    last = torch.load(tmp_path / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert sorted(
        {k.split(".")[0] + "." + k.split(".")[1] for k in last["model"] if k.startswith("layers.")}
    ) == [
        "layers.2",
        "layers.3",
    ]
    assert torch.equal(last["model"]["output_weight"], model.wte.weight[64:])  # tp rank 1's rows of E
    ckpt = course_checkpoint.inspect(str(tmp_path))
    assert (ckpt.ckpt_format, ckpt.config.vocab_size) == ("torch", 128)
    back = course_checkpoint.read_model(ckpt).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_a_release_checkpoint_loads_into_a_run_that_saves_torch_dist(tmp_path):
    """The run's load reads the release's legacy layout (as Megatron-LM's), whatever it saves in;
    the torch_dist reader itself refuses it naming the one that reads it."""
    from distlab.gpt.checkpointing import checkpointing, dist_checkpointing
    from distlab.gpt.checkpointing.checkpointer import Checkpointer
    from distlab.gpt.layout import Layout
    from distlab.gpt.parallel_state import ParallelState

    args = PretrainArgs(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=32)
    written = GPTModel(CFG).state_dict()
    course_checkpoint.write_release(str(tmp_path), args, CFG, written)
    assert checkpointing.saved_format(str(tmp_path)) == "torch"
    loading = CheckpointConfig(
        load=str(tmp_path), ckpt_format="torch_dist", arguments=dataclasses.asdict(args)
    )
    model = GPTModel(dataclasses.replace(CFG, seed=7))  # other weights, until loaded
    state = ParallelState(Layout(1), rank=0)
    loaded = Checkpointer(loading, state, torch.device("cpu")).load(
        model, torch.optim.AdamW(model.parameters())
    )
    assert loaded == (0, 0, None)  # a release starts at iteration 0, with the run's own optimizer
    assert all(torch.equal(v, written[k]) for k, v in model.state_dict().items())
    with pytest.raises(
        FileNotFoundError, match="holds a release checkpoint .* checkpointing.load_checkpoint reads it"
    ):
        dist_checkpointing.load_checkpoint(loading, None, None, None)

"""The Llama architecture (``transformer/config.py``): each of Megatron's switches alone and all
together computes, split over tp 2 (with and without sequence parallelism), the loss and the
gradients of one process; the rotate-half RoPE is Hugging Face's; the flags' defaults and
refusals are Megatron's. Whole runs of the Llama layouts: ``tests/test_gpt_llama_layouts.py``.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
import torch.distributed as dist

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.layers import shard
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.gpt.transformer.rope import apply_rotary, rotary_angles
from tests.conftest import TINY_GPT_ARGV, run_gloo

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5  # fp32: the tp ranks sum the same products in another order
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16)
LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    num_query_groups=2,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    ffn_hidden_size=64,
)
#: name: GPTConfig fields on top of SHAPE; each switch alone, then Llama.
CASES = {
    "RMSNorm": dict(normalization="RMSNorm"),
    "layernorm-1p": dict(layernorm_zero_centered_gamma=True, layernorm_epsilon=1e-6),
    "rope": dict(position_embedding_type="rope", rotary_base=500),
    "rope-half": dict(position_embedding_type="rope", rotary_percent=0.5),
    "no-position": dict(position_embedding_type="none"),
    "swiglu": dict(swiglu=True, ffn_hidden_size=48),
    "gqa-2": dict(num_query_groups=2),  # tp 2 divides g: K/V heads split
    "gqa-1": dict(num_query_groups=1),  # g divides tp 2: K/V replicated
    "kv-channels": dict(kv_channels=12),
    "no-bias": dict(add_bias_linear=False),
    "untied": dict(untie_embeddings_and_output_weights=True, init_method_std=0.05),
    "llama": LLAMA,
    "llama-mqa": {**LLAMA, "num_query_groups": 1},
    "llama-explicit-selective": {
        **LLAMA,
        "attention_backend": "unfused",
        "recompute_granularity": "selective",
    },
}


def _loss_and_grads(model: GPTModel, tokens: torch.Tensor, group) -> tuple[torch.Tensor, dict]:
    loss = model(tokens, tokens.roll(-1, 1)).mean()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if getattr(
            p, "sequence_parallel", False
        ):  # each rank's T / tp positions: summed, as gradients.py does
            dist.all_reduce(g, group=group)
        grads[name] = g
    return loss.detach(), grads


def _check_cases(ctx) -> None:
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))  # (b, T)
    for name, fields in CASES.items():
        for sp in (False, True):
            cfg = GPTConfig(**SHAPE, **fields)
            ref_loss, ref_grads = _loss_and_grads(GPTModel(cfg), tokens, None)
            state = ParallelState.build(Layout(2, tp=2, sequence_parallel=sp))
            model = GPTModel(GPTConfig(**SHAPE, **fields, sequence_parallel=sp), state)
            loss, grads = _loss_and_grads(model, tokens, state.tp_group)
            what = f"{name} tp 2{' + SP' * sp}"
            torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL, msg=f"{what}: loss")
            assert ref_grads.keys() == grads.keys(), what
            for pname, p in model.named_parameters():
                full, dim = ref_grads[pname], getattr(p, "partition_dim", None)
                want = full if dim is None else shard(full, dim, 2, state.tp_rank, p.partition_stride)
                torch.testing.assert_close(grads[pname], want, rtol=TOL, atol=TOL, msg=f"{what}: {pname}")


def test_every_switch_and_llama_split_over_tp2_equal_one_process() -> None:
    """Loss and every gradient (this rank's shard of the unsharded one) within 1e-5, tp 2 with and
    without SP: GQA with 2 groups (split) and 1 group (replicated) included."""
    run_gloo(_check_cases, 2, timeout_s=240)


def test_llama_parameters_are_megatrons_shapes() -> None:
    """No biases, no position table, RMSNorm weights only, qkv (n + 2g) d rows, fc1 [gate; up]."""
    model = GPTModel(GPTConfig(**SHAPE, **LLAMA))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {
        "wte.weight": (128, 32),
        **{
            f"layers.{i}.{leaf}": shape
            for i in range(2)
            for leaf, shape in {
                "ln1.weight": (32,),
                "attn.qkv.weight": ((4 + 2 * 2) * 8, 32),
                "attn.proj.weight": (32, 32),
                "ln2.weight": (32,),
                "mlp.fc1.weight": (2 * 64, 32),
                "mlp.fc2.weight": (32, 64),
            }.items()
        },
        "ln_f.weight": (32,),
        "output_layer.weight": (128, 32),
    }
    assert model.tied_embedding() is None  # nothing to sum between the first and last stage
    assert not torch.equal(model.output_embedding(), model.wte.weight)


def test_rope_is_hugging_faces_rotate_half_and_relative() -> None:
    """The rotation equals transformers' Llama ``apply_rotary_pos_emb`` (same rotate-half pairing,
    i with i + d/2) and makes q.k depend on the distance between positions only."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    d, base = 8, 10000.0
    q, k = torch.randn(1, 2, 6, d, generator=torch.Generator().manual_seed(1)).unbind(1)  # (1, 6, d) each
    q, k = q.unsqueeze(1), k.unsqueeze(1)  # (b, heads, T, d)
    angles = rotary_angles(torch.arange(6), d, base)  # (T, d)
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, angles.cos()[None], angles.sin()[None])
    torch.testing.assert_close(apply_rotary(q, angles), hf_q)
    torch.testing.assert_close(apply_rotary(k, angles), hf_k)
    assert angles[3, 0] == 3.0 and angles[3, d // 2] == 3.0  # pair (0, d/2) turns by m theta_0 = m
    assert angles[1, 1].item() == pytest.approx(base ** (-2 / d))
    x, y = torch.randn(2, d, generator=torch.Generator().manual_seed(2))
    dots = [
        (apply_rotary(x.view(1, 1, 1, d), rotary_angles(torch.tensor([m]), d, base))
         * apply_rotary(y.view(1, 1, 1, d), rotary_angles(torch.tensor([m - 2]), d, base))).sum()
        for m in (2, 5, 9)
    ]  # fmt: skip
    torch.testing.assert_close(dots[0], dots[1])
    torch.testing.assert_close(dots[0], dots[2])
    part = apply_rotary(q, rotary_angles(torch.arange(6), d // 2, base))  # --rotary-percent 0.5
    torch.testing.assert_close(part[..., d // 2 :], q[..., d // 2 :])  # the rest passes as it is


def _validated(*flags: str, world: int = 2):
    args = parse_args([*TINY_GPT_ARGV, *flags])
    try:
        validate_args(args, world)
    except ValueError as e:
        return args, str(e)
    return args, ""


def test_megatron_defaults_of_the_architecture_flags() -> None:
    args = parse_args(list(TINY_GPT_ARGV))
    assert (args.normalization, args.layernorm_epsilon, args.layernorm_zero_centered_gamma) == (
        "LayerNorm",
        1e-5,
        False,
    )
    assert (args.position_embedding_type, args.rotary_base, args.rotary_percent) == (
        "learned_absolute",
        10000,
        1.0,
    )
    assert (args.add_position_embedding, args.add_bias_linear, args.swiglu) == (True, True, False)
    assert (args.group_query_attention, args.num_query_groups, args.kv_channels) == (False, 1, None)
    assert (args.untie_embeddings_and_output_weights, args.init_method_std) == (False, 0.02)
    args, _ = _validated("--swiglu", "--hidden-size", "96", world=1)
    assert (args.ffn_hidden_size, args.kv_channels) == (256, 24)  # int(4 x 96 x 2/3 / 64) x 64; 96 / 4
    args, _ = _validated(world=1)
    assert (args.ffn_hidden_size, args.kv_channels) == (None, 8)  # None: 4H (as checkpoints record it); H / n
    flags = parse_args([*TINY_GPT_ARGV, "--disable-bias-linear", "--no-position-embedding", "--apply-layernorm-1p",
                        "--norm-epsilon", "1e-6"])  # fmt: skip
    assert (flags.add_bias_linear, flags.add_position_embedding, flags.layernorm_zero_centered_gamma) == (
        False,
        False,
        True,
    )
    assert flags.layernorm_epsilon == 1e-6


@pytest.mark.parametrize(
    "flags,world,expected",
    [
        (["--group-query-attention", "--num-query-groups", "3", "--num-attention-heads", "6",
          "--hidden-size", "48", "--tensor-model-parallel-size", "2"], 2,
         "--num-query-groups 3 with --tensor-model-parallel-size 2: .* choose --num-query-groups in \\[1, 2, 6\\]"),
        (["--group-query-attention", "--num-query-groups", "3"], 1,
         "--num-query-groups 3 must divide --num-attention-heads 4"),
        (["--position-embedding-type", "rope", "--rotary-percent", "0.2"], 1,
         "--rotary-percent 0.2 of a head of 8 channels rotates 1: RoPE needs an even number"),
        (["--no-position-embedding"], 1,
         "--no-position-embedding with --position-embedding-type learned_absolute: .* use --position-embedding-type none"),
        (["--swiglu", "--tensor-model-parallel-size", "2", "--tensor-parallel-impl", "dtensor",
          "--use-torch-fsdp2"], 2, "--swiglu with --tensor-parallel-impl dtensor and tp 2"),
        (["--swiglu", "--ffn-hidden-size", "33", "--tensor-model-parallel-size", "2"], 2,
         "--ffn-hidden-size 33 .* divisible by --tensor-model-parallel-size 2"),
    ],
)  # fmt: skip
def test_bad_architecture_is_refused_before_compute_with_the_values_and_the_fix(
    flags, world, expected
) -> None:
    _, error = _validated(*flags, world=world)
    assert error.startswith("invalid arguments: ") and re.search(expected, error), error


def test_good_query_groups_pass_for_split_and_replicated_kv() -> None:
    for groups, tp in ((2, 2), (4, 2), (1, 2), (2, 4)):
        heads, hidden = 4 * max(tp, 1), 64
        _, error = _validated("--group-query-attention", "--num-query-groups", str(groups), "--num-attention-heads",
                              str(heads), "--hidden-size", str(hidden), "--tensor-model-parallel-size", str(tp),
                              world=tp)  # fmt: skip
        assert "query-groups" not in error, (groups, tp, error)


def test_llama_flops_per_token_and_parameters_follow_the_blocks() -> None:
    """SwiGLU's three F x H matrices and GQA's (n + 2g) d qkv rows: the parameter count is the sum."""
    cfg = GPTConfig(**SHAPE, **LLAMA)
    H, n, g, d, F, V = 32, 4, 2, 8, 64, 128
    per_block = H * (n + 2 * g) * d + n * d * H + 3 * H * F + 2 * H  # qkv, proj, gate+up+down, 2 RMSNorm
    assert sum(p.numel() for p in GPTModel(cfg).parameters()) == 2 * per_block + 2 * V * H + H
    assert math.isclose(cfg.head_dim * cfg.num_attention_heads, H)


def test_llama_model_flops_equal_pytorchs_flop_counter() -> None:
    """The generalised formula (GQA's qkv, SwiGLU's three matrices, kv-channels) against
    torch.utils.flop_counter over the meta-device Llama; GPT-2's formula would miss it."""
    from distlab.gpt.arguments import PretrainArgs
    from distlab.gpt.arguments.from_args import model_flops_per_iteration
    from distlab.gpt.training.flops import counted_flops

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=4096, seq_length=64, batch=2)
    arch = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
                add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=128, kv_channels=16)  # fmt: skip
    counted = counted_flops(**shape, **arch)
    args = PretrainArgs(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=64, global_batch_size=2,
                        swiglu=True, group_query_attention=True, num_query_groups=2, ffn_hidden_size=128,
                        kv_channels=16)  # fmt: skip
    assert model_flops_per_iteration(args, 4096) == counted
    gpt2 = PretrainArgs(
        num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=64, global_batch_size=2
    )
    # per token and block: qkv 2H (n + 2g) d = 2H 3H here; attention 4 s n d against 4 s H, the projection
    # 2 n d H against 2 H^2 (n d = 2H), the MLP 6 H F against 16 H^2: 24 h^2 + 4 s h misses by the rest
    H, s, nd, F = 64, 64, 128, 128
    per_token = 4 * s * (nd - H) + 2 * H * (nd - H) + 6 * H * F - 16 * H * H
    assert counted - model_flops_per_iteration(gpt2, 4096) == 2 * s * 3 * 2 * per_token != 0


def test_llama_memory_estimate_counts_its_parameters_and_activations() -> None:
    """The estimator's parameters are the model's; one Llama block's saved activations, measured by
    autograd's saved-tensor hooks, are its estimate plus the few small tensors it leaves out
    (log-sum-exp, RoPE's cos and sin tables): within 4% above, never below."""
    from distlab.gpt.memory.activation_memory import saved_activation_bytes
    from distlab.gpt.memory.memory_estimate import MemorySetup, block_bytes, stage_parameters
    from distlab.gpt.transformer.gpt_model import init_parameters
    from distlab.gpt.transformer.transformer_layer import Block

    s, b, h, a, V = 64, 2, 64, 8, 128
    arch = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
                add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=160)  # fmt: skip
    setup = MemorySetup(2, h, a, s, V, b, **arch)
    assert stage_parameters(setup) == sum(
        p.numel() for p in GPTModel(GPTConfig(2, h, a, V, s, **arch)).parameters()
    )
    for backend in ("auto", "unfused"):
        cfg = GPTConfig(1, h, a, V, s, attention_backend=backend, **arch)
        block = Block(cfg, None)
        init_parameters(block, cfg, None)
        x = torch.randn(b, s, h, requires_grad=True)
        angles = rotary_angles(torch.arange(s), h // a, 10000)
        measured = saved_activation_bytes(
            functools.partial(block, x, rotary=angles), list(block.parameters())
        )
        estimated = block_bytes(MemorySetup(1, h, a, s, V, b, attention_backend=backend, **arch))
        assert estimated <= measured <= 1.04 * estimated, (backend, measured, estimated)


def test_llama_generation_with_the_kv_cache_equals_the_whole_sequence() -> None:
    """RoPE at the positions after the cached ones and grouped K/V in the cache: the logits of
    chunk-by-chunk decoding are the whole sequence's, and the cache holds g, not n, heads."""
    from distlab.gpt.inference.kv_cache import KVCache

    model = GPTModel(GPTConfig(**{**SHAPE, "max_position_embeddings": 20}, **LLAMA)).eval()
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(tokens)  # (2, 20, V)
        cache, steps = KVCache(20), []
        for chunk in (tokens[:, :7], tokens[:, 7:8], tokens[:, 8:15], *tokens[:, 15:].split(1, dim=1)):
            steps.append(model(chunk, cache=cache))
            cache.advance(chunk.shape[1])
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache.nbytes() == 2 * 2 * 2 * 2 * 20 * 8 * 4  # 2 L b g max_length d x 4 bytes: g = 2 of n = 4

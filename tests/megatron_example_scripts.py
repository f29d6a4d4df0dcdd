"""The flag arrays of two Megatron-LM example scripts, as the scripts write them, with sizes,
counts and paths made small (test fixture; CI has no Megatron-LM clone).

Source: NVIDIA/Megatron-LM at commit d98e8a64dd,
    examples/llama/train_llama3_8b_h100_fp8.sh          (LLAMA3_8B_FP8, DTYPE=fp8: its mock-data branch,
                                                          and its real-data one, DATA_ARGS_LIST_REAL)
    examples/mixtral/train_mixtral_8x7b_distributed.sh  (MIXTRAL_8X7B; without WANDB_API_KEY)

Each array is a list of the script's elements in order. The scripts expand them unquoted
(``${DATA_ARGS_LIST[@]}``), so bash splits every element at white space and removes no quotes:
``"--split '99,1,0'"`` reaches Megatron as ``--split`` and ``'99,1,0'``; :func:`argv` does the same.
Every value changed from the script is marked ``# was ...``; ``{tmp}``, ``{tokenizer}`` and
``{data}`` are paths filled by the test.

``ARCHITECTURE_AND_MOE`` are the flags of the model's architecture and of MoE, built by other
parts of issue 33 (items 1 and 2); the flag tests here leave them out where the parser does not
know them yet (with their values).
"""

from __future__ import annotations

# fmt: off
LLAMA3_8B_FP8 = {
    "world_size": 2,  # was GPUS_PER_NODE=8 x NUM_NODES=1
    "MODEL_ARGS": [
        "--use-mcore-models",
        "--num-layers", "2",  # was 32
        "--hidden-size", "64",  # was 4096
        "--ffn-hidden-size", "224",  # was 14336
        "--num-attention-heads", "4",  # was 32
        "--group-query-attention",
        "--num-query-groups", "2",  # was 8
        "--kv-channels", "16",  # was 128
        "--seq-length", "32",  # was 8192
        "--max-position-embeddings", "32",  # was 8192
        "--position-embedding-type", "rope",
        "--rotary-base", "1000000",
        "--rotary-percent", "1.0",
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--swiglu",
        "--normalization", "RMSNorm",
        "--init-method-std", "0.0134",
        "--attention-backend", "fused",
        "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
    ],
    "TRAINING_ARGS": [
        "--micro-batch-size", "1",
        "--global-batch-size", "4",  # was 128
        "--train-samples", "32",  # was 1953125000
        "--lr-decay-samples", "28",  # was 1949218748
        "--lr-warmup-samples", "8",  # was 3906252
        "--lr", "0.00015",
        "--min-lr", "0.00001",
        "--decoupled-lr", "5.0e-4",
        "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine",
        "--clip-grad", "1.0",
        "--weight-decay", "0.1",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--bf16",
        "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss",
        "--manual-gc",
        "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        # DDP_ARGS, appended to TRAINING_ARGS by the script
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ],
    "DTYPE_ARGS": [
        "--fp8-format hybrid",
        "--fp8-amax-history-len 1024",
        "--fp8-amax-compute-algo max",
        "--fp8-param-gather",
    ],
    "MODEL_PARALLEL_ARGS": [
        "--tensor-model-parallel-size", "1",
        "--context-parallel-size", "1",
        "--sequence-parallel",
    ],
    "DATA_ARGS_LIST": [
        "--mock-data",
        "--tokenizer-type NullTokenizer",
        "--vocab-size 512",  # was 128256
        "--data-cache-path {tmp}/cache",  # was ${PWD}/benchmark_cache_llama3_8b_fp8
        "--tiktoken-pattern v2",
        "--split '99,1,0'",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--num-workers 1",
    ],
    # the script's other branch, for real data (TOKENIZER_ARG and DATA_ARG given)
    "DATA_ARGS_LIST_REAL": [
        "--data-path {data}",
        "--tokenizer-type HuggingFaceTokenizer",
        "--tokenizer-model {tokenizer}",
        "--data-cache-path {tmp}/cache",
        "--split '99,1,0'",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--num-workers 1",
        "--vocab-size 512",  # was 128256
    ],
    "EVAL_AND_LOGGING_ARGS": [
        "--log-interval", "1",
        "--eval-iters", "2",  # was 32
        "--eval-interval", "4",  # was 100
        "--save-interval", "1000",
        "--log-throughput",
        "--profile",
        "--profile-step-start", "4",
        "--profile-step-end", "6",
        "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60",
        "--save", "{tmp}/ckpt",  # was checkpoints/llama3_8b_fp8
        "--load", "{tmp}/ckpt",
        "--tensorboard-dir", "{tmp}/tb",  # was tensorboard_logs/llama3_8b_fp8
    ],
}

MIXTRAL_8X7B = {
    "world_size": 4,  # was GPUS_PER_NODE=8 x NNODES=1
    "MODEL_ARGS": [
        "--use-mcore-models",
        "--disable-bias-linear",
        "--seq-length", "32",  # was 4096
        "--max-position-embeddings", "64",  # was 32768
        "--num-layers", "4",  # was 32
        "--hidden-size", "64",  # was 4096
        "--ffn-hidden-size", "224",  # was 14336
        "--num-attention-heads", "4",  # was 32
        "--init-method-std", "0.01",
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--normalization", "RMSNorm",
        "--position-embedding-type", "rope",
        "--swiglu",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--num-query-groups", "2",  # was 8
        "--no-masked-softmax-fusion",
        "--no-position-embedding",
        "--rotary-base", "1000000",
    ],
    "MOE_ARGS": [
        "--num-experts", "8",
        "--moe-router-topk", "2",
        "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2",
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
    ],
    "DATA_ARGS": [
        "--tokenizer-type", "Llama2Tokenizer",
        "--tokenizer-model", "{tokenizer}",
        "--data-path", "{data}",
        "--split", "98,1,1",  # was 99990,8,2 (its 8 and 2 in 100000 of this small corpus are no sample)
    ],
    "TRAINING_ARGS": [
        "--micro-batch-size", "1",
        "--global-batch-size", "8",  # was 256
        "--lr", "1e-4",
        "--train-iters", "3",  # was 500000
        "--lr-decay-iters", "3",  # was 320000
        "--lr-decay-style", "cosine",
        "--min-lr", "1.0e-5",
        "--weight-decay", "0.1",
        "--lr-warmup-iters", "1",  # was 500
        "--clip-grad", "1.0",
        "--bf16",
    ],
    "MODEL_PARALLEL_ARGS": [
        "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "2",  # was 4 (pp 4 x dp 2 would need 8 ranks)
        "--expert-model-parallel-size", "2",  # was 8 (ep divides dp = 2)
        "--use-distributed-optimizer",
        "--sequence-parallel",
    ],
    "LOGGING_ARGS": [
        "--log-interval", "1",
        "--save-interval", "10000",
        "--eval-interval", "3",  # was 1000
        "--eval-iters", "1",  # was 10
        "--save", "{tmp}/ckpt",  # was $CHECKPOINT_PATH
        "--load", "{tmp}/ckpt",
        "--tensorboard-dir", "{tmp}/ckpt/tensorboard",
        "--no-load-optim",
        "--no-load-rng",
    ],
}

# fmt: on

#: The order in which each script passes its arrays to pretrain_gpt.py.
ORDER = {
    "llama": ("MODEL_ARGS", "TRAINING_ARGS", "DTYPE_ARGS", "MODEL_PARALLEL_ARGS", "DATA_ARGS_LIST",
              "EVAL_AND_LOGGING_ARGS"),
    "llama-real-data": ("MODEL_ARGS", "TRAINING_ARGS", "DTYPE_ARGS", "MODEL_PARALLEL_ARGS", "DATA_ARGS_LIST_REAL",
                        "EVAL_AND_LOGGING_ARGS"),
    "mixtral": ("MODEL_ARGS", "MOE_ARGS", "DATA_ARGS", "TRAINING_ARGS", "MODEL_PARALLEL_ARGS", "LOGGING_ARGS"),
}  # fmt: skip
SCRIPTS = {"llama": LLAMA3_8B_FP8, "llama-real-data": LLAMA3_8B_FP8, "mixtral": MIXTRAL_8X7B}

#: Architecture (issue 33 item 1) and MoE (item 2) flags -> how many values each takes.
ARCHITECTURE_AND_MOE = {
    "--group-query-attention": 0, "--num-query-groups": 1, "--kv-channels": 1, "--position-embedding-type": 1,
    "--rotary-base": 1, "--rotary-percent": 1, "--swiglu": 0, "--normalization": 1, "--apply-layernorm-1p": 0,
    "--untie-embeddings-and-output-weights": 0, "--disable-bias-linear": 0, "--no-position-embedding": 0,
    "--ffn-hidden-size": 1, "--init-method-std": 1, "--num-experts": 1, "--moe-router-topk": 1,
    "--moe-router-load-balancing-type": 1, "--moe-aux-loss-coeff": 1, "--moe-grouped-gemm": 0,
    "--moe-token-dispatcher-type": 1, "--expert-model-parallel-size": 1,
}  # fmt: skip


def argv(script: str, **paths: str) -> list[str]:
    """The script's command line after ``pretrain_gpt.py``: each element split at white space as
    bash splits an unquoted expansion (quotes stay), the paths filled in."""
    words = []
    for array in ORDER[script]:
        for element in SCRIPTS[script][array]:
            words += element.format(**paths).split()
    return words


def without(words: list[str], flags: dict[str, int]) -> list[str]:
    """``words`` less each flag of ``flags`` and its values."""
    out, i = [], 0
    while i < len(words):
        if words[i] in flags:
            i += 1 + flags[words[i]]
        else:
            out.append(words[i])
            i += 1
    return out

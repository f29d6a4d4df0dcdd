"""Generate text from a course checkpoint, with a KV cache, and time it against no cache.

The checkpoint is any ``pretrain_gpt.py --save`` folder (``--ckpt-format torch`` or ``torch_dist``,
from any layout: its tp, pp, cp, ep and FSDP parts are put together in this one process) or a
release checkpoint that ``convert_checkpoint.py --from hf`` wrote. The tokenizer is the run's own
(its ``--tokenizer-type`` and files) unless GPT-2 BPE files are given::

    python code/generate.py --load runs/gpt/ckpt --prompt "Return the" --max-new-tokens 32
    python code/generate.py --load runs/gpt/ckpt --prompt-ids "464 2068" --temperature 0.8 --top-k 50 \\
        --top-p 0.95 --seed 7

It prints the text, the tokens per second with and without the KV cache (and the milliseconds per
token at the start and at the end of the generation: constant with the cache, growing without),
and with ``--prompt-ids`` the token ids (prompt and new) on the last line. Temperature 0 is greedy.
One process, on the GPU when there is one. The times are the median of ``--repeat`` generations
after one untimed warm-up (the first pass pays for memory allocation and kernel selection).

``--chat`` puts the prompt through the tokenizer's chat template (``tokenizer_config.json`` or
``chat_template.jinja`` beside its files, as a transformers checkpoint ships them) as one user
message, then asks for the assistant's answer::

    python code/generate.py --load runs/gpt/from_hf --chat --prompt "What is a KV cache?"
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from distlab.gpt.inference import course_checkpoint, hf_tokenizer
from distlab.gpt.inference.architecture import ConversionError
from distlab.gpt.inference.generation import Generation, Sampling, check_length, generate


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="a course checkpoint folder (pretrain_gpt.py --save)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, tokenized with the run's tokenizer")
    prompt.add_argument("--prompt-ids", help='token ids, e.g. "1 2 3"')
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: every id")
    p.add_argument("--top-p", type=float, default=1.0, help="1: every id")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-file", help="vocab.json (default: the run's --vocab-file)")
    p.add_argument("--merge-file", help="merges.txt (default: the run's --merge-file)")
    p.add_argument(
        "--chat", action="store_true", help="--prompt as a user message, through the chat template"
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="timed generations per mode after a warm-up (median)"
    )
    return p.parse_args(argv)


def prompt_ids(opts: argparse.Namespace, tokenizer, vocab: int, spec=None) -> list[int]:
    if opts.prompt is not None:
        if tokenizer is None:
            raise ConversionError(
                "--prompt needs the run's tokenizer, which is gone: give --vocab-file and --merge-file, "
                "or --prompt-ids"
            )
        if opts.chat and spec.tokenizer_type not in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
            raise ConversionError(f"--chat: --tokenizer-type {spec.tokenizer_type} has no chat template here")
        if opts.chat:  # the template writes the special tokens itself: none added (as transformers)
            text = hf_tokenizer.render_chat(
                tokenizer_folder(spec), [{"role": "user", "content": opts.prompt}]
            )
            return tokenizer.tokenize(text, add_special_tokens=False)
        return tokenizer.tokenize(opts.prompt)
    if opts.chat:
        raise ConversionError("--chat takes --prompt TEXT (the user's message), not --prompt-ids")
    try:
        ids = [int(x) for x in opts.prompt_ids.replace(",", " ").split()]
    except ValueError:
        raise ConversionError(f"--prompt-ids {opts.prompt_ids!r}: give integers, e.g. '1 2 3'") from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ConversionError(f"--prompt-ids {bad} are not ids of the vocabulary [0, {vocab})")
    return ids


def tokenizer_folder(spec) -> str:
    """Where the tokenizer's transformers files (its chat template) would be."""
    if spec.tokenizer_type == "GPT2BPETokenizer":
        return hf_tokenizer.folder_of(spec.vocab_file)
    return hf_tokenizer.folder_of(spec.tokenizer_model or ".")


def timed(model, prompt: list[int], max_new_tokens: int, repeat: int, **run) -> Generation:
    """One untimed warm-up, then ``repeat`` generations: the one of median speed (the lower
    middle one for an even ``repeat``); every one draws the same tokens (the seed is reset)."""
    generate(model, prompt, max_new_tokens, **run)
    runs = [generate(model, prompt, max_new_tokens, **run) for _ in range(repeat)]
    speed = statistics.median_low(g.tokens_per_s() for g in runs)
    return next(g for g in runs if g.tokens_per_s() == speed)


def timing_lines(cached: Generation, uncached: Generation, repeat: int = 1) -> list[str]:
    quarter = max(len(cached.step_s) // 4, 1)
    head, tail = slice(1, 1 + quarter), slice(-quarter, None)  # the first step holds the prompt
    return [
        f"> tokens/s (median of {repeat} after a warm-up): {cached.tokens_per_s():.1f} with the KV cache, "
        f"{uncached.tokens_per_s():.1f} without",
        f"> ms per new token (median), first quarter -> last quarter: {cached.ms_per_token(head):.2f} -> "
        f"{cached.ms_per_token(tail):.2f} with the KV cache, {uncached.ms_per_token(head):.2f} -> "
        f"{uncached.ms_per_token(tail):.2f} without",
        "> the same tokens with and without the cache: "
        + (
            "yes"
            if cached.tokens == uncached.tokens
            else "no (sampling from logits that differ in round-off)"
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        hf_tokenizer.check_given(vocab_file=opts.vocab_file, merge_file=opts.merge_file)
        if opts.repeat < 1:
            raise ConversionError(f"--repeat {opts.repeat}: time at least 1 generation")
        sampling = Sampling(opts.temperature, opts.top_k, opts.top_p, opts.seed)
        ckpt = course_checkpoint.inspect(opts.load)  # arguments and shapes: no weight read yet
        spec = course_checkpoint.tokenizer_spec(ckpt.args, opts.vocab_file, opts.merge_file)
        tokenizer = spec.build() if spec else None
        vocab = tokenizer.vocab_size if tokenizer else ckpt.config.vocab_size
        prompt = prompt_ids(opts, tokenizer, vocab, spec)
        check_length(len(prompt), opts.max_new_tokens, ckpt.config.max_position_embeddings)
        model = course_checkpoint.read_model(ckpt)
    except ConversionError as exc:
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    print(f"> {ckpt.arch.name} from {ckpt.folder} ({ckpt.ckpt_format}, saved with tp "
          f"{ckpt.args.tensor_model_parallel_size} x pp {ckpt.args.pipeline_model_parallel_size}) on {device}")  # fmt: skip
    eos = tokenizer.eod if tokenizer else None
    run = dict(sampling=sampling, vocab=vocab, eos=eos)
    cached = timed(model, prompt, opts.max_new_tokens, opts.repeat, use_cache=True, **run)
    uncached = timed(model, prompt, opts.max_new_tokens, opts.repeat, use_cache=False, **run)
    print(*timing_lines(cached, uncached, opts.repeat), sep="\n")
    if tokenizer is not None:
        print(tokenizer.detokenize(cached.tokens))
    if opts.prompt_ids is not None:
        print(" ".join(map(str, cached.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

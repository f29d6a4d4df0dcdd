"""Convert checkpoints between the course and Hugging Face transformers.

Course -> transformers (a folder ``AutoModelForCausalLM.from_pretrained`` loads as
``GPT2LMHeadModel`` (the course GPT), ``LlamaForCausalLM`` (a run with Llama's flags) or
``MixtralForCausalLM`` (those and ``--num-experts``), with the tokenizer ``AutoTokenizer`` loads;
from any ``pretrain_gpt.py --save`` folder, either ``--ckpt-format``, any layout)::

    python code/convert_checkpoint.py --to hf --load runs/gpt/ckpt --save runs/gpt/hf
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('runs/gpt/hf')"

transformers -> course (a ``model.safetensors`` folder, or its shards with their index; a release
checkpoint, model only, for the layout the run that continues it uses; its tokenizer files are
copied beside it; ``--to hf`` writes shards beyond ``--max-shard-size``, default 5GB)::

    python code/convert_checkpoint.py --from hf --load runs/gpt/hf --save runs/gpt/from_hf \\
        --target-tensor-parallel-size 2
    torchrun --standalone --nproc-per-node=2 code/pretrain_gpt.py $ARGS --tensor-model-parallel-size 2 \\
        --load runs/gpt/from_hf --save runs/gpt/ckpt2 \\
        --vocab-file runs/gpt/from_hf/vocab.json --merge-file runs/gpt/from_hf/merges.txt

The run that loads it gives the same model shape (printed here) and starts at iteration 0 with a
fresh optimizer. The weight-by-weight mappings are in ``distlab/gpt/inference/gpt2.py``,
``llama.py`` and ``mixtral.py``; the vocabulary padding in ``distlab/gpt/inference/hf_checkpoint.py``. Bad input (a folder that is no
checkpoint, a model the converter does not know, a configuration that does not match the weights,
a tokenizer that does not fit the vocabulary) is refused before any weight is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import model_config
from distlab.gpt.data.tokenizer import GPT2BPETokenizer
from distlab.gpt.data.tokenizers import HuggingFaceTokenizer, TokenizerSpec
from distlab.gpt.inference import course_checkpoint, hf_checkpoint, hf_tokenizer, safetensors_shards
from distlab.gpt.inference.architecture import ConversionError
from distlab.gpt.layout import Layout
from distlab.gpt.model_layout import ModelShape, model_layout_errors
from distlab.gpt.tensor_parallel.layers import pad_vocab_size


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="the checkpoint folder to read")
    p.add_argument("--save", required=True, help="the folder to write")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["hf"], help="course checkpoint -> transformers folder")
    way.add_argument("--from", dest="source", choices=["hf"], help="transformers folder -> course checkpoint")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="--from hf: the run's tp")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="--from hf: the run's pp")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="--from hf: the run's")
    p.add_argument("--vocab-file", help="vocab.json (default: the checkpoint's own)")
    p.add_argument("--merge-file", help="merges.txt (default: the checkpoint's own)")
    p.add_argument("--tokenizer-model", help="a transformers tokenizer: its folder or tokenizer.json, with "
                   "tokenizer_config.json beside it (default: the checkpoint's own)")  # fmt: skip
    p.add_argument("--max-shard-size", type=shard_size, default=safetensors_shards.MAX_SHARD_SIZE,
                   help="--to hf: larger weights are written as shards with their index ('5GB', '200MB', bytes)")  # fmt: skip
    return p.parse_args(argv)


def shard_size(text: str) -> int | str:
    """``--max-shard-size``: bytes, or a size with its unit as transformers takes it ("5GB")."""
    return int(text) if text.isdigit() else text


def to_hf(opts: argparse.Namespace) -> str:
    ckpt = course_checkpoint.inspect(opts.load)
    if opts.tokenizer_model:
        spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=opts.tokenizer_model)
    else:
        spec = course_checkpoint.tokenizer_spec(ckpt.args, opts.vocab_file, opts.merge_file)
    model = course_checkpoint.read_model(ckpt)
    files = hf_checkpoint.write(
        opts.save, ckpt.arch, ckpt.config, ckpt.args, model.state_dict(), spec, opts.max_shard_size
    )
    return (
        f"> {ckpt.arch.name} from {ckpt.folder} ({ckpt.ckpt_format}, tp {ckpt.args.tensor_model_parallel_size}"
        f" x pp {ckpt.args.pipeline_model_parallel_size}) -> {opts.save} ({ckpt.arch.hf_class}, vocab_size "
        f"{ckpt.config.vocab_size}"
        + (", with its tokenizer)" if files else f", no tokenizer files: {_why_none(spec)})")
    )


def _why_none(spec) -> str:
    if spec is None:
        return "the run's are gone (give --vocab-file, --merge-file or --tokenizer-model)"
    carried = " and ".join(hf_checkpoint.CARRIED)
    return f"--tokenizer-type {spec.tokenizer_type} is not converted, only {carried}"


def from_hf(opts: argparse.Namespace) -> str:
    given = (opts.vocab_file, opts.merge_file) if opts.vocab_file or opts.merge_file else None
    hf = hf_checkpoint.inspect(opts.load, given)
    if opts.tokenizer_model:  # the transformers tokenizer given: it, not the folder's GPT-2 files
        hf.tokenizer_files = None
    tp, pp = opts.target_tensor_parallel_size, opts.target_pipeline_parallel_size
    rows, shape = hf.config["vocab_size"], hf.course_args
    hf_source = transformers_tokenizer(opts, hf)
    vocab = target_vocabulary(hf, opts.make_vocab_size_divisible_by, tp, hf_source)
    check_layout(shape, tp, pp)
    files = {}
    if hf.tokenizer_files:  # beside the checkpoint: the arguments it saves name them
        os.makedirs(opts.save, exist_ok=True)
        vocab_file, merge_file = hf_checkpoint.copy_tokenizer(hf.tokenizer_files, opts.save)
        files = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab_file, "merge_file": merge_file}
    if hf_source:  # tokenizer.json and the rest (a chat template): copied, read from the copy
        hf_tokenizer.copy(hf_source, opts.save)
        files = files or {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": opts.save}
    args = PretrainArgs(**shape, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                        make_vocab_size_divisible_by=opts.make_vocab_size_divisible_by, **files)  # fmt: skip
    cfg = model_config(args, vocab)
    full = hf.arch.from_hf(hf_checkpoint.read_weights(hf), cfg)
    for name in ("wte.weight", "output_layer.weight"):  # E and an untied output layer: (V, H)
        if name in full:
            full[name] = hf_checkpoint.fit_vocabulary(full[name], vocab)
    folder = course_checkpoint.write_release(opts.save, args, cfg, full)
    flags = " ".join(flag for k, v in shape.items() if "dropout" not in k and (flag := as_flag(k, v)))
    if shape.get("num_experts") and tp > 1:
        flags += " --sequence-parallel"  # MoE with tp trains with SP (model_layout.moe_needs_sp)
    return (
        f"> {hf.arch.hf_class} from {opts.load} -> {folder} (release, tp {tp} x pp {pp}, padded vocabulary "
        f"{vocab} from {rows} rows)\n> continue it with: pretrain_gpt.py --load {opts.save} {flags} "
        f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
    )


def as_flag(name: str, value) -> str | None:
    """A ``PretrainArgs`` field's value as its flag: ``--swiglu``, ``--disable-bias-linear``,
    ``--norm-epsilon 1e-05``; None for a default switch or None."""
    meta = next(f.metadata for f in dataclasses.fields(PretrainArgs) if f.name == name)
    flag = meta.get("flag", "--" + name.replace("_", "-"))
    if isinstance(value, bool):  # a switch: store_true, or store_false for the --disable-* / --no-* ones
        given = value if meta.get("action") != "store_false" else not value
        return flag if given else None
    if value is None:
        return None
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def transformers_tokenizer(opts: argparse.Namespace, hf: hf_checkpoint.HFCheckpoint) -> str | None:
    """The folder of the transformers tokenizer files that travel with the conversion: the one
    ``--tokenizer-model`` names, else beside the GPT-2 files, else the checkpoint's; None: none."""
    if opts.tokenizer_model:
        folder = hf_tokenizer.folder_of(opts.tokenizer_model)
        if not hf_tokenizer.files_in(folder):
            raise ConversionError(f"--tokenizer-model {opts.tokenizer_model}: no tokenizer.json there")
        return folder
    folder = hf_tokenizer.folder_of(hf.tokenizer_files[0]) if hf.tokenizer_files else opts.load
    return folder if hf_tokenizer.files_in(folder) else None


def target_vocabulary(
    hf: hf_checkpoint.HFCheckpoint, divisible_by: int, tp: int, hf_source: str | None = None
) -> int:
    """V of the run that loads the conversion: the tokenizer's size padded as that run pads it
    (GPT-2's files, else the transformers tokenizer in the folder ``hf_source``)."""
    rows = hf.config["vocab_size"]
    if hf.tokenizer_files:
        tokens = GPT2BPETokenizer(*hf.tokenizer_files).vocab_size
    elif hf_source:
        try:
            tokens = HuggingFaceTokenizer(hf_source).vocab_size
        except ValueError as exc:  # no end-of-sequence token a course run could use
            raise ConversionError(f"{hf_source}'s tokenizer: {exc}") from None
        hf_checkpoint.check_vocabulary(tokens, rows, f"{hf_source}'s tokenizer.json")
    else:
        tokens = None
    vocab = pad_vocab_size(tokens or rows, divisible_by, tp)
    if tokens is None and vocab != rows:
        raise ConversionError(
            f"{hf.folder} has no tokenizer files and its {rows} rows are no multiple of "
            f"--make-vocab-size-divisible-by {divisible_by} x tp {tp}: give the tokenizer (--vocab-file, "
            f"--merge-file, or --tokenizer-model)"
        )
    return vocab


def check_layout(shape: dict, tp: int, pp: int) -> None:
    """The model against the target tp x pp, by the engine's own rules (``model_layout.py``)."""
    g = shape.get("num_query_groups") if shape.get("group_query_attention") else None
    model = ModelShape(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                       num_attention_heads=shape["num_attention_heads"], ffn_hidden_size=shape["ffn_hidden_size"],
                       num_query_groups=g, num_experts=shape.get("num_experts"))  # fmt: skip
    # MoE with tp trains with sequence parallelism: the continue command adds --sequence-parallel
    layout = Layout(tp * pp, tp=tp, pp=pp, sequence_parallel=bool(model.num_experts) and tp > 1)
    if errors := model_layout_errors(model, layout):
        raise ConversionError(
            f"--target-tensor-parallel-size {tp} x --target-pipeline-parallel-size {pp} does not split "
            f"the model: " + "; ".join(errors)
        )


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        hf_tokenizer.check_given(
            vocab_file=opts.vocab_file, merge_file=opts.merge_file, tokenizer_model=opts.tokenizer_model
        )
        if opts.tokenizer_model and (opts.vocab_file or opts.merge_file):
            raise ConversionError("give --tokenizer-model or --vocab-file and --merge-file, not both")
        if bool(opts.vocab_file) != bool(opts.merge_file):
            raise ConversionError("give --vocab-file and --merge-file together (GPT-2's BPE is both)")
        print(to_hf(opts) if opts.to else from_hf(opts))
    except ConversionError as exc:
        print(f"convert_checkpoint.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

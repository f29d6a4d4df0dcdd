"""A course checkpoint, written from any layout, read whole into one process; and one written for
a layout from a whole state dict (Megatron's ``release`` checkpoint).

Reading (:func:`inspect`, then :func:`read_model`)::

    latest_checkpointed_iteration.txt -> iter_0000020/ (or release/)
    torch       mp_rank_<tp>[_<pp>][_<ep>]/model_optim_rng.pt, one per (tp, pp, ep) rank (``_<pp>``
                with pp > 1, ``_<ep>`` with ep > 1, as ``checkpointing.rank_file`` names them): a
                tensor that the model tags with a ``partition_dim`` (and ``partition_stride``) is
                put back together from the tp ranks' parts (``tensor_parallel.unshard``, the
                inverse of the initialiser's ``shard``); pipeline stages and ep ranks hold disjoint
                global names (blocks by their global index, every virtual chunk; experts by theirs),
                the ep ranks the same dense weights; the last stage's ``output_weight`` is wte
                again (tied) and is dropped, an untied ``output_layer`` kept; cp ranks hold copies,
                dp rank 0 wrote them
    torch_dist  DCP's ``.metadata`` holds every tensor's global shape: ``dcp.load`` without a
                process group assembles FSDP2's and DTensor TP's shards, the hand-written tp's
                (``checkpointing/tp_chunks.py``) and an ep run's experts (each saved by its
                own rank) into whole tensors

The shapes are checked against the model the saved arguments build before any weight is read
(``torch.load(mmap=True)`` maps, it does not read). V, the padded vocabulary, is the stored
embedding's rows (x tp for the torch format).

Writing (:func:`write_release`): ``release/mp_rank_<tp>[_<pp>]/model_optim_rng.pt`` per rank of the
target tp x pp, each the model's state dict for that rank (the parts ``shard`` cuts, the stage's
blocks; E on the first stage, the final norm and an untied ``output_layer`` on the last, and there
a copy of E when tied and pp > 1), the arguments and no optimizer, RNG or iteration; ``--load`` of it starts at iteration
0 with the run's own optimizer and seed (``checkpointing.load_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import model_config
from distlab.gpt.checkpointing import checkpointing, durable
from distlab.gpt.data.tokenizers import TokenizerSpec
from distlab.gpt.inference import families
from distlab.gpt.inference.architecture import Architecture, ConversionError, StateDict
from distlab.gpt.tensor_parallel.layers import shard, unshard
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel

RANK_DIR = re.compile(r"mp_rank_\d+(?:_\d+){0,2}")  # mp_rank_<tp>[_<pp>][_<ep>], as a whole name
RANK_FILE = "model_optim_rng.pt"


@dataclass
class CourseCheckpoint:
    """A checked course checkpoint: where, which format, its arguments and the model they build."""

    folder: str  # iter_<n>/ or release/
    ckpt_format: str  # torch or torch_dist
    args: PretrainArgs
    arch: Architecture
    config: GPTConfig  # one whole model (tp = pp = 1), V the stored padded vocabulary
    files: dict[tuple[int, int, int], str]  # torch: (tp_rank, pp_rank, ep_rank) -> file


def _args_of(saved: dict) -> PretrainArgs:
    names = {f.name for f in dataclasses.fields(PretrainArgs)}
    return PretrainArgs(**{k: v for k, v in saved.items() if k in names})


def locate(load: str) -> tuple[str, str]:
    """The committed folder under ``load`` and its format, or :class:`ConversionError`."""
    if not os.path.isdir(load):
        raise ConversionError(f"{load} is not a folder: give --load the --save folder of a course run")
    tracker = os.path.join(load, checkpointing.TRACKER)
    if not os.path.exists(tracker):
        hint = (
            "it is a transformers folder: convert it with --from hf"
            if os.path.exists(os.path.join(load, "config.json"))
            else f"not a course checkpoint (pretrain_gpt.py --save writes {checkpointing.TRACKER})"
        )
        raise ConversionError(f"{load} has no {checkpointing.TRACKER}: {hint}")
    if checkpointing.is_release(load):
        folder = os.path.join(load, checkpointing.RELEASE)
    else:
        iteration = checkpointing.read_tracker(load)
        folder = checkpointing.committed_dir(load, iteration)
    if os.path.exists(os.path.join(folder, ".metadata")):
        return folder, "torch_dist"
    if os.path.isdir(folder) and any(RANK_DIR.fullmatch(n) for n in os.listdir(folder)):
        return folder, "torch"
    raise ConversionError(
        f"{folder}, named by {tracker}, holds neither mp_rank_* folders nor DCP's .metadata"
    )


def inspect(load: str) -> CourseCheckpoint:
    """Find, check and describe the checkpoint under ``load``; read no weight."""
    folder, fmt = locate(load)
    if fmt == "torch_dist":
        from torch.distributed.checkpoint import FileSystemReader  # imports FSDP: only when needed

        common = torch.load(os.path.join(folder, "common.pt"), map_location="cpu", weights_only=False)
        args, files = _args_of(common["args"]), {}
        meta = FileSystemReader(folder).read_metadata().state_dict_metadata
        stored = {k.removeprefix("model."): tuple(v.size) for k, v in meta.items() if k.startswith("model.")}
        rows = stored.get("wte.weight", (0,))[0]
    else:
        names = sorted(n for n in os.listdir(folder) if RANK_DIR.fullmatch(n))  # mp_rank_00[_000][_000] first
        first = torch.load(os.path.join(folder, names[0], RANK_FILE), map_location="cpu", mmap=True,
                           weights_only=False)  # fmt: skip
        args = _args_of(first["args"])
        tp, pp, ep = (
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.expert_model_parallel_size,
        )
        files = {_ranks(name, pp, ep): os.path.join(folder, name, RANK_FILE) for name in names}
        everyone = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
        if missing := sorted(everyone - files.keys()):
            raise ConversionError(
                f"{folder} misses the files of (tp rank, pp rank, ep rank) {missing} of its tp {tp} x pp {pp} "
                f"x ep {ep}"
            )
        rows = first["model"]["wte.weight"].shape[0] * tp if "wte.weight" in first["model"] else 0
        stored = None
    arch = families.for_args(args)
    config = model_config(args, rows)
    ckpt = CourseCheckpoint(folder, fmt, args, arch, config, files)
    if stored is not None:
        _check_shapes(ckpt, stored)
    return ckpt


def _ranks(name: str, pp: int, ep: int) -> tuple[int, int, int]:
    """``mp_rank_<tp>[_<pp>][_<ep>]`` -> (tp, pp, ep) rank: the pp rank is there with pp > 1, the
    ep rank with ep > 1 (``checkpointing.rank_file``), so the saved sizes tell the numbers apart."""
    tp_rank, *rest = (int(n) for n in name.removeprefix("mp_rank_").split("_"))
    pp_rank = rest.pop(0) if pp > 1 and rest else 0
    ep_rank = rest.pop(0) if ep > 1 and rest else 0
    return tp_rank, pp_rank, ep_rank


def _check_shapes(ckpt: CourseCheckpoint, stored: dict[str, tuple[int, ...]]) -> None:
    expected = {k: tuple(v.shape) for k, v in meta_state_dict(ckpt.config).items()}
    wrong = [f"{k}: {stored.get(k, 'missing')} (stored) vs {s} (arguments)" for k, s in expected.items()
             if stored.get(k) != s]  # fmt: skip
    if wrong:
        raise ConversionError(f"{ckpt.folder} does not match its arguments: " + "; ".join(wrong[:6]))


def meta_state_dict(cfg: GPTConfig) -> StateDict:
    """The whole model's state dict as shapes only (meta tensors): what the weights must be."""
    return {k: torch.empty(v.shape, device="meta") for k, v in GPTModel(cfg).state_dict().items()}


def read_model(ckpt: CourseCheckpoint) -> GPTModel:
    """The whole model in one process, in eval mode, its weights the checkpoint's."""
    model = GPTModel(ckpt.config)
    if ckpt.ckpt_format == "torch_dist":
        import torch.distributed.checkpoint as dcp

        state = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
        dcp.load(state, checkpoint_id=ckpt.folder, no_dist=True)  # the parts of every saved rank
        full = state["model"]
    else:
        full = _gather_torch(ckpt, model)
    model.load_state_dict(full)
    return model.eval()


def _gather_torch(ckpt: CourseCheckpoint, model: GPTModel) -> StateDict:
    """Every (tp, pp) file's tensors (mapped), their shapes checked against the tp parts of
    ``model``'s, then put back together."""
    tp = ckpt.args.tensor_model_parallel_size
    parts: dict[str, list[torch.Tensor | None]] = {}
    for (tp_rank, *_), path in sorted(ckpt.files.items()):
        for name, tensor in torch.load(path, map_location="cpu", mmap=True, weights_only=False)[
            "model"
        ].items():
            parts.setdefault(name, [None] * tp)[tp_rank] = tensor
    parts.pop("output_weight", None)  # the last stage's copy of wte (tied)
    tags, wrong = {}, []
    for name, p in model.state_dict(keep_vars=True).items():
        dim, pieces = getattr(p, "partition_dim", None), parts.get(name)
        part = [s // tp if i == dim else s for i, s in enumerate(p.shape)]  # one tp rank's
        got = [tuple(x.shape) if x is not None else "missing" for x in pieces or [None]]
        if pieces is None or any(g != tuple(part) for g in got):
            wrong.append(f"{name}: {got} (stored) vs {tuple(part)} per tp rank (arguments)")
        tags[name] = (dim, getattr(p, "partition_stride", 1))
    wrong += [f"{name}: not in the model" for name in parts.keys() - tags.keys()]
    if wrong:
        raise ConversionError(f"{ckpt.folder} does not match its arguments: " + "; ".join(wrong[:6]))
    return {name: unshard(parts[name], dim, stride) if dim is not None else parts[name][0]
            for name, (dim, stride) in tags.items()}  # fmt: skip


def write_release(save: str, args: PretrainArgs, cfg: GPTConfig, full: StateDict) -> str:
    """Megatron's release checkpoint of the whole state dict ``full`` for ``args``' tp x pp; the folder."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size  # checked by the caller
    folder = os.path.join(save, checkpointing.RELEASE)
    model = GPTModel(cfg)  # the tags: which tensors are split, along which dimension
    tags = {name: (getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
            for name, p in model.named_parameters()}  # fmt: skip
    per_stage = cfg.num_layers // pp
    for pp_rank in range(pp):
        blocks = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
        for tp_rank in range(tp):
            sd = {}
            for name, w in full.items():
                layer = int(name.split(".")[1]) if name.startswith("layers.") else None
                first_only = name.startswith(("wte.", "wpe."))
                last_only = name.startswith(("ln_f.", "output_layer."))
                if (
                    (layer is not None and layer not in blocks)
                    or (first_only and pp_rank > 0)
                    or (last_only and pp_rank < pp - 1)
                ):
                    continue
                dim, stride = tags[name]
                sd[name] = shard(w, dim, tp, tp_rank, stride).clone() if dim is not None else w.clone()
            if pp > 1 and pp_rank == pp - 1 and not cfg.untie_embeddings_and_output_weights:
                sd["output_weight"] = shard(full["wte.weight"], 0, tp, tp_rank).clone()
            sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
            path = os.path.join(folder, sub, RANK_FILE)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            ckpt = {"model": sd, "args": dataclasses.asdict(args), "iteration": 0}
            durable.write_file(path, lambda f, ckpt=ckpt: torch.save(ckpt, f))
    durable.fsync_tree(folder)
    durable.replace_file(os.path.join(save, checkpointing.TRACKER), checkpointing.RELEASE.encode())
    return folder


def tokenizer_spec(
    args: PretrainArgs, vocab_file: str | None, merge_file: str | None
) -> TokenizerSpec | None:
    """The tokenizer: GPT-2's BPE from the files given, else the run's own ``--tokenizer-type`` if
    its files still exist, else None."""
    given = (vocab_file, merge_file)
    if any(given):
        if not all(given) or not all(os.path.exists(p) for p in given):
            raise ConversionError(
                f"--vocab-file {vocab_file} and --merge-file {merge_file}: give both, existing"
            )
        return TokenizerSpec("GPT2BPETokenizer", vocab_file, merge_file)
    spec = TokenizerSpec.from_args(args)
    files = {"GPT2BPETokenizer": (spec.vocab_file, spec.merge_file), "NullTokenizer": ()}
    needed = files.get(spec.tokenizer_type, (spec.tokenizer_model,))
    return spec if all(p and os.path.exists(p) for p in needed) else None

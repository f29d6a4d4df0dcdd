"""How long to train and the learning-rate flags, as Megatron's ``validate_args`` checks them:
iteration-based (``--train-iters``, ``--lr-decay-iters``, ``--lr-warmup-iters``) or sample-based
(``--train-samples``, ``--lr-decay-samples``, ``--lr-warmup-samples``), never a mix; with samples,
``train_iters = train_samples // global batch`` (Megatron's conversion without a batch ramp).
``--decoupled-lr`` / ``--decoupled-min-lr`` checked against each other."""

from __future__ import annotations

from distlab.gpt.arguments.groups import PretrainArgs


def length_errors(args: PretrainArgs) -> list[str]:
    """Exactly one of --train-iters / --train-samples, and only the matching schedule flags."""
    if (args.train_iters is None) == (args.train_samples is None):
        given = "both were given" if args.train_iters is not None else "neither was given"
        return [f"give one of --train-iters (iterations) and --train-samples (samples): {given}"]
    errors = []
    if args.train_iters is not None:
        mixed = [f"--lr-decay-samples {args.lr_decay_samples}"] if args.lr_decay_samples is not None else []
        mixed += [f"--lr-warmup-samples {args.lr_warmup_samples}"] if args.lr_warmup_samples else []
        if mixed:
            errors.append(
                f"{' and '.join(mixed)} with --train-iters {args.train_iters}: an iteration-based run "
                f"schedules in iterations: use --lr-decay-iters / --lr-warmup-iters, or --train-samples"
            )
        return errors
    mixed = [f"--lr-decay-iters {args.lr_decay_iters}"] if args.lr_decay_iters is not None else []
    mixed += [f"--lr-warmup-iters {args.lr_warmup_iters}"] if args.lr_warmup_iters else []
    if mixed:
        errors.append(
            f"{' and '.join(mixed)} with --train-samples {args.train_samples}: a sample-based run "
            f"schedules in samples: use --lr-decay-samples / --lr-warmup-samples, or --train-iters"
        )
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        errors.append(
            f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-samples "
            f"{args.lr_warmup_samples} were both given: choose one"
        )
    for name in ("train_samples", "lr_decay_samples", "lr_warmup_samples"):
        if (getattr(args, name) or 0) < 0 or (name == "train_samples" and args.train_samples == 0):
            errors.append(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    return errors


def train_iters_from_samples(args: PretrainArgs, global_batch_size: int, ramp: bool) -> int:
    """Megatron's ``train_iters = train_samples // global_batch_size``; refused with a batch ramp
    (Megatron counts the ramp's iterations one by one: not built here)."""
    if ramp:
        raise ValueError(
            f"--train-samples {args.train_samples} with a batch-size ramp: this engine converts samples "
            f"to iterations at one global batch only; use --train-iters"
        )
    iters = args.train_samples // global_batch_size
    if iters < 1:
        raise ValueError(
            f"--train-samples {args.train_samples} is less than one global batch of {global_batch_size}: "
            f"give at least {global_batch_size}"
        )
    return iters


def decoupled_lr_errors(args: PretrainArgs) -> list[str]:
    """--decoupled-min-lr needs --decoupled-lr and stays below it."""
    if args.decoupled_lr is None:
        if args.decoupled_min_lr is not None:
            return [
                f"--decoupled-min-lr {args.decoupled_min_lr} was given without --decoupled-lr: the "
                f"embedding and output layer follow --lr / --min-lr then; add --decoupled-lr or drop it"
            ]
        return []
    if args.decoupled_lr < 0:
        return [f"--decoupled-lr {args.decoupled_lr} must be >= 0"]
    if args.decoupled_min_lr is not None and args.decoupled_min_lr > args.decoupled_lr:
        return [f"--decoupled-min-lr {args.decoupled_min_lr} is above --decoupled-lr {args.decoupled_lr}"]
    return []


def evaluations_during_training(args: PretrainArgs) -> int:
    """Validation runs before the end of training: one every ``--eval-interval`` iterations, none
    without it (Megatron's default); the run's last validation, at the end, comes on top."""
    return args.train_iters // args.eval_interval if args.eval_interval else 0

"""Every line the engine (``pretrain_gpt.py``) prints for the notebooks to read: one
:class:`LogLine` each, whose ``format`` prints it and whose ``parse`` reads it back.

The regular expression is derived from the ``str.format`` template, so a change of wording
changes printer and parser together::

    LogLine("rank ({tp:d}, {pp:d}): {n:,d}").format(tp=0, pp=1, n=185536)  ->  "rank (0, 1): 185,536"
    LogLine("rank ({tp:d}, {pp:d}): {n:,d}").parse("... rank (0, 1): 185,536")  ->  [{"tp": 0, "pp": 1, "n": 185536}]

Specs and what they read back: ``d`` (width, sign, ``,``) int; ``f`` and ``E`` (width, sign,
precision) float, NaN and infinity included; no spec: str, up to the text that follows it. The
module needs only the standard library: the engine prints with it, the notebooks' readers parse::

    BANNER         using world size: W, data-parallel-size: DP, tensor-model-parallel size: TP, ...
    CONTEXT_PARALLEL > context parallelism: cp ranks, sequence s in 2cp chunks of c tokens (how), s/cp tokens per rank, ring attention
    BATCH          > global batch size B = micro batch b x data-parallel DP x accumulation steps m
    VOCAB_PADDING  > padded vocab (size: V0) with k dummy tokens (new size: V)
    PARAMETERS      > number of parameters on (tensor, pipeline) model parallel rank (t, p): N
    MEMORY         [rank r tp t pp p dp d] memory (MiB): parameters ... | peak RSS M   (RANK_COORDS: " tp t pp p dp d")
    PREDICTION     > memory: predicted peak P MiB | measured M MiB (how above the B MiB before the model) | error +e%
    DEEPSPEED      > deepspeed: ZeRO stage z[, offload optimizer to cpu] | train_batch_size B = micro b x accumulation m ...
    ITERATION       iteration i/ n | consumed samples: ... | lm loss: ... | tokens per second: ... |
    VALIDATION      validation loss at LABEL | lm loss value: ... | lm loss PPL: ... |
    COMPILE        > torch.compile: first iteration F ms (tracing and code generation included) | steady state S ms per iteration (median of the n after it)
    SAVED            successfully saved checkpoint at iteration i to D in F format[ (async)] | blocking ... | total ...
    EXIT_SIGNAL    exiting program after receiving SIGUSR1 at iteration i
    HANG           > hang: a collective of iteration i waited T s (--distributed-timeout-minutes); no answer from ranks [r]
    STRAGGLER      > straggler: iteration i | MnRtt/Rnk: Tms/r | MxRtt/Rnk: Tms/r | MnEtpt/Rnk: FTF/r | MxEtpt/Rnk: FTF/r
    STRAGGLER_RANKS ^^^^ Bottom N Ranks with lowest  Etpt(TF): F/r, ...
    HANG_DUMPS     > hang: flight records for PyTorch's analyzer (torchfrtrace FOLDER) in DIR
    MOE             [moe] iteration i | layer l | load_balancing_loss: ... | dropped tokens: d | tokens per expert: c0 c1 ... |
    DRY_RUN        > dry run: rank r of N (fake process group, model on the meta device)   (and DRY_RUN_*:
                   its parameters, states, activations and collectives, ``planning/dry_run.py``)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from string import Formatter

_SPEC = re.compile(r"[+-]?(?P<width>\d*)(?P<comma>,?)(?:\.\d+)?(?P<kind>[dfE])")
_NUMBER = {
    "d": r"[+-]?\d+",
    ",d": r"[+-]?\d{1,3}(?:,\d{3})*",
    "f": r"[+-]?(?:\d+(?:\.\d*)?|nan|inf)",
    "E": r"[+-]?(?:\d(?:\.\d+)?E[+-]\d+|NAN|INF)",
}


def _int(text: str) -> int:
    return int(text.replace(",", ""))


class Opt(str):
    """A template part printed only when all its fields are given (not None); a parsed line may lack it."""


class LogLine:
    """One log line: ``format(**fields)`` prints it, ``parse(text)`` reads every such line back
    into dicts of the same fields (those of a missing :class:`Opt` part left out)."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts
        self.readers: dict[str, Callable[[str], object]] = {}
        self.regex = re.compile("".join(map(self._pattern, parts)))

    def _pattern(self, part: str) -> str:
        pattern = ""
        for literal, name, spec, _ in Formatter().parse(part):
            pattern += re.escape(literal) + ("" if name is None else self._field(name, spec))
        return f"(?:{pattern})?" if isinstance(part, Opt) else pattern

    def _field(self, name: str, spec: str) -> str:
        """The regex of one field; records how to read it back."""
        if not spec:
            self.readers[name] = str
            return f"(?P<{name}>.*?)"
        m = _SPEC.fullmatch(spec)
        if m is None or m["comma"] + m["kind"] not in _NUMBER:
            raise ValueError(f"{{{name}:{spec}}}: a LogLine reads back only d, ,d, f and E specs")
        self.readers[name] = _int if m["kind"] == "d" else float
        padding = " *" if m["width"] else ""
        return f"{padding}(?P<{name}>{_NUMBER[m['comma'] + m['kind']]})"

    def format(self, **fields: object) -> str:
        """The line, with the :class:`Opt` parts whose fields are all given."""
        unknown = fields.keys() - self.readers.keys()
        if unknown:
            raise TypeError(f"no field {sorted(unknown)} in this line (its fields: {list(self.readers)})")
        line = ""
        for part in self.parts:
            names = [name for _, name, _, _ in Formatter().parse(part) if name is not None]
            if not (isinstance(part, Opt) and any(fields.get(name) is None for name in names)):
                line += part.format(**fields)
        return line

    def parse(self, text: str) -> list[dict]:
        """Every occurrence in ``text``, as typed fields, in order."""
        return [self._read(m) for m in self.regex.finditer(text)]

    def search(self, text: str) -> dict | None:
        """The first occurrence in ``text`` (None when there is none)."""
        m = self.regex.search(text)
        return None if m is None else self._read(m)

    def _read(self, m: re.Match) -> dict:
        return {k: self.readers[k](v) for k, v in m.groupdict().items() if v is not None}


BANNER = LogLine(
    "using world size: {world_size:d}, data-parallel-size: {dp:d}, "
    "tensor-model-parallel size: {tp:d}, pipeline-model-parallel size: {pp:d}"
)
BATCH = LogLine(
    "> global batch size {global_batch:d} = micro batch {micro_batch:d} x data-parallel {dp:d} "
    "x accumulation steps {accumulation:d}"
)
VOCAB_PADDING = LogLine(
    "> padded vocab (size: {vocab_size:d}) with {dummy:d} dummy tokens (new size: {padded:d})"
)
PARAMETERS = LogLine(
    " > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank:d}, {pp_rank:d}): "
    "{parameters:d}"
)
#: A rank's coordinates, the ``coords`` of its MEMORY line ("" when there is no layout).
RANK_COORDS = LogLine(" tp {tp:d} pp {pp:d} dp {dp:d}")
#: The start-up line of a context-parallel run (``context_parallel.describe``), after the banner.
CONTEXT_PARALLEL = LogLine(
    "> context parallelism: {cp:d} ranks, sequence {seq_length:d} in {chunks:d} chunks of {chunk:d} tokens "
    "({how}), {per_rank:d} tokens per rank, ring attention"
)
#: One rank's memory report, in MiB; ``peak_kind``: "peak RSS" (CPU) or "CUDA max allocated".
MEMORY = LogLine(
    "[rank {rank:d}{coords}] memory (MiB): parameters {params_mib:.2f} ({values:,d} values) | "
    "gradients {grads_mib:.2f} | optimizer state {optim_mib:.2f} | {peak_kind} {peak_mib:.1f}"
)
#: Predicted and measured peak above ``baseline`` (MiB), ``error`` = 100 (measured - predicted) / predicted.
PREDICTION = LogLine(
    "> memory: predicted peak {predicted:.1f} MiB | measured {measured:.1f} MiB ({how}",
    Opt(" above the {baseline:.0f} MiB before the model"),
    ") | error {error:+.1f}%",
)
#: ``offload``: "optimizer", "param" or "optimizer and param".
DEEPSPEED = LogLine(
    "> deepspeed: ZeRO stage {stage:d}",
    Opt(", offload {offload} to cpu"),
    " | train_batch_size {train_batch_size:d} = micro {micro_batch:d} x accumulation {accumulation:d} "
    "x world size",
)
#: Megatron's training line (averages over the log interval), then this engine's throughput.
ITERATION = LogLine(
    " iteration {it:8d}/{total:8d} | consumed samples: {samples:12d} |"
    " elapsed time per iteration (ms): {ms:.1f} |",
    Opt(" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"),  # --log-throughput
    " learning rate: {lr:.3E} | global batch size: {gbs:5d} | lm loss: {loss:.6E} | loss scale: {scale:.1f} |",
    Opt(" grad norm: {gnorm:.3f} |"),
    " number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |",
    Opt(" tokens per second: {tokens_per_s:.1f} | TFLOP/s per device: {tflops:.3f} |"),
    Opt(" MFU: {mfu_percent:.1f}% |"),
)
#: The body of Megatron's boxed validation report.
VALIDATION = LogLine(" validation loss at {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | ")
#: The end of a --torch-compile run (``torch_compile.timing_line``): the first iteration's time
#: (it compiles) and the median of the others, from the iteration lines' elapsed times.
COMPILE = LogLine(
    "> torch.compile: first iteration {first_ms:.1f} ms (tracing and code generation included) | "
    "steady state {steady_ms:.1f} ms per iteration (median of the {n:d} after it)"
)
#: One MoE layer's routing in a logged iteration (all micro-batches and data-parallel ranks):
#: Megatron's load_balancing_loss (E sum_i f_i P_i, without its coefficient; 1 when balanced),
#: the (token, expert) pairs over capacity, and ``counts``: tokens per expert, space-separated.
MOE = LogLine(
    " [moe] iteration {it:d} | layer {layer:d} | load_balancing_loss: {aux:.6f} |"
    " dropped tokens: {dropped:d} | tokens per expert: {counts} |"
)


def tokens_per_expert(text: str) -> list[dict]:
    """Every :data:`MOE` line of a log, with ``counts`` as a list of ints."""
    return [{**f, "counts": [int(c) for c in f["counts"].split()]} for f in MOE.parse(text)]


# --- checkpoints and faults (distlab.gpt.checkpointing.checkpointer, distlab.gpt.training.fault_handling) ---
#: The save line of either format; ``blocking_ms == total_ms`` unless ``mode`` is "async".
SAVED = LogLine(
    "  successfully saved checkpoint at iteration {iteration:7d} to {folder} in {format} format",
    Opt(" ({mode})"),
    " | blocking {blocking_ms:.1f} ms | total {total_ms:.1f} ms",
)
#: After the save on --exit-signal, rank 0: ``exiting program after receiving SIGUSR1 at iteration 7``.
EXIT_SIGNAL = LogLine("exiting program after receiving {signal} at iteration {iteration:d}")
#: Every surviving rank, after a collective timed out: ``> hang: a collective of iteration 8 waited
#: 6.0 s ...``; the ranks are those that wrote no flight record (``distlab.flight_recorder``).
HANG = LogLine(
    "> hang: a collective of iteration {iteration:d} waited {timeout_s:.1f} s "
    "(--distributed-timeout-minutes); no answer from ranks [{ranks}]"
)
#: Rank 0, every --log-interval with --log-straggler (Megatron's StragglerDetector line, the
#: throughput in E notation: a CPU rank's TFLOP/s are 1e-4).
STRAGGLER = LogLine(
    "> straggler: iteration {iteration:d} | MnRtt/Rnk: {min_ms:.2f}ms/{min_rank:d} | MxRtt/Rnk: {max_ms:.2f}ms/{max_rank:d}"
    " | MnEtpt/Rnk: {min_tf:.3E}TF/{min_tf_rank:d} | MxEtpt/Rnk: {max_tf:.3E}TF/{max_tf_rank:d}"
)
#: With --straggler-minmax-count N > 1, after STRAGGLER: the N lowest (Bottom) and highest (Top).
STRAGGLER_RANKS = LogLine("^^^^ {which} {n:d} Ranks with {how} Etpt(TF): {pairs}")
#: After HANG's line and the report's: where the dumps are, and PyTorch's analyzer on them.
HANG_DUMPS = LogLine("> hang: flight records for PyTorch's analyzer (torchfrtrace FOLDER) in {folder}")


# --- dry runs (distlab.gpt.planning.dry_run, ``pretrain_gpt.py --dry-run-world-size N``) ---
DRY_RUN = LogLine("> dry run: rank {rank:d} of {world_size:d} (fake process group, model on the meta device)")
DRY_RUN_PARAMETERS = LogLine("> parameters on this rank: {parameters:,d} ({precision})")
#: The model states and the predicted peak of the rank, GiB; ``how``: "without" or "with".
DRY_RUN_STATES = LogLine(
    ">   {params_gib:10.2f} {grads_gib:10.2f} {optim_gib:10.2f} {total_gib:7.2f} {peak_gib:8.2f}"
    "   {how} distributed optimizer"
)
DRY_RUN_ACTIVATIONS = LogLine(
    "> activations (estimator, {micro_batches:d} micro-batches): {activations_gib:.2f} GiB"
)
#: One kind of call of one step: ``count`` calls of ``op`` over ``group`` (``size`` ranks), GiB each
#: (the whole buffer, nccl-tests' size) and in all.
DRY_RUN_COLLECTIVE = LogLine(
    ">   collective  {group} {size:4d}  {op} {gib_per_call:12.6f} {count:7d} {gib:12.4f}"
)

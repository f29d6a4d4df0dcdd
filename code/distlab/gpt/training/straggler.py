"""Megatron's ``--log-straggler``: which ranks are slow, by their own time and achieved TFLOP/s.

Synchronous training runs at the pace of its slowest rank: the others wait for it in the next
collective, so every rank's *iteration* time is the same and says nothing. What differs is the time
each rank spends in its own forward and backward (``Rtt``, the round-trip time of the timed work in
Megatron-LM's ``StragglerDetector``), and from it each rank's estimated throughput::

    Rtt_r  = (forward-backward ms of rank r, summed over the interval) / log_interval
    Etpt_r = (model FLOPs per iteration, all ranks) / (Rtt_r x 1e9 x world) / amp      [TFLOP/s]

Megatron times the forward step only and divides by amp = 3 (the backward is about twice the
forward); the engine times forward and backward together, so amp = 1 here. Every
``--log-interval`` iterations every rank sends its (Rtt, Etpt) to rank 0 (``gather_object``),
which prints the ranks of the minimum and maximum (:data:`STRAGGLER`) and, with
``--straggler-minmax-count N`` (1 < N < world), the N lowest and N highest ``Etpt/rank`` pairs.

On a CUDA device every rank also reads its GPU's power (W), temperature (C), SM clock (MHz) and
utilisation (%) at the report (``torch.cuda.power_draw``, ``temperature``, ``clock_rate``,
``utilization``, which need ``pynvml``), and the line adds their min/max and ranks in Megatron's
order (``MnPwr/Rnk`` ... ``MxClk/Rnk``, between ``MxRtt/Rnk`` and ``MnEtpt/Rnk``). Megatron prints
``power_draw``'s milliwatts with the unit W; the engine divides by 1000. On the CPU, or without
``pynvml``, nothing is read and the line is unchanged (:func:`gpu_health` returns None).

``--disable-straggler-on-startup`` starts with collection off; as in Megatron, rank 0 listens on
``--straggler-ctrlr-port`` (HTTP: ``curl rank0-host:PORT``) and each request toggles collection at
the next report (rank 0 broadcasts the state: every rank switches at the same iteration).
"""

from __future__ import annotations

import socket
import threading

import torch
import torch.distributed as dist

from distlab.log_line import LogLine, Opt

#: Rank 0, every --log-interval with --log-straggler (Megatron's StragglerDetector line, the
#: throughput in E notation: a CPU rank's TFLOP/s are 1e-4).
STRAGGLER = LogLine(
    "> straggler: iteration {iteration:d} | MnRtt/Rnk: {min_ms:.2f}ms/{min_rank:d} | MxRtt/Rnk: {max_ms:.2f}ms/{max_rank:d}",
    Opt(
        " | MnPwr/Rnk: {min_w:.2f}W/{min_w_rank:d} | MxPwr/Rnk: {max_w:.2f}W/{max_w_rank:d}"
        " | MnTmp/Rnk: {min_c:.2f}C/{min_c_rank:d} | MxTmp/Rnk: {max_c:.2f}C/{max_c_rank:d}"
        " | MnUtl/Rnk: {min_util:.2f}%/{min_util_rank:d} | MxUtl/Rnk: {max_util:.2f}%/{max_util_rank:d}"
        " | MnClk/Rnk: {min_mhz:.2f}MHz/{min_mhz_rank:d} | MxClk/Rnk: {max_mhz:.2f}MHz/{max_mhz_rank:d}"
    ),
    " | MnEtpt/Rnk: {min_tf:.3E}TF/{min_tf_rank:d} | MxEtpt/Rnk: {max_tf:.3E}TF/{max_tf_rank:d}",
)
#: The GPU readings of the line (on CUDA only): field prefix -> key of :func:`gpu_health`'s dict.
HEALTH = {"w": "power_w", "c": "temperature_c", "util": "utilization_pct", "mhz": "clock_mhz"}
#: With --straggler-minmax-count N > 1, after STRAGGLER: the N lowest (Bottom) and highest (Top).
STRAGGLER_RANKS = LogLine("^^^^ {which} {n:d} Ranks with {how} Etpt(TF): {pairs}")

#: Megatron divides by 3 because it times the forward only; the engine times forward + backward.
AMP = 1.0


def gpu_health(device: torch.device) -> dict | None:
    """This rank's GPU power (W), temperature (C), SM clock (MHz) and utilisation (%) now, as
    Megatron's StragglerDetector reads them at a report; None on the CPU, without CUDA, or when
    the readings fail (``pynvml`` not installed, a driver that does not report them)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return {
            "power_w": torch.cuda.power_draw(device) / 1000,  # milliwatts
            "temperature_c": float(torch.cuda.temperature(device)),
            "utilization_pct": float(torch.cuda.utilization(device)),
            "clock_mhz": float(torch.cuda.clock_rate(device)),
        }
    except Exception:  # ModuleNotFoundError (no pynvml), pynvml.NVMLError, RuntimeError
        return None


def format_report(iteration: int, gathered: list[tuple], minmax_count: int) -> list[str]:
    """Rank 0's lines from every rank's ``(Rtt ms, Etpt TF/s, rank, health)`` (health: a
    :func:`gpu_health` dict or None): :data:`STRAGGLER`, with the GPU readings only when every rank
    has them, then with 1 < ``minmax_count`` < world the Bottom and Top lines."""
    by_time = sorted(gathered, key=lambda x: (x[0], x[2]))
    by_tflops = sorted(gathered, key=lambda x: (x[1], x[2]))
    (min_ms, _, min_rank, _), (max_ms, _, max_rank, _) = by_time[0], by_time[-1]
    (_, low_tf, low_rank, _), (_, high_tf, high_rank, _) = by_tflops[0], by_tflops[-1]
    fields = dict(
        iteration=iteration, min_ms=min_ms, min_rank=min_rank, max_ms=max_ms, max_rank=max_rank,
        min_tf=low_tf, min_tf_rank=low_rank, max_tf=high_tf, max_tf_rank=high_rank,
    )  # fmt: skip
    if all(health is not None for *_, health in gathered):
        by_rank = sorted(gathered, key=lambda x: x[2])
        for prefix, key in HEALTH.items():  # min() and max() as Megatron's: ties go to the lower rank
            low, high = (pick(by_rank, key=lambda x: x[3][key]) for pick in (min, max))  # noqa: B023
            fields[f"min_{prefix}"], fields[f"min_{prefix}_rank"] = low[3][key], low[2]
            fields[f"max_{prefix}"], fields[f"max_{prefix}_rank"] = high[3][key], high[2]
    lines = [STRAGGLER.format(**fields)]
    n, world = minmax_count, len(gathered)
    if 1 < n < world:
        pairs = lambda part: " ".join(f"{x[1]:.3E}/{x[2]}," for x in part)  # noqa: E731
        lines.append(STRAGGLER_RANKS.format(which="Bottom", n=n, how="lowest ", pairs=pairs(by_tflops[:n])))
        lines.append(STRAGGLER_RANKS.format(which="Top   ", n=n, how="highest", pairs=pairs(by_tflops[-n:])))
    return lines


class StragglerDetector:
    """Per-rank forward-backward time and throughput, min/max over the ranks every log interval."""

    def __init__(
        self, world: int, rank: int, minmax_count: int, enabled: bool, port: int, device: torch.device
    ) -> None:
        self.world, self.rank, self.minmax_count, self.device = world, rank, minmax_count, device
        self.off, self.toggle = not enabled, False
        self.elapsed_ms, self.iterations = 0.0, 0
        self.sock = None
        if rank == 0:
            self._listen(port)

    def _listen(self, port: int) -> None:
        """Rank 0: a thread that answers HTTP requests on ``port`` and asks for a toggle."""
        try:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("0.0.0.0", port))
            self.sock.listen(8)
        except OSError as exc:
            print(
                f"> straggler: cannot listen on --straggler-ctrlr-port {port} ({exc}); no toggling",
                flush=True,
            )
            self.sock = None
            return
        threading.Thread(target=self._serve, name="straggler-controller", daemon=True).start()

    def _serve(self) -> None:
        while self.sock is not None:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                self.toggle = True
                msg = f"StragglerDetector turns {'ON' if self.off else 'OFF'} at the next log interval"
                conn.sendall(
                    f"HTTP/1.0 200 OK\r\nConnection: Close\r\nContent-length: {len(msg)}\r\n\r\n{msg}".encode()
                )

    def record(self, forward_backward_ms: float) -> None:
        """One iteration's forward-backward time on this rank (ignored while off)."""
        if not self.off:
            self.elapsed_ms += forward_backward_ms
            self.iterations += 1

    def report(self, iteration: int, flops_per_iteration: float) -> list[str]:
        """Collective (every rank, every log interval): rank 0 gets the lines, the others []. Then
        rank 0's toggle reaches every rank (a broadcast)."""
        lines = []
        if not self.off and self.iterations:
            rtt = self.elapsed_ms / self.iterations
            etpt = flops_per_iteration / (rtt * 1e9 * self.world) / AMP
            lines = self._min_max(iteration, rtt, etpt)
        self.elapsed_ms, self.iterations = 0.0, 0
        self._check_toggle()
        return lines

    def _min_max(self, iteration: int, rtt: float, etpt: float) -> list[str]:
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object((rtt, etpt, self.rank, gpu_health(self.device)), gathered, dst=0)
        if self.rank != 0:
            return []
        return format_report(iteration, gathered, self.minmax_count)

    def _check_toggle(self) -> None:
        off = torch.tensor(
            [self.off != (self.rank == 0 and self.toggle)], dtype=torch.uint8, device=self.device
        )
        dist.broadcast(off, 0)
        self.toggle = False
        now_off = bool(off.item())
        if now_off != self.off and self.rank == 0:
            print(f"> straggler: StragglerDetector turned {'OFF' if now_off else 'ON'}", flush=True)
        self.off = now_off

    def close(self) -> None:
        if self.sock is not None:
            sock, self.sock = self.sock, None
            sock.close()


__all__ = ["AMP", "HEALTH", "StragglerDetector", "format_report", "gpu_health"]

"""NCCL's connection lines (``NCCL_DEBUG=INFO``) as a table of transports per node pair.

When a communicator connects its rings and trees, every rank logs one line per channel and peer::

    node1:4242:4290 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
    node1:4242:4290 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
    node2:5151:5199 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/Socket/0

``host:pid:tid [device]`` says who printed it, ``r[d]`` is a rank of the communicator and its
device. The transport tells where the bytes go:

    P2P/IPC, P2P/CUMEM, P2P/direct pointer   GPU to GPU inside a node (NVLink or PCIe), then
                                            /read when the receiver reads, /CE with copy engines
    SHM                                     through host shared memory, inside a node
    NET/IB (IBext...), NET/Socket           through the network: between nodes, then the NIC's
                                            index and /GDRDMA with GPUDirect RDMA

The printer is the sending rank, except on ``[receive]`` lines, where it is the receiver; the
peer's host is known when the peer printed lines of its own.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

CHANNEL_RE = re.compile(
    r"^(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL INFO Channel "
    r"(?P<channel>\d+)(?:/(?P<sub>\d+))? : (?P<src>\d+)\[\w+\] -> (?P<dst>\d+)\[\w+\]"
    r"(?: \[(?P<dir>send|receive)\])? via (?P<via>\S+(?: pointer)?\S*)"
)
INTRA = ("P2P", "SHM")
INTER = ("NET", "COLLNET")


@dataclass(frozen=True)
class Channel:
    """One connection line: ranks ``src -> dst`` over ``transport`` (e.g. 'P2P/CUMEM', 'NET/IB')."""

    host: str
    src: int
    dst: int
    direction: str  # "send", "receive" or "" (P2P and SHM lines)
    via: str  # what NCCL printed after "via"

    @property
    def transport(self) -> str:
        """Kind and mechanism: 'P2P/IPC', 'P2P/CUMEM', 'SHM', 'NET/IB', 'NET/Socket' (:func:`transport_of`)."""
        return transport_of(self.via)

    @property
    def scope(self) -> str:
        kind = self.via.split("/")[0]
        return "intra-node" if kind in INTRA else "inter-node" if kind in INTER else "unknown"

    @property
    def printer(self) -> int:
        return self.dst if self.direction == "receive" else self.src

    @property
    def peer(self) -> int:
        return self.src if self.direction == "receive" else self.dst


def transport_of(via: str) -> str:
    """The transport's kind and mechanism in what NCCL prints after "via", without the details
    that follow them: 'P2P/CUMEM/read' and 'P2P/IPC/read/CE' (the receiver reads; copy engines)
    give 'P2P/CUMEM' and 'P2P/IPC'; 'NET/IB/0/GDRDMA' (NIC 0, GPUDirect RDMA) and
    'NET/IBext_v8/1' give 'NET/IB'; 'NET/Socket/0' gives 'NET/Socket'; 'SHM/direct/direct' 'SHM'."""
    parts = via.strip().split("/")
    if parts[0] == "NET" and len(parts) > 1 and parts[1].startswith("IB"):
        return "NET/IB"  # IB, IBext_v8, ...: all InfiniBand / RoCE verbs
    return "/".join(parts[:2]) if parts[0] in ("P2P", "NET") else parts[0]


def parse_channels(text: str) -> list[Channel]:
    """Every ``NCCL INFO Channel ... via ...`` line of a log (other lines are ignored)."""
    out = []
    for line in text.splitlines():
        m = CHANNEL_RE.match(line.strip())
        if m:
            out.append(Channel(m["host"], int(m["src"]), int(m["dst"]), m["dir"] or "", m["via"]))
    return out


def transport_table(channels: list[Channel]) -> list[dict]:
    """Rows ``{hosts, scope, transport, connections}``, one per node pair and transport.

    ``hosts`` is ``"a <-> b"`` (``"a"`` inside node a). The peer's node comes from the lines it
    printed itself; a network peer that printed nothing shows as ``"(other node)"``.
    """
    host_of: dict[int, str] = {}
    for c in channels:
        host_of.setdefault(c.printer, c.host)
    counts: Counter = Counter()
    for c in channels:
        if c.scope == "intra-node":
            hosts = c.host
        else:
            peer = host_of.get(c.peer, "(other node)")
            peer = "(other node)" if peer == c.host else peer
            hosts = " <-> ".join(sorted([c.host, peer]))
        counts[(hosts, c.scope, c.transport)] += 1
    return [
        {"hosts": h, "scope": s, "transport": t, "connections": n} for (h, s, t), n in sorted(counts.items())
    ]


def format_table(rows: list[dict]) -> str:
    """The rows as text; says so when the log held no NCCL lines."""
    if not rows:
        return "no 'NCCL INFO Channel ... via ...' lines (NCCL_DEBUG=INFO unset, or no NCCL in this run)"
    head = f"{'nodes':<24}{'scope':<12}{'transport':<14}{'connections':>11}"
    lines = [head, "-" * len(head)]
    lines += [f"{r['hosts']:<24}{r['scope']:<12}{r['transport']:<14}{r['connections']:>11}" for r in rows]
    return "\n".join(lines)

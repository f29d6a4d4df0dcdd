"""The NCCL transport table, on lines in the format NCCL prints with NCCL_DEBUG=INFO.

Two nodes x 2 GPUs: inside each node P2P (CUMEM, IPC, direct pointer) or SHM, between the nodes
NET/IB or NET/Socket, with the [send] / [receive] tags NCCL puts on network lines. The other
INFO lines around them (init, rings, trees) must be ignored.
"""

from __future__ import annotations

from distlab.logs.nccl import format_table, parse_channels, transport_of, transport_table

TWO_NODES_IB = """\
gpu01:20775:20775 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to ib0
gpu01:20775:20832 [0] NCCL INFO ncclCommInitRank comm 0x55d0c0 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 7000 commId 0x9a3f - Init COMPLETE
gpu01:20775:20832 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu01:20776:20833 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
gpu01:20775:20832 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu01:20775:20832 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu02:3928:3989 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[1] via P2P/IPC
gpu02:3928:3989 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/IBext_v8/1/GDRDMA
gpu02:3929:3990 [1] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [send] via NET/IB/0(1)/GDRDMA
gpu02:3929:3990 [1] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
"""

SOCKET_AND_SHM = """\
nodeA:1896458:1896480 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct
nodeA:1896459:1896481 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0
nodeA:1896459:1896481 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via P2P/direct pointer/read
"""


def test_channels_are_parsed_with_printer_and_peer():
    chans = parse_channels(TWO_NODES_IB)
    assert len(chans) == 7
    recv = chans[2]
    assert (recv.host, recv.src, recv.dst, recv.direction, recv.printer, recv.peer) == (
        "gpu01",
        3,
        0,
        "receive",
        0,
        3,
    )
    assert [c.transport for c in chans[:3]] == ["P2P/CUMEM", "NET/IB", "NET/IB"]
    assert chans[5].transport == "NET/IB" and chans[4].transport == "P2P/IPC"
    assert {c.scope for c in chans if c.via.startswith("NET")} == {"inter-node"}


def test_table_per_node_pair_separates_inside_and_between_nodes():
    rows = transport_table(parse_channels(TWO_NODES_IB))
    assert rows == [
        {"hosts": "gpu01", "scope": "intra-node", "transport": "P2P/CUMEM", "connections": 2},
        {"hosts": "gpu01 <-> gpu02", "scope": "inter-node", "transport": "NET/IB", "connections": 4},
        {"hosts": "gpu02", "scope": "intra-node", "transport": "P2P/IPC", "connections": 1},
    ]
    assert "gpu01 <-> gpu02" in format_table(rows)


def test_socket_shm_and_an_unknown_peer_node():
    rows = transport_table(parse_channels(SOCKET_AND_SHM))
    assert rows == [
        {
            "hosts": "(other node) <-> nodeA",
            "scope": "inter-node",
            "transport": "NET/Socket",
            "connections": 1,
        },
        {"hosts": "nodeA", "scope": "intra-node", "transport": "P2P/direct pointer", "connections": 1},
        {"hosts": "nodeA", "scope": "intra-node", "transport": "SHM", "connections": 1},
    ]


def test_a_gloo_log_has_no_channels_and_says_so():
    gloo_log = "using world size: 4, data-parallel-size: 4, ...\n> launcher: torchrun, backend: gloo\n"
    assert parse_channels(gloo_log) == []
    assert "no 'NCCL INFO Channel" in format_table(transport_table([]))


def test_transport_of_what_nccl_prints_after_via():
    # NCCL's own strings (src/transport/p2p.cc, net.cc, shm.cc): the transport, then its details
    printed = {
        "P2P/CUMEM/read": "P2P/CUMEM",
        "P2P/CUMEM": "P2P/CUMEM",
        "P2P/IPC/read": "P2P/IPC",
        "P2P/IPC/CE": "P2P/IPC",
        "P2P/direct pointer/read": "P2P/direct pointer",
        "NET/IB/0/GDRDMA": "NET/IB",
        "NET/IB/0(1)/GDRDMA": "NET/IB",
        "NET/IBext_v8/1/GDRDMA": "NET/IB",
        "NET/Socket/0": "NET/Socket",
        "SHM/direct/direct": "SHM",
        " NET/IB ": "NET/IB",
    }
    assert {via: transport_of(via) for via in printed} == printed
    assert transport_of("P2P/NVL") == "P2P/NVL"  # not NCCL's: no transport of that name

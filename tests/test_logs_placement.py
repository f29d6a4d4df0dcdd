"""Which node holds which rank: from ``srun --label hostname`` (one task per rank) and from the
line each torchrun worker prints itself (``python -m distlab.logs.placement``).

torchrun numbers its ranks by the rendezvous, not by Slurm's task ids: the line must come from
the rank. A real ``torchrun --standalone`` with 2 workers runs a script through the module and
each worker's line carries its own RANK, the script its arguments.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from distlab.logs import placement


def test_hosts_from_srun_labels_and_from_the_ranks_own_lines():
    text = "\n".join(
        [
            "0: node1",
            "1: node2",  # srun --label hostname with one task per node: task ids, not ranks
            "> rank 0 on node2 (torchrun node rank 0, local rank 0)",
            "> rank 1 on node2 (torchrun node rank 0, local rank 1)",
            "> rank 2 on node1 (torchrun node rank 1, local rank 0)",
            "> rank 3 on node1: NCCL_DEBUG=WARN NCCL_IB_DISABLE=1",  # the engine's settings line
        ]
    )
    assert placement.rank_hosts(text) == {0: "node2", 1: "node2", 2: "node1", 3: "node1"}
    # a line written between another process's text and its newline is still read
    spliced = "iteration 1 | loss 8.1> rank 2 on node1 (torchrun node rank 1, local rank 0)\n\n"
    assert placement.rank_hosts(spliced) == {2: "node1"}
    assert placement.rank_hosts("0: node1\n1: node1\n2: node2\n") == {0: "node1", 1: "node1", 2: "node2"}


def test_the_line_is_the_workers_own():
    env = {"RANK": "3", "GROUP_RANK": "1", "LOCAL_RANK": "1"}
    line = placement.rank_host_line(env)
    assert line == f"> rank 3 on {socket.gethostname()} (torchrun node rank 1, local rank 1)"
    assert placement.rank_hosts(line) == {3: socket.gethostname()}


@pytest.mark.timeout(120)
def test_torchrun_workers_print_their_rank_then_run_the_script(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(f'script rank {os.environ[\"RANK\"]} argv {sys.argv[1:]}')\n")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "distlab.logs.placement", str(script), "--seed", "7"],
        capture_output=True, text=True, timeout=100, check=True,
    ).stdout  # fmt: skip
    host = socket.gethostname()
    assert placement.rank_hosts(out) == {0: host, 1: host}
    assert sorted(line for line in out.splitlines() if line.startswith("script")) == [
        "script rank 0 argv ['--seed', '7']",
        "script rank 1 argv ['--seed', '7']",
    ]


def test_without_a_script_it_says_how_to_call_it():
    with pytest.raises(SystemExit, match="usage: python -m distlab.logs.placement SCRIPT"):
        placement.main([])

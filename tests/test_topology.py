"""Topology parsing on a typical ``nvidia-smi topo -m`` table, and collection on this node."""

from distlab.topology import (
    EXAMPLE_TOPO as TOPO,
)
from distlab.topology import (
    collect,
    compare,
    format_table,
    matrix_rows,
    parse_topo_affinity,
    parse_topo_matrix,
)


def test_matrix_is_parsed_row_by_column():
    m = parse_topo_matrix(TOPO)
    assert list(m) == ["GPU0", "GPU1", "GPU2", "GPU3", "NIC0"]
    assert m["GPU0"]["GPU1"] == "NV4" and m["GPU1"]["GPU2"] == "SYS"
    assert m["GPU2"]["GPU2"] == "X" and m["NIC0"]["GPU1"] == "PXB"
    assert all(m[a][b] == m[b][a] for a in m for b in m)  # links are symmetric


def test_affinity_columns():
    aff = parse_topo_affinity(TOPO)
    assert aff["GPU0"] == {"cpu_affinity": "0-31", "numa_affinity": "0"}
    assert aff["GPU3"] == {"cpu_affinity": "32-63", "numa_affinity": "1"}


def test_no_gpu_gives_empty_tables():
    assert parse_topo_matrix("") == {} and parse_topo_affinity("NVIDIA-SMI has failed") == {}


def test_collect_on_this_node_and_compare():
    report = collect()
    assert int(report["cpu"]["CPU(s)"]) >= report["cpu"]["usable_cpus"] >= 1
    rows = compare([report, report])
    assert rows[0] == ("host", report["hostname"], report["hostname"])
    assert ("GPUs", str(len(report["gpus"])), str(len(report["gpus"]))) in rows


def test_tables_align():
    text = format_table(matrix_rows(parse_topo_matrix(TOPO)))
    lines = text.splitlines()
    assert lines[0].split() == ["GPU0", "GPU1", "GPU2", "GPU3", "NIC0"]
    assert lines[1].split() == ["GPU0", "X", "NV4", "SYS", "SYS", "PXB"]
    assert lines[1].index("NV4") == lines[0].index("GPU1")  # columns line up

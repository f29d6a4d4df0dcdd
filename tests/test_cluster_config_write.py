"""The cluster's configuration files are replaced atomically: an ``sbatch`` that reads
``slurm.conf`` while ``./lab cluster start`` runs again never finds it empty."""

from __future__ import annotations

import os
import threading

from distlab.cluster.daemons import write_atomically


def test_an_unchanged_file_is_left_alone(tmp_path):
    conf = tmp_path / "slurm.conf"
    write_atomically(conf, "ClusterName=lab\n", 0o600)
    before = os.stat(conf)
    write_atomically(conf, "ClusterName=lab\n", 0o644)
    after = os.stat(conf)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert after.st_mode & 0o777 == 0o644


def test_a_reader_never_sees_a_partial_file(tmp_path):
    conf = tmp_path / "slurm.conf"
    texts = ["A" * 200_000 + "\n", "B" * 300_000 + "\n"]
    write_atomically(conf, texts[0], 0o644)
    seen: set[int] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(len(conf.read_text()))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(200):
        write_atomically(conf, texts[i % 2], 0o644)
    stop.set()
    reader.join()
    assert seen <= {len(t) for t in texts}, sorted(seen - {len(t) for t in texts})[:5]
    assert not list(tmp_path.glob(".*.tmp"))

"""Job accounting of the local cluster: a private MariaDB server and ``slurmdbd``, on loopback.

slurmctld sends every job's record (state, times, exit code, and the MaxRSS that
``jobacct_gather`` samples in each step) to slurmdbd, which stores it in MariaDB; ``sacct``
reads it back. Both servers belong to this cluster alone::

    mysql/data/        MariaDB's files        mysql/mysqld.sock, mysqld.pid
    mysql/slurm.pass   the password of the database user ``slurm`` (random, made on first start)
    slurmdbd.conf      mode 600, as slurmdbd demands; it sits beside slurm.conf, where slurmdbd looks
    log/mariadb.log, log/slurmdbd.log

root logs into MariaDB through the socket (unix_socket authentication, no password); slurmdbd
logs in over TCP on 127.0.0.1 with the generated password. Nothing listens beyond loopback, and
other local users can neither read the password nor reach the socket (``mysql/`` is 0700).

Each learner is a Slurm user with an association to the account ``learners`` (:func:`add_user`),
so that ``sacct``, ``sacctmgr show assoc`` and ``sshare`` list their jobs under their own name and
account, as on a real cluster. Submitting needs no association (``AccountingStorageEnforce`` is
unset): any local user may submit, with an empty account until registered.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

from distlab.cluster.config import ClusterPaths
from distlab.cluster.process import ClusterError, alive, env, log_tail, port_busy, run, terminate, wait_for

DATABASE = "slurm_acct_db"
CLUSTER_NAME = "lab"
LEARNERS_ACCOUNT = "learners"


def _db_dir(p: ClusterPaths) -> Path:
    return p.root / "mysql"


def _db_socket(p: ClusterPaths) -> Path:
    return _db_dir(p) / "mysqld.sock"


def db_pid(p: ClusterPaths) -> Path:
    return _db_dir(p) / "mysqld.pid"


def dbd_pid(p: ClusterPaths) -> Path:
    return p.root / "slurmdbd.pid"


def _password(p: ClusterPaths) -> str:
    """The ``slurm`` database user's password: generated on first start, kept mode 600."""
    f = _db_dir(p) / "slurm.pass"
    if not f.exists():
        f.write_text(secrets.token_hex(16) + "\n")
    f.chmod(0o600)
    return f.read_text().strip()


def slurmdbd_conf(p: ClusterPaths, password: str) -> str:
    return f"""# Written by distlab.cluster on every start: edits here are overwritten.
AuthType=auth/munge
AuthInfo=socket={p.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={p.dbd_port}
SlurmUser=root
PidFile={dbd_pid(p)}
LogFile={p.log_dir}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={p.db_port}
StorageUser=slurm
StoragePass={password}
StorageLoc={DATABASE}
{"PrivateData=jobs,usage" if (p.root / "workshop").exists() else ""}
"""


def _sql(p: ClusterPaths, statements: str) -> None:
    cmd = ["mariadb", "--no-defaults", f"--socket={_db_socket(p)}", "-u", "root", "-e", statements]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise ClusterError(f"MariaDB refused the accounting setup: {out.stderr.strip()}")


def _start_mariadb(p: ClusterPaths) -> None:
    data, log = _db_dir(p) / "data", p.log_dir / "mariadb.log"
    if alive(db_pid(p), "mariadbd"):
        return
    if len(bytes(_db_socket(p))) > 107:  # the limit of a Unix socket's path
        raise ClusterError(f"path too long for a socket: {_db_socket(p)}; use a shorter LAB_CLUSTER_DIR")
    if not (data / "mysql").exists():  # first start: create the system tables
        data.mkdir(parents=True, exist_ok=True)
        init = ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root"]
        init += ["--auth-root-authentication-method=socket", "--skip-test-db", "--skip-name-resolve"]
        out = subprocess.run(init, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            log.write_text(out.stdout + out.stderr)
            raise ClusterError(f"mariadb-install-db failed ({out.returncode}); {log_tail(log)}")
    _db_socket(p).unlink(missing_ok=True)
    db_pid(p).unlink(missing_ok=True)
    server = ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root"]
    server += [f"--socket={_db_socket(p)}", f"--pid-file={db_pid(p)}", f"--log-error={log}"]
    server += [f"--port={p.db_port}", "--bind-address=127.0.0.1", "--skip-name-resolve"]
    server += ["--innodb-buffer-pool-size=32M", "--performance-schema=OFF", "--skip-log-bin"]
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(server, start_new_session=True, **quiet)

    def ready() -> bool:
        return bool(alive(db_pid(p), "mariadbd")) and _db_socket(p).exists()

    wait_for("MariaDB (job accounting)", ready, 60, log, server=proc)


def _cluster_registered(p: ClusterPaths) -> bool:
    out = run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], p, check=False)
    return CLUSTER_NAME in out.split()


def start(p: ClusterPaths) -> None:
    """Start MariaDB and slurmdbd (or check that they run) and register the cluster once."""
    _db_dir(p).mkdir(parents=True, exist_ok=True)
    _db_dir(p).chmod(0o700)
    password = _password(p)
    conf = p.root / "slurmdbd.conf"
    conf.touch(mode=0o600)
    conf.chmod(0o600)
    conf.write_text(slurmdbd_conf(p, password))
    _start_mariadb(p)
    _sql(
        p,
        f"CREATE DATABASE IF NOT EXISTS {DATABASE}; "
        f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
        f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
        f"GRANT ALL ON {DATABASE}.* TO 'slurm'@'127.0.0.1';",
    )
    if not alive(dbd_pid(p), "slurmdbd"):
        dbd_pid(p).unlink(missing_ok=True)
        subprocess.run(["slurmdbd"], env=env(p), check=True, timeout=30)
    log = p.log_dir / "slurmdbd.log"
    wait_for("slurmdbd", lambda: alive(dbd_pid(p), "slurmdbd") and port_busy(p.dbd_port), 60, log)
    if not _cluster_registered(p):
        run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], p)


def running(p: ClusterPaths) -> bool:
    return bool(alive(dbd_pid(p), "slurmdbd"))


def add_user(p: ClusterPaths, user: str, account: str = LEARNERS_ACCOUNT) -> bool:
    """Associate ``user`` with ``account`` in Slurm's accounting (both made if missing).

    Returns whether anything was added; a second call changes nothing."""
    added = False
    if not run(["sacctmgr", "-n", "-P", "show", "account", account, "format=account"], p).split():
        desc = ["Description=learners of the lab", "Organization=lab"]
        run(["sacctmgr", "-i", "add", "account", account, f"Cluster={CLUSTER_NAME}", *desc], p)
        added = True
    where = ["where", f"user={user}", f"account={account}"]
    if not run(["sacctmgr", "-n", "-P", "show", "assoc", *where, "format=user"], p).split():
        run(["sacctmgr", "-i", "add", "user", user, f"Account={account}", f"DefaultAccount={account}"], p)
        added = True
    return added


def remove_user(p: ClusterPaths, user: str) -> None:
    """Delete ``user`` and its associations from Slurm's accounting (its past jobs stay)."""
    if run(["sacctmgr", "-n", "-P", "show", "user", user, "format=user"], p).split():
        run(["sacctmgr", "-i", "delete", "user", "where", f"name={user}"], p)


def stop(p: ClusterPaths) -> None:
    terminate(dbd_pid(p), "slurmdbd")
    terminate(db_pid(p), "mariadbd", timeout=60)


def daemons(p: ClusterPaths) -> list[tuple[str, str, Path]]:
    """(label, command name, pid file) of the accounting daemons, for ``status``."""
    return [("mariadbd", "mariadbd", db_pid(p)), ("slurmdbd", "slurmdbd", dbd_pid(p))]

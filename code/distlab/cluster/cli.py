"""Command line of the local cluster: start, stop, restart, status, reset, add-user NAME."""

from __future__ import annotations

import argparse
import sys

from distlab.cluster import accounting, daemons, users


def add_user(name: str) -> str:
    """Make ``name`` a learner (see users.py); registered in accounting when slurmdbd runs."""
    p = daemons.local_paths()
    registered = accounting.running(p)
    learner = users.ensure(name, p if registered else None)
    if registered:
        acct = f"Slurm account {accounting.LEARNERS_ACCOUNT}"
    else:
        acct = "not in Slurm's accounting yet (run this again once the cluster runs)"
    return f"{learner.name} (uid {learner.uid}): workspace {learner.workspace}, {acct}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab cluster", description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "restart", "status", "reset", "add-user"])
    parser.add_argument("name", nargs="?", help="add-user: the account (made if missing) to prepare")
    args = parser.parse_args(argv)
    if (args.action == "add-user") != (args.name is not None):
        parser.error("add-user takes one user name, the other actions none")
    try:
        if args.action in ("stop", "restart"):
            print(daemons.stop())
        if args.action in ("start", "restart"):
            print(daemons.start())
        if args.action == "status":
            print(daemons.status())
        if args.action == "reset":
            print(daemons.reset())
        if args.action == "add-user":
            print(add_user(args.name))
    except daemons.ClusterError as e:
        print(f"lab cluster {args.action}: {e}", file=sys.stderr)
        return 1
    return 0

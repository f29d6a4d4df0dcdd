"""Command line of the local cluster: start, stop, restart, status, reset, add-user NAME,
test-workspace NAME (add-user, then prints the folder where ``./lab test`` runs NAME's notebooks)."""

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


def test_workspace(name: str) -> str:
    """As :func:`add_user`, then ``name``'s test workspace with the checkout's notebooks (users.py)."""
    p = daemons.local_paths()
    learner = users.ensure(name, p if accounting.running(p) else None)
    return str(users.prepare_workspace(learner, folder=users.TEST_WORKSPACE))


ACTIONS = ("start", "stop", "restart", "status", "reset")
USER_ACTIONS = ("add-user", "test-workspace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab cluster", description=__doc__)
    parser.add_argument("action", choices=[*ACTIONS, *USER_ACTIONS])
    parser.add_argument("name", nargs="?", help="add-user, test-workspace: the account (made if missing)")
    args = parser.parse_args(argv)
    if (args.action in USER_ACTIONS) != (args.name is not None):
        parser.error("add-user and test-workspace take one user name, the other actions none")
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
        if args.action == "test-workspace":
            print(test_workspace(args.name))
    except daemons.ClusterError as e:
        print(f"lab cluster {args.action}: {e}", file=sys.stderr)
        return 1
    return 0

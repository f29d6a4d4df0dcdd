"""Command line of the local cluster: start, stop, restart, status, reset."""

from __future__ import annotations

import argparse
import sys

from distlab.cluster import daemons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab cluster", description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "restart", "status", "reset"])
    args = parser.parse_args(argv)
    try:
        if args.action in ("stop", "restart"):
            print(daemons.stop())
        if args.action in ("start", "restart"):
            print(daemons.start())
        if args.action == "status":
            print(daemons.status())
        if args.action == "reset":
            print(daemons.reset())
    except daemons.ClusterError as e:
        print(f"lab cluster {args.action}: {e}", file=sys.stderr)
        return 1
    return 0

"""Write this node's topology (GPUs and their links, or CPUs / NUMA / caches) as JSON.

One task per node, all nodes of the allocation::

    srun --ntasks-per-node=1 python $LAB_CODE/topology_report.py --out jobs/topology

Locally, without Slurm::

    python code/topology_report.py --out runs/topology
"""

import argparse
import json
from pathlib import Path

from distlab.topology import collect


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for <hostname>.json")
    args = parser.parse_args()
    report = collect()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{report['hostname']}.json"
    path.write_text(json.dumps(report, indent=1))
    gpus = len(report["gpus"])
    print(
        f"{report['hostname']}: {gpus} GPU(s), {report['cpu'].get('CPU(s)')} CPUs, "
        f"{report['cpu'].get('NUMA node(s)')} NUMA node(s) -> {path}"
    )


if __name__ == "__main__":
    main()

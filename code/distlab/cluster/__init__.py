"""The local Slurm mini-cluster: two real ``slurmd`` nodes on loopback addresses.

``python -m distlab.cluster start|stop|restart|status|reset|add-user NAME`` (also ``./lab cluster
...``). Modules: ``config`` (files, ports, slurm.conf, who may read what), ``daemons``
(start/stop/status), ``accounting`` (slurmdbd + MariaDB, for ``sacct``), ``users`` (learner
accounts and workspaces), ``cgroups`` (memory limits), ``system_conf`` (/etc/slurm/slurm.conf),
``process`` (daemon helpers).
"""

from distlab.cluster.config import ClusterPaths, local_paths
from distlab.cluster.daemons import ClusterError, is_up, reset, start, status, stop

__all__ = ["ClusterError", "ClusterPaths", "is_up", "local_paths", "reset", "start", "status", "stop"]

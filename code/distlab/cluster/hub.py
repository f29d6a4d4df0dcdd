"""JupyterHub for a workshop: per-user login, each learner's JupyterLab run as that learner.

The hub (from PyPI, in its own environment ``.lab/hub/venv`` so that the course's ``.venv`` stays
as pinned) and its proxy (configurable-http-proxy, from npm, in ``.lab/hub/proxy``) are installed
by ``./lab workshop``. The hub runs as root on 127.0.0.1:

* ``PAMAuthenticator``: each learner logs in with their account's password (workshop.py sets one);
  only the workshop's accounts are allowed, and the instructor is the hub's admin;
* ``LocalProcessSpawner`` run as root: it starts ``jupyterhub-singleuser`` as the learner (uid,
  gid, groups), with umask 077, in ``~/distlab-course`` (their own notebooks), on 127.0.0.1;
* the kernel that opens the notebooks is the course's Python (``.venv``): the kernelspec
  ``python3`` in ``.lab/hub/share/jupyter`` (first on ``JUPYTER_PATH``) runs it, with the cluster's
  ``SLURM_CONF`` and the progress folder in the environment, so jobs go to the shared cluster;
* TensorBoard at ``/user/<name>/tensorboard/``, on the learner's ``runs/``: the hub's environment has
  jupyter-server-proxy, and ``.lab/hub/etc/jupyter/jupyter_server_config.py`` (on
  ``JUPYTER_CONFIG_PATH``) registers the course's entry (distlab.profiling.tensorboard_proxy), run
  by the course's Python, which has TensorBoard; started as the learner, on 127.0.0.1;
* JupyterLab's defaults for every learner (:func:`write_lab_settings`: no news pop-up) in the hub's
  environment, ``.lab/hub/venv/share/jupyter/lab/settings/overrides.json``.

State (sqlite database, cookie secret, log, pid) lives in ``.lab/hub/run``, root's alone (0700).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from distlab.cluster.config import ClusterPaths
from distlab.cluster.process import ClusterError, alive, log_tail, port_busy, wait_for
from distlab.cluster.users import CHECKOUT, WORKSPACE

HUB = Path(os.environ.get("LAB_HUB_DIR", CHECKOUT / ".lab" / "hub"))
COURSE_PYTHON = CHECKOUT / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Settings:
    port: int  # the proxy's public port; the hub's own API: port + 1, the proxy's API: port + 2
    learners: list[str]
    instructor: str
    cluster: ClusterPaths
    progress: Path
    passthrough: dict[str, str] = field(default_factory=dict)  # e.g. PYTHONPATH of a checkout


def run_dir() -> Path:
    """The hub's state (``LAB_HUB_RUN`` overrides, for a test's hub beside a running one)."""
    return Path(os.environ.get("LAB_HUB_RUN") or HUB / "run")


def log_file() -> Path:
    return run_dir() / "jupyterhub.log"


def pid_file() -> Path:
    return run_dir() / "jupyterhub.pid"


def ports(port: int) -> list[int]:
    return [port, port + 1, port + 2]


def running_port() -> int | None:
    """The public port of the hub running from :func:`run_dir`, if one runs."""
    conf = run_dir() / "jupyterhub_config.py"
    if not alive(pid_file(), "jupyterhub") or not conf.exists():
        return None
    found = re.search(r"^c\.JupyterHub\.port = (\d+)$", conf.read_text(), re.MULTILINE)
    return int(found.group(1)) if found else None


def check_ports(port: int) -> None:
    """Refuse ports that another program holds (the running hub's own are fine)."""
    mine = ports(running_port() or 0)
    busy = [q for q in ports(port) if q not in mine and port_busy(q)]
    if busy:
        raise ClusterError(
            f"port(s) {busy} in use by another program (the hub needs {port}, {port + 1} and {port + 2}; "
            f"see `ss -ltnp`): choose others with `--port <p>`"
        )


def kernelspec() -> Path:
    """The kernelspec ``python3`` that runs the course's Python (first on JUPYTER_PATH)."""
    folder = HUB / "share" / "jupyter"
    spec = folder / "kernels" / "python3" / "kernel.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(COURSE_PYTHON), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.write_text(json.dumps({"argv": argv, "display_name": "Python 3 (distlab)", "language": "python"}))
    for path in (spec, spec.parent, spec.parent.parent, folder):
        path.chmod(0o644 if path.is_file() else 0o755)
    return folder


#: Defaults for every user of a JupyterLab installation (a user's own settings still win): no
#: "Would you like to get notified about official Jupyter news?" pop-up on a learner's first screen
#: (JupyterLab asks while ``fetchNews`` is "none", its default), and so no request to the news feed.
LAB_SETTINGS = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}


def write_lab_settings(prefix: str | Path) -> Path:
    """Merge :data:`LAB_SETTINGS` into ``<prefix>/share/jupyter/lab/settings/overrides.json`` and
    return its path: where the JupyterLab installed in the environment ``prefix`` reads the
    defaults that override its plugins' (its app settings folder, ``<app_dir>/settings``; the app
    dir of a JupyterLab in a virtual environment is ``<venv>/share/jupyter/lab``). Other plugins'
    entries already there are kept; the file and its folders are readable by every user (mode 644 /
    755), since every learner's JupyterLab reads it. ``./lab up`` (``.venv``) and :func:`start`
    (the hub's ``venv``) call it before they start JupyterLab."""
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    current = json.loads(path.read_text()) if path.is_file() and path.read_text().strip() else {}
    wanted = {**current, **{plugin: {**current.get(plugin, {}), **v} for plugin, v in LAB_SETTINGS.items()}}
    if wanted != current or not path.is_file():  # unchanged: not written (a user who does not own it)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wanted, indent=2) + "\n")
        path.chmod(0o644)
        path.parent.chmod(0o755)
    return path


SERVER_CONFIG = """# Written by distlab.cluster.hub: TensorBoard in each learner's JupyterLab under the hub.
import sys

sys.path.insert(0, {code!r})  # distlab (not installed in the hub's environment): this process only
from distlab.profiling.tensorboard_proxy import setup_tensorboard  # noqa: E402

tensorboard = setup_tensorboard()  # on $LAB_ROOT/runs: the learner's workspace
tensorboard["command"][0] = {python!r}  # the course's Python has TensorBoard; the hub's has not
get_config().ServerProxy.servers = {{"tensorboard": tensorboard}}  # noqa: F821
"""


def server_config() -> Path:
    """The folder of the singleuser servers' ``jupyter_server_config.py`` (TensorBoard's entry)."""
    folder = HUB / "etc" / "jupyter"
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "jupyter_server_config.py"
    conf.write_text(SERVER_CONFIG.format(code=str(CHECKOUT / "code"), python=str(COURSE_PYTHON)))
    for path in (conf, folder, folder.parent):
        path.chmod(0o644 if path.is_file() else 0o755)
    return folder


def config(s: Settings) -> str:
    """jupyterhub_config.py for ``s`` (JupyterHub's configuration is Python by design)."""
    env = {
        "SLURM_CONF": str(s.cluster.conf),
        "LAB_CLUSTER_DIR": str(s.cluster.root),
        "LAB_CLUSTER_PORT": str(s.cluster.port_base),
        "LAB_SITE": "local",
        "LAB_PROGRESS_DIR": str(s.progress),
        "JUPYTER_PATH": str(kernelspec()),
        "JUPYTER_CONFIG_PATH": str(server_config()),
        "PATH": f"{COURSE_PYTHON.parent}:/usr/local/bin:/usr/bin:/bin",
        **s.passthrough,
    }
    singleuser = str(HUB / "venv" / "bin" / "jupyterhub-singleuser")
    proxy = str(HUB / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy")
    return f"""# Written by distlab.cluster.hub on every `./lab workshop`: edits here are overwritten.
c = get_config()  # noqa: F821
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {s.port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {s.port + 1}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{s.port + 2}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.JupyterHub.db_url = "sqlite:///{run_dir()}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{run_dir()}/cookie_secret"
c.JupyterHub.pid_file = "{pid_file()}"
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.open_sessions = False
c.Authenticator.allowed_users = {set(s.learners) | {s.instructor}!r}
c.Authenticator.admin_users = {{{s.instructor!r}}}
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = ["sh", "-c", 'umask 077; exec "$0" "$@"', {singleuser!r}]
c.Spawner.notebook_dir = "~/{WORKSPACE}"
c.Spawner.default_url = "/lab/tree/notebooks/00_start_here.ipynb"
c.Spawner.ip = "127.0.0.1"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.environment = {env!r}
c.Spawner.environment["LAB_ROOT"] = lambda spawner: spawner.user_env({{}})["HOME"] + "/{WORKSPACE}"
"""


def start(s: Settings, timeout: float = 120) -> str:
    """(Re)start the hub on ``s``; the hub's URL once it answers."""
    for tool in (
        HUB / "venv" / "bin" / "jupyterhub",
        HUB / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy",
    ):
        if not tool.exists():
            raise ClusterError(f"{tool} is missing: `sudo ./lab workshop` installs JupyterHub and its proxy")
    run_dir().mkdir(parents=True, exist_ok=True)
    run_dir().chmod(0o700)
    write_lab_settings(HUB / "venv")  # the learners' JupyterLab is the hub environment's
    conf = run_dir() / "jupyterhub_config.py"
    text = config(s)
    if running_port() is not None:
        if conf.read_text() == text:
            return f"http://127.0.0.1:{s.port}/ (already running)"
        stop()  # a new class: the hub restarts on the new configuration
    check_ports(s.port)
    conf.write_text(text)
    with open(log_file(), "ab") as log:
        proc = subprocess.Popen(
            [str(HUB / "venv" / "bin" / "jupyterhub"), "-f", str(conf)],
            cwd=run_dir(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **s.passthrough},
        )
    url = f"http://127.0.0.1:{s.port}/"
    wait_for("JupyterHub", lambda: answers(url + "hub/api"), timeout, log_file(), proc)
    return url


def answers(url: str) -> bool:
    """Whether the hub answers through its proxy (the proxy listens before it routes to the hub)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def stop(timeout: float = 60) -> str:
    """SIGTERM the hub: it stops every user's server and its proxy before it exits."""
    pid = alive(pid_file(), "jupyterhub")
    if not pid:
        return "JupyterHub: not running"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive(pid_file(), "jupyterhub"):
        time.sleep(0.5)
    if alive(pid_file(), "jupyterhub"):
        raise ClusterError(
            f"JupyterHub (pid {pid}) did not stop within {timeout:.0f} s; {log_tail(log_file())}"
        )
    return "JupyterHub stopped, with every learner's server"

"""TensorBoard served through JupyterLab: ``<jupyter url>/tensorboard/`` with JupyterLab's own token.

jupyter-server-proxy starts TensorBoard on first request, on a free port of 127.0.0.1 (never
another interface), and forwards only requests that JupyterLab has authenticated. The entry point
``jupyter_serverproxy_servers: tensorboard`` (pyproject.toml) registers :func:`setup_tensorboard`
wherever ``distlab`` is installed: on this machine and on a cluster's login node alike.

The logdir is the course's ``runs/`` folder, or ``$LAB_TENSORBOARD_DIR``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from distlab import REPO_ROOT

PATH = "tensorboard"
"""URL path under JupyterLab's base URL."""


def logdir() -> Path:
    """The folder TensorBoard reads: ``$LAB_TENSORBOARD_DIR`` or ``<repository>/runs``."""
    return Path(os.environ.get("LAB_TENSORBOARD_DIR") or REPO_ROOT / "runs").resolve()


def setup_tensorboard() -> dict:
    """jupyter-server-proxy's server entry: command, start-up timeout, launcher entry."""
    folder = logdir()
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(folder)]
    command += ["--host", "127.0.0.1", "--port", "{port}", "--load_fast", "false", "--reload_interval", "10"]
    return {
        "command": command,
        "timeout": 60,  # first start imports TensorFlow-free TensorBoard and its plugins: seconds
        "new_browser_tab": True,
        "launcher_entry": {"title": "TensorBoard", "path_info": f"{PATH}/"},
    }


def running_server() -> dict | None:
    """The JupyterLab server that serves this folder (or the only one running), else None."""
    try:
        from jupyter_server.serverapp import list_running_servers
    except ImportError:
        return None
    servers = list(list_running_servers())
    here = Path.cwd().resolve()
    for s in servers:
        root = Path(s.get("root_dir") or s.get("notebook_dir") or "/").resolve()
        if here == root or root in here.parents:
            return s
    return servers[0] if len(servers) == 1 else None


def link(server: dict | None = None, *, with_token: bool = False) -> str:
    """``<jupyter url>/tensorboard/``; with the token only where asked (``./lab up`` prints it)."""
    server = server if server is not None else running_server()
    if server is None:
        return ""
    url = server["url"].rstrip("/") + f"/{PATH}/"
    return url + (f"?token={server['token']}" if with_token and server.get("token") else "")


def show_link() -> None:
    """Print where TensorBoard is (a notebook cell calls this)."""
    url = link()
    if url:
        print(f"TensorBoard (runs in {logdir()}): {url}")
        print("It opens in this browser session, already logged in to JupyterLab; first start takes ~10 s.")
    else:
        print("No JupyterLab server found (this kernel runs outside JupyterLab, e.g. under nbmake).")
        print("Start one with `./lab up`, then open <jupyter url>/tensorboard/.")

"""TensorBoard behind JupyterLab: ``<jupyter url>/tensorboard/`` answers with JupyterLab's token,
refuses without it, lists the launcher entry, and TensorBoard listens on 127.0.0.1 only.

A private JupyterLab on a free port, with its own runtime and config folders, so that a JupyterLab
the course developer runs is neither seen nor disturbed.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

from distlab.local_ranks import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.mostly_waits]


def get(url: str, token: str | None = None, timeout: float = 90) -> tuple[int, str]:
    """(status, body) without following redirects (a refusal may be a redirect to /login)."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """(url, token, runs folder, process) of a JupyterLab started for this test only."""
    tmp = tmp_path_factory.mktemp("jupyter")
    runs = tmp / "runs"
    (runs / "tiny").mkdir(parents=True)
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(runs / "tiny")) as w:
        w.add_scalar("lm loss", 6.2, 1)
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "LAB_TENSORBOARD_DIR": str(runs), "JUPYTER_RUNTIME_DIR": str(tmp / "rt")}
    env |= {"JUPYTER_CONFIG_DIR": str(tmp / "cfg"), "JUPYTER_DATA_DIR": str(tmp / "data")}
    cmd = [sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1", f"--port={port}", "--no-browser"]
    cmd += ["--allow-root", f"--ServerApp.root_dir={tmp}", f"--IdentityProvider.token={token}"]
    log = open(tmp / "jupyter.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            assert proc.poll() is None, (tmp / "jupyter.log").read_text()[-3000:]
            try:
                if get(f"{url}/api/status", token, timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(
                "JupyterLab did not answer within 60 s:\n" + (tmp / "jupyter.log").read_text()[-3000:]
            )
        yield url, token, runs, proc
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.terminate()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_tensorboard_opens_with_the_token(jupyter):
    url, token, _, _ = jupyter
    status, body = get(f"{url}/tensorboard/", token)
    assert status == 200 and "<title>TensorBoard</title>" in body, (status, body[:500])
    status, body = get(f"{url}/tensorboard/data/runs", token)
    assert status == 200 and '"tiny"' in body, (status, body[:500])  # it reads the runs folder


def test_tensorboard_is_refused_without_the_token(jupyter):
    url, _, _, _ = jupyter
    get(f"{url}/tensorboard/", jupyter[1])  # TensorBoard is running: the refusal is JupyterLab's
    for path in ("/tensorboard/", "/tensorboard/data/runs"):
        status, body = get(url + path)
        assert status in (302, 403), (path, status)
        assert "TensorBoard" not in body and "tiny" not in body


def test_launcher_entry_and_loopback_only(jupyter):
    url, token, _, proc = jupyter
    status, body = get(f"{url}/server-proxy/servers-info", token)
    assert status == 200 and '"TensorBoard"' in body, body[:500]
    get(f"{url}/tensorboard/", token)
    boards = [
        p for p in psutil.Process(proc.pid).children(recursive=True) if "tensorboard" in " ".join(p.cmdline())
    ]
    assert boards, "jupyter-server-proxy started no TensorBoard"
    listening = [c.laddr for p in boards for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening


def test_link_names_the_proxy_path():
    from distlab.profiling.tensorboard_proxy import link

    server = {"url": "http://127.0.0.1:8888/", "token": "abc"}
    assert link(server) == "http://127.0.0.1:8888/tensorboard/"
    assert link(server, with_token=True) == "http://127.0.0.1:8888/tensorboard/?token=abc"

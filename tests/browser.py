"""A person at a browser: headless Chromium (Debian's) driven over its DevTools protocol.

:func:`log_in_and_open` types a learner's name and password into JupyterHub's login form, follows
the hub to their JupyterLab, waits until notebook 00 is rendered, and saves a screenshot. Only
``chromium`` and websocket-client (a Jupyter dependency of the course's environment) are needed.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import websocket

from distlab.local_ranks import free_port

CHROMIUM = shutil.which("chromium")


def _page_socket(port: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=5) as reply:
                return next(p for p in json.load(reply) if p["type"] == "page")["webSocketDebuggerUrl"]
        except (OSError, StopIteration) as e:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"Chromium's DevTools did not answer on port {port} within {timeout} s"
                ) from e
            time.sleep(0.5)


def log_in_and_open(base: str, user: str, password: str, screenshot: Path, timeout: float = 120) -> str:
    """Log in at ``base``/hub/login, wait for notebook 00 in JupyterLab; the page's final URL."""
    port = free_port()
    # Chromium's helper processes may still write the profile as it ends: a leftover there is no failure
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        chrome = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}"]
            + [
                "--remote-allow-origins=*",
                f"--user-data-dir={profile}",
                "--window-size=1280,900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its renderer and helper processes in one group, ended together
        )
        try:
            ws = websocket.create_connection(_page_socket(port, 30), timeout=30)
            ids = itertools.count(1)

            def call(method: str, **params) -> dict:
                i = next(ids)
                ws.send(json.dumps({"id": i, "method": method, "params": params}))
                while True:
                    msg = json.loads(ws.recv())
                    if msg.get("id") == i:
                        return msg.get("result", {})

            def js(expression: str):
                return call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get(
                    "value"
                )

            def until(expression: str, what: str) -> None:
                deadline = time.monotonic() + timeout
                while not js(expression):
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"{what} not shown within {timeout} s (at {js('location.href')})"
                        )
                    time.sleep(1)

            call("Page.navigate", url=f"{base}/hub/login")
            until("!!document.querySelector('#password_input')", "the login form")
            form = {"#username_input": user, "#password_input": password}
            js("".join(f"document.querySelector({k!r}).value = {v!r};" for k, v in form.items()))
            js("document.querySelector('#login_submit').click()")
            until(f"location.pathname.startsWith('/user/{user}/lab')", "JupyterLab")
            rendered = "document.querySelectorAll('.jp-Notebook .jp-Cell').length > 3"
            until(f"{rendered} && document.body.innerText.includes('Start here')", "notebook 00")
            time.sleep(2)  # let the fonts and the kernel's indicator settle
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot.write_bytes(base64.b64decode(call("Page.captureScreenshot", format="png")["data"]))
            return js("location.href")
        finally:
            os.killpg(chrome.pid, signal.SIGTERM)
            chrome.wait(10)

"""Workshop mode (issue 22): the class's size and ports checked before anything is made, the
progress view built from real check calls, and a class of two learners and an instructor served
by the real JupyterHub on a private cluster: logins with the printed passwords through the hub's
REST API, each JupyterLab running as its learner, a job submitted from a kernel as that learner.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from distlab import REPO_ROOT, progress
from distlab.checks import ExerciseError, check
from distlab.cluster import daemons, hub, users, workshop
from distlab.cluster.process import ClusterError
from tests import browser
from tests import test_cluster_users as users_test

shared = users_test.shared  # a folder of /tmp open to all
PLAN_NAMES = ("hubtest01", "hubtest02", "hubteach")
pytestmark = pytest.mark.mostly_waits


def test_a_class_that_does_not_fit_is_refused_with_the_numbers():
    with pytest.raises(ClusterError, match=r"12 learners do not fit.*23.5 GiB.*1.8 GiB.*at most 10 learners"):
        workshop.Plan(12).check(23.5, 2)
    for plan, words in (
        (workshop.Plan(0), "at least one learner"),
        (workshop.Plan(2, prefix="Class"), "'Class01' is not a valid user name"),
        (workshop.Plan(2, instructor="learner02"), "is also a learner's name"),
    ):
        with pytest.raises(ClusterError, match=words):
            plan.check(23.5, 2)
    with pytest.raises(ClusterError, match="a user root .* exists and was not made by the lab"):
        workshop.refuse_others_accounts(workshop.Plan(1, prefix="nosuchlearner", instructor="root"))
    assert workshop.Plan(2).names == ["learner01", "learner02"]
    assert "2 learners: 10.8 GiB of RAM and 1 of 2 cores each" in workshop.Plan(2).check(23.5, 2)


CLASS_FILE = """
[class]
learners = ["ada", "grace", "alan"]
instructor = "teach"
port = 8100

[limits]
cpus = 32
jobs = 2
queued_jobs = 8
wall = "00:30:00"
"""


def test_a_class_file_gives_the_plan_and_its_limits(tmp_path):
    path = tmp_path / "class.toml"
    path.write_text(CLASS_FILE)
    plan = workshop.plan_from_file(path)
    assert plan.names == ["ada", "grace", "alan"] and (plan.learners, plan.instructor, plan.port) == (
        3,
        "teach",
        8100,
    )
    assert plan.limits.qos() == (
        "MaxTRESPerUser=cpu=32",
        "MaxJobsPerUser=2",
        "MaxSubmitJobsPerUser=8",
        "MaxWall=00:30:00",
    )
    told = plan.check(23.5, 2)
    assert "3 learners: 7.2 GiB of RAM" in told and "MaxWall=00:30:00 each" in told, told

    path.write_text('[class]\nlearners = 2\nprefix = "ws"\n')
    plan = workshop.plan_from_file(path)
    assert plan.names == ["ws01", "ws02"] and plan.limits == workshop.Limits() and plan.port == 8000


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            "[class]\nlearners = 2\nteacher = 'x'\n",
            r"unknown key 'teacher' in \[class\]: the keys are learners, prefix",
        ),
        ("[klass]\nlearners = 2\n", r"unknown section 'klass'"),
        ("[class]\nlearners = '2'\n", r"\[class\] learners = '2': should be a number of learners or a list"),
        ("[class]\nlearners = true\n", r"learners = True: should be"),
        ("[class]\nport = 8000\n", r"\[class\] learners is missing"),
        ("[class]\nlearners = []\n", r"should be a non-empty list of user names"),
        ("[class]\nlearners = ['a', 'b']\nprefix = 'c'\n", r"with a list of names, leave it out"),
        (
            "[class]\nlearners = 2\n[limits]\ncpus = 4.5\n",
            r"\[limits\] cpus = 4.5: should be a number of CPUs",
        ),
        ("[class\nlearners = 2\n", r"is not valid TOML"),
    ],
)
def test_a_wrong_class_file_is_refused_naming_the_key(tmp_path, text, words):
    path = tmp_path / "class.toml"
    path.write_text(text)
    with pytest.raises(ClusterError, match=rf"{re.escape(str(path))}.*{words}"):
        workshop.plan_from_file(path)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("learners = ['ada', 'Bob']", r"'Bob' is not a valid user name"),
        ("learners = ['ada', 'ada', 'al']", r"learner name\(s\) \['ada'\] given twice"),
        ("learners = 2\nport = 65534", r"port 65534: the hub needs port, port \+ 1 and port \+ 2"),
        ("learners = 2\n[limits]\ncpus = 129", r"cpus = 129: a learner's CPUs must be 1 .. 128"),
        ("learners = 2\n[limits]\njobs = 20", r"jobs = 20, queued_jobs = 16: need 1 <= jobs <= queued_jobs"),
        ("learners = 2\n[limits]\nwall = '1h'", r"wall = '1h': a job's time limit is HH:MM:SS"),
    ],
)
def test_a_class_file_that_cannot_work_is_refused_before_anything_is_made(tmp_path, text, words):
    path = tmp_path / "class.toml"
    path.write_text(f"[class]\n{text}\n")
    plan = workshop.plan_from_file(path)
    with pytest.raises(ClusterError, match=words):
        plan.check(23.5, 2)


def test_a_class_file_and_flags_together_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        workshop.main(["--config", str(tmp_path / "class.toml"), "--learners", "3", "--port", "8001"])
    assert exited.value.code == 2
    assert "class.toml describes the class: leave out --learners --port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        workshop.main([])
    assert "start needs --learners N or --config FILE" in capsys.readouterr().err


def test_a_port_in_use_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ClusterError, match=rf"port\(s\) \[{port}[,\]].* in use.*--port"):
            hub.check_ports(port)


def test_progress_view_is_built_from_real_checks(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.FOLDER_VARIABLE, str(tmp_path))
    monkeypatch.setenv("JPY_SESSION_NAME", "notebooks/02_collectives.ipynb")
    assert check("world size", 4, expected=4)
    with pytest.raises(ExerciseError):
        check("ranks", [1, 2], expected=[2, 3])
    assert not check("bubble", "FIXME", expected=0.5)
    me = Path(os.path.expanduser("~")).name if os.geteuid() else "root"
    assert not [r for r in progress.read(tmp_path) if r.user != me]
    table = progress.text_table(progress.read(tmp_path))
    assert f"{me}   +  x  .   1/3" in table and " 2 02_collectives: ranks" in table
    assert check("ranks", [2, 3], expected=[2, 3])  # a later pass turns the x into +
    assert f"{me}   +  +  .   2/3" in progress.text_table(progress.read(tmp_path))
    (tmp_path / "someone.jsonl").write_text((tmp_path / f"{me}.jsonl").read_text())  # not theirs
    assert {r.user for r in progress.read(tmp_path)} == {me}
    notebook = nbformat.read(users.CHECKOUT / "instructor" / "progress.ipynb", as_version=4)
    assert not [c for c in notebook.cells if c.get("outputs") or c.get("execution_count")], "committed clean"
    assert set(notebook.metadata) <= {"kernelspec", "language_info"}
    NotebookClient(notebook, timeout=60, resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
    assert f"{me}   +  +  .   2/3" in text and "4 check results" in text
    assert any("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))


class HubUser:
    """A person at the hub's REST API: logs in with a password, then acts with a token."""

    def __init__(self, base: str, name: str, password: str):
        import requests

        self.base, self.name, session = base, name, requests.Session()
        session.get(f"{base}/hub/login")
        form = {"username": name, "password": password, "_xsrf": session.cookies.get("_xsrf")}
        self.login = session.post(f"{base}/hub/login", data=form, allow_redirects=False)
        self.token = ""
        if self.login.status_code == 302:
            session.get(f"{base}/hub/home")
            xsrf = [c.value for c in session.cookies if c.name == "_xsrf"][-1]
            headers = {"X-XSRFToken": xsrf, "Referer": f"{base}/hub/home"}
            made = session.post(
                f"{base}/hub/api/users/{name}/tokens", headers=headers, json={"expires_in": 600}
            )
            self.token = made.json()["token"]
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {self.token}"

    def api(self, method: str, path: str, timeout: float = 60, **kw):
        return self.http.request(method, f"{self.base}{path}", timeout=timeout, **kw)

    def spawn(self, timeout: float = 150) -> dict:
        started = self.api("POST", f"/hub/api/users/{self.name}/server")
        assert started.status_code in (201, 202) or "already running" in started.text, started.text
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            server = self.api("GET", f"/hub/api/users/{self.name}").json()["servers"].get("", {})
            if server.get("ready"):
                return server
            time.sleep(1)
        raise AssertionError(f"{self.name}'s server not ready within {timeout} s")

    def execute(self, code: str, timeout: float = 120) -> str:
        """Run ``code`` in a new kernel of the server (as a notebook's session would), its output."""
        import websocket

        session = {"path": "notebooks/00_start_here.ipynb", "type": "notebook", "kernel": {"name": "python3"}}
        kernel = self.api("POST", f"/user/{self.name}/api/sessions", json=session).json()["kernel"]["id"]
        url = f"{self.base.replace('http', 'ws')}/user/{self.name}/api/kernels/{kernel}/channels"
        ws = websocket.create_connection(url, header=[f"Authorization: token {self.token}"], timeout=timeout)
        mid = uuid.uuid4().hex
        header = {
            "msg_id": mid,
            "msg_type": "execute_request",
            "session": mid,
            "username": self.name,
            "version": "5.3",
        }
        content = {"code": code, "silent": False}
        ws.send(
            json.dumps(
                {
                    "header": header,
                    "parent_header": {},
                    "metadata": {},
                    "content": content,
                    "channel": "shell",
                }
            )
        )
        out = []
        while True:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != mid:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            if msg["msg_type"] == "error":
                out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                ws.close()
                return "".join(out)


CELL = """import subprocess
from distlab.checks import check
job = subprocess.run(["sbatch", "--parsable", "--wait", "-N2", "--output=/dev/null",
                      "--wrap", "srun sh -c 'echo $(hostname) $(id -un) >> $HOME/distlab-course/runs/hosts'"],
                     capture_output=True, text=True)
print("job", job.returncode, job.stdout.strip(), job.stderr.strip())
print(sorted(open("../runs/hosts").read().split("\\n")))
check("world size", 4, expected=4)
"""


@pytest.fixture(scope="module")
def class_on_hub(shared):
    installed = (hub.HUB / "venv" / "bin" / "jupyterhub", hub.COURSE_PYTHON)
    if not all(p.exists() for p in installed):
        pytest.skip(f"JupyterHub is not installed in {hub.HUB} (`sudo ./lab workshop` installs it)")
    closed = [daemons.closed_folder(p) for p in installed if daemons.closed_folder(p)]
    if closed:
        pytest.skip(f"{closed[0]} is closed to other users: learners could not run JupyterLab")
    for name in PLAN_NAMES:
        if users.lookup(name) is not None:
            pytest.skip(f"a user {name} exists already: not touching it")
    plan = workshop.Plan(
        2, prefix="hubtest", instructor="hubteach", port=users_test.free_base()
    )  # 3 free ports
    folder, limits = shared / "cluster", workshop.enable_limits
    with users_test.private_cluster(folder, prepare=limits) as paths, pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_HUB_RUN", str(shared / "hub"))
        try:
            report = workshop.start(plan, paths)
            passwords = dict(re.findall(r"^  (hub\w+) +(\S+) ", report, re.MULTILINE))
            yield plan, paths, passwords
        finally:
            try:
                workshop.stop(paths)
            finally:
                for name in PLAN_NAMES:
                    users.remove(name, paths)


@pytest.mark.skipif(
    browser.CHROMIUM is None, reason="no chromium (Debian's package, which ./lab test installs)"
)
def test_a_learner_logs_in_with_a_browser_and_opens_notebook_00(class_on_hub):
    plan, _, passwords = class_on_hub
    shot = REPO_ROOT / "runs" / "workshop" / "learner-notebook00.png"
    shot.unlink(missing_ok=True)
    url = browser.log_in_and_open(f"http://127.0.0.1:{plan.port}", "hubtest02", passwords["hubtest02"], shot)
    assert url.startswith(f"http://127.0.0.1:{plan.port}/user/hubtest02/lab"), url
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_a_learner_opens_tensorboard_in_their_jupyterlab(class_on_hub):
    plan, _, passwords = class_on_hub
    base = f"http://127.0.0.1:{plan.port}"
    one, two = (HubUser(base, name, passwords[name]) for name in plan.names)
    one.spawn()
    page = one.api("GET", "/user/hubtest01/tensorboard/", timeout=90)
    assert page.status_code == 200 and "<title>TensorBoard</title>" in page.text, (
        page.status_code,
        page.text[:500],
    )
    runs = one.api("GET", "/user/hubtest01/tensorboard/data/runs")
    assert runs.status_code == 200 and runs.json() == [], runs.text[:500]  # the learner's own runs/: empty
    boards = [
        p
        for p in psutil.process_iter(["cmdline", "uids"])
        if "tensorboard.main" in " ".join(p.info["cmdline"] or [])
    ]
    mine = [p for p in boards if str(users.lookup("hubtest01").workspace / "runs") in p.info["cmdline"]]
    assert mine and all(p.info["uids"].real == users.lookup("hubtest01").uid for p in mine), boards
    assert two.api("GET", "/user/hubtest01/tensorboard/", allow_redirects=False).status_code in (
        302,
        403,
        404,
    )


def test_learners_log_in_and_work_as_themselves(class_on_hub):
    plan, paths, passwords = class_on_hub
    base = f"http://127.0.0.1:{plan.port}"
    assert sorted(passwords) == sorted(PLAN_NAMES)
    assert HubUser(base, "hubtest01", "not-the-password").login.status_code == 403
    one, two = (HubUser(base, name, passwords[name]) for name in plan.names)
    teacher = HubUser(base, plan.instructor, passwords[plan.instructor])
    assert one.login.status_code == two.login.status_code == teacher.login.status_code == 302
    teacher.spawn()
    for learner in (one, two):
        learner.spawn()
        state = teacher.api("GET", f"/hub/api/users/{learner.name}").json()["servers"][""]["state"]
        assert os.stat(f"/proc/{state['pid']}").st_uid == users.lookup(learner.name).uid
    out = one.execute(CELL)
    assert re.search(r"^job 0 \d+ $", out, re.MULTILINE), out
    assert "['', 'node1 hubtest01', 'node2 hubtest01']" in out and "[ok] world size" in out, out
    assert two.api("GET", "/user/hubtest01/api/contents/notebooks").status_code in (403, 404)
    assert "Permission denied" in two.execute("open('/home/hubtest01/distlab-course/runs/hosts')")
    shown = teacher.execute(
        "from distlab import progress\nprint(progress.text_table(progress.read(progress.default_folder())))"
    )
    assert "hubtest01   +   1/1" in shown, shown
    assert "Permission denied" in two.execute("import os; os.listdir(os.environ['LAB_PROGRESS_DIR'])")
    pid = teacher.api("GET", "/hub/api/users/hubtest02").json()["servers"][""]["state"]["pid"]
    assert "JupyterHub stopped" in workshop.stop(paths)
    assert not Path(f"/proc/{pid}").exists()

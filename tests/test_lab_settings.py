"""JupyterLab's defaults for the learners (issue 30): no "Would you like to get notified about
official Jupyter news?" pop-up. distlab.cluster.hub.write_lab_settings writes the override into an
environment's JupyterLab settings folder; JupyterLab's own settings code (jupyterlab_server) must
then give the notification plugin ``fetchNews = "false"`` as its default, where without the file it
is "none" (JupyterLab asks). The lab script's lab_settings writes it, and jupyter_start calls it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from jupyterlab.commands import get_app_dir
from jupyterlab_server.settings_utils import get_settings

from distlab import REPO_ROOT
from distlab.cluster import hub

PLUGIN = "@jupyterlab/apputils-extension:notification"


def settings_file(prefix: Path) -> Path:
    return prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.json"


def fetch_news_default(app_settings_dir: Path, user_settings: Path) -> str:
    """The notification plugin's fetchNews default as JupyterLab's server computes it (its settings
    API's code), from the installed JupyterLab's schemas and the overrides in ``app_settings_dir``."""
    schemas = Path(get_app_dir()) / "schemas"
    plugin, _ = get_settings(str(app_settings_dir), str(schemas), str(user_settings), schema_name=PLUGIN)
    return plugin["schema"]["properties"]["fetchNews"]["default"]


def test_the_override_is_written_merged_and_readable_by_all(tmp_path):
    path = settings_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    assert hub.write_lab_settings(tmp_path) == path
    written = json.loads(path.read_text())
    assert written[PLUGIN] == {"fetchNews": "false"}
    assert written["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}  # kept
    assert path.stat().st_mode & 0o777 == 0o644 and path.parent.stat().st_mode & 0o777 == 0o755
    before = path.stat().st_mtime_ns
    hub.write_lab_settings(tmp_path)
    assert path.stat().st_mtime_ns == before, "an unchanged file is not rewritten"


def test_jupyterlab_takes_fetch_news_false_as_its_default(tmp_path):
    user = tmp_path / "user-settings"
    user.mkdir()
    bare = tmp_path / "bare"
    assert fetch_news_default(settings_file(bare).parent, user) == "none"  # JupyterLab would ask
    hub.write_lab_settings(tmp_path)
    assert fetch_news_default(settings_file(tmp_path).parent, user) == "false"


def test_the_lab_script_writes_it_before_starting_jupyterlab(tmp_path):
    out = subprocess.run(
        [
            "bash",
            "-c",
            'source "$0" && lab_settings "$1" && declare -f jupyter_start',
            str(REPO_ROOT / "lab"),
            tmp_path,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(settings_file(tmp_path).read_text())[PLUGIN] == {"fetchNews": "false"}
    body = out.stdout.split("jupyter lab", 1)[0]  # what jupyter_start runs before JupyterLab
    assert 'lab_settings "$VENV"' in body, out.stdout

"""Prefect's settings as infra/prefect_env.py leaves them: its state in the project's outputs/.prefect, and the user's
own profile (`prefect config set PREFECT_API_URL=...`, in ~/.prefect/profiles.toml) still applying. Each case runs in
a subprocess with a home of its own: Prefect reads its settings once per process, and the test session's are set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]
API_URL = "http://127.0.0.1:4200/api"
# configure() with the project in `project`, then what Prefect reads
PROBE = """
import json, sys
from pathlib import Path
from infra import prefect_env
prefect_env.PROJECT_DIR = Path(sys.argv[1])
prefect_env.configure()
from prefect.settings import get_current_settings
s = get_current_settings()
print(json.dumps({"api_url": s.api.url, "ephemeral": s.server.ephemeral.enabled, "home": str(s.home),
                  "results": str(s.results.local_storage_path)}))
"""


def prefect_settings(home: Path, project: Path, **env: str) -> dict:
    """Prefect's settings after configure(), for a user whose home is `home`, with no PREFECT_* variables but `env`."""
    base = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(project)], cwd=home, capture_output=True, text=True,
                          env={**base, "HOME": str(home), "PYTHONPATH": str(PROJECT), **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def user(tmp_path) -> Path:
    """A home where the user ran `prefect config set PREFECT_API_URL=...` (the file as Prefect writes it)."""
    home = tmp_path / "home"
    (home / ".prefect").mkdir(parents=True)
    (home / ".prefect" / "profiles.toml").write_text(
        f'active = "ephemeral"\n\n[profiles.ephemeral]\nPREFECT_API_URL = "{API_URL}"\n')
    return home


def test_the_users_profile_still_names_the_server(user, tmp_path):
    settings = prefect_settings(user, tmp_path / "project")
    assert settings["api_url"] == API_URL  # not a temporary server that the user's UI never shows
    assert settings["home"] == str(tmp_path / "project" / "outputs" / ".prefect")  # the state stays in outputs/
    assert settings["results"] == str(tmp_path / "project" / "outputs" / ".prefect" / "results")


def test_without_a_profile_runs_use_a_temporary_server_and_outputs(tmp_path):
    (tmp_path / "home").mkdir()
    settings = prefect_settings(tmp_path / "home", tmp_path / "project")
    assert settings["api_url"] is None and settings["ephemeral"]
    assert settings["home"] == str(tmp_path / "project" / "outputs" / ".prefect")
    assert settings["results"] == str(tmp_path / "project" / "outputs" / ".prefect" / "results")
    assert not (tmp_path / "home" / ".prefect").exists()  # nothing written to the user's home


def test_a_users_own_prefect_home_keeps_its_own_profiles(user, tmp_path):
    """PREFECT_HOME set by the user: its profiles.toml (here none) is the one Prefect reads, not ~/.prefect's."""
    settings = prefect_settings(user, tmp_path / "project", PREFECT_HOME=str(tmp_path / "own"))
    assert settings["api_url"] is None and settings["home"] == str(tmp_path / "own")

"""Where Prefect keeps its state: inside the project's `outputs/` folder unless the user says otherwise.

Prefect reads its settings from the environment when it is imported, so `configure()` runs before any
`import prefect` (at the top of flows/post_train.py, tasks/stages.py and tasks/cache_keys.py). Every variable is
only a default: a user's own PREFECT_HOME / PREFECT_API_URL (a real server, a deployment's worker) wins, and so
does the user's profile (`prefect config set ...`, in ~/.prefect/profiles.toml), which moving PREFECT_HOME would
otherwise hide.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "infra", "data", "tasks", "flows")


def configure() -> None:
    _keep_user_profiles()
    home = Path(os.environ.setdefault("PREFECT_HOME", str(PROJECT_DIR / "outputs" / ".prefect")))
    home.mkdir(parents=True, exist_ok=True)  # Prefect does not create missing parents
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "results"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")  # slow 2-core machines
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "stages,infra,data")  # our loggers in run logs
    # ... and outside runs (the command line's lines before and after the flow, the CLIs) only where they go anyway,
    # without Prefect's warning that no flow run is there to receive them
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in PACKAGES:  # Prefect forwards these to the run's logs, but leaves their level at WARNING
        logging.getLogger(name).setLevel(logging.INFO)


def _keep_user_profiles() -> None:
    """Prefect reads profiles from $PREFECT_HOME/profiles.toml once PREFECT_HOME is set, so moving PREFECT_HOME
    into outputs/ would drop the user's `prefect config set PREFECT_API_URL=...`. Point Prefect back at the file it
    would have read (Prefect 3's settings/sources.py: ~/.prefect/profiles.toml when it exists); without one Prefect
    uses its packaged profiles (a temporary local server), as before. A user's own PREFECT_HOME or
    PREFECT_PROFILES_PATH already says where the profiles are."""
    if "PREFECT_HOME" in os.environ or "PREFECT_PROFILES_PATH" in os.environ:
        return
    profiles = Path.home() / ".prefect" / "profiles.toml"
    if profiles.is_file():
        os.environ["PREFECT_PROFILES_PATH"] = str(profiles)

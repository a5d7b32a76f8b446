"""Where Prefect keeps its state: inside the project's `outputs/` folder unless the user says otherwise.

Prefect reads its settings from the environment when it is imported, so `configure()` runs before any
`import prefect` (from `flows/__init__.py` and `tasks/__init__.py`). Every variable is only a default:
a user's own PREFECT_HOME / PREFECT_API_URL (a real server, a deployment's worker) wins.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "infra", "data", "tasks", "flows")


def configure() -> None:
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


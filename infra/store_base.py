"""What every part of the artifact store (infra/store.py) shares: the names the layout reserves, the store's
errors, and the exceptions that mean the storage failed (turned into ``StoreError`` by ``ArtifactStore._errors``).
"""

from __future__ import annotations

import asyncio

import aiohttp
from botocore.exceptions import BotoCoreError, ConnectTimeoutError, ReadTimeoutError
from fsspec.exceptions import FSTimeoutError

ARTIFACTS = "artifacts"
STAGING = ".staging"
HEARTBEAT = "_heartbeat"  # rewritten in a version folder while it uploads (infra/store_heartbeat.py)
PARTIAL = ".partial-"  # get_dir downloads into .<version>.partial-<random> beside its destination, then renames it
CONNECTION_ERRORS = (BotoCoreError, aiohttp.ClientError, asyncio.TimeoutError, FSTimeoutError)
TIMEOUTS = (ReadTimeoutError, ConnectTimeoutError, asyncio.TimeoutError, FSTimeoutError)


class StoreError(RuntimeError):
    """Storage unreachable or a write failed; the message names the root, the endpoint and the fix."""


class CorruptArtifactError(StoreError):
    """A stored version differs from its manifest, or its manifest is unreadable; the message names the version,
    each bad file with expected vs found, and the commands that check and remove it."""

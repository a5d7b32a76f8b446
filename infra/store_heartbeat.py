"""A heartbeat that keeps an artifact upload in progress looking alive to gc, however large its files are.

gc (infra/store_gc.py) removes a manifest-less version folder once its newest object is older than
``temp_min_age_s`` (an hour). An S3 object appears only once it has been sent whole, and AWS gives a multipart object
the LastModified of the moment its upload *began*. So while an upload sends one big file (tens of GB on a slow link),
nothing in its folder gets younger. Without a heartbeat, gc would take the write for a crashed one and remove the
files already sent, and the version would commit as corrupt. ``heartbeat`` writes a small object,
``_heartbeat`` (``store_base.HEARTBEAT``), into the folder before the first file is sent. A daemon thread rewrites
it every ``temp_min_age_s / 6`` (at most ``MAX_INTERVAL_S``), and the object is removed once the manifest is
written. While the storage answers, the newest beat is at most the interval plus one request's
``stall_bound_s`` old, and ``temp_min_age_s`` is at least twice ``stall_bound_s``, so a live upload's folder stays
younger than the age. A killed writer's thread
dies with it: its folder goes stale and gc removes it, heartbeat included, after the age, as before.

Readers never see the heartbeat: it is not in the manifest; verification and downloads leave it out (a writer
killed while a concurrent writer committed the same content leaves one behind in the committed folder, where it
is ignored); ``put_dir`` refuses a file of that name; listings look only at folders and manifests.

Local writes need no heartbeat: each file is copied into ``.staging/{uuid}/``, and every write moves the copy's
mtime (measured: the mtime of a 3 GiB ``shutil.copyfile`` destination stays within 20 ms of the clock for the
whole copy), so gc's newest-mtime rule sees a local write as live while its bytes arrive.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from fsspec import AbstractFileSystem

from infra.store_base import CONNECTION_ERRORS, HEARTBEAT, TIMEOUTS

logger = logging.getLogger("infra.store")  # the store's one logger, whichever of its files speaks

MAX_INTERVAL_S = 600.0


def interval_s(min_age_s: float) -> float:
    """How often a live write rewrites its heartbeat: a sixth of gc's age, at most MAX_INTERVAL_S."""
    return min(min_age_s / 6, MAX_INTERVAL_S)


def check_sources(sources: dict[str, Path]) -> None:
    """ValueError if the files to store (relpath -> source) hold one at the heartbeat's reserved path."""
    if HEARTBEAT in sources:
        raise ValueError(f"local_dir={str(sources[HEARTBEAT].parent)!r} contains {HEARTBEAT}, a name the store "
                         "reserves for the heartbeat of an upload in progress; rename it")


@contextmanager
def heartbeat(fs: AbstractFileSystem, folder: str, min_age_s: float) -> Iterator[None]:
    """Keep ``folder/_heartbeat`` younger than min_age_s while the block runs (see the module docstring).

    The first beat is written before the block starts, and an error from it propagates (the write has not begun).
    A later beat that fails is logged and retried at the next interval: the write itself will report the
    storage's failure. On exit the thread stops and the heartbeat is removed (best effort), unless the block timed
    out: a storage that does not answer would hold the removal as long again, and gc removes the folder after
    the age.
    """
    path = f"{folder}/{HEARTBEAT}"
    _beat(fs, path)
    stop = threading.Event()
    thread = threading.Thread(target=_beat_until, args=(fs, path, stop, interval_s(min_age_s)), daemon=True,
                              name=f"store-heartbeat {folder}")
    thread.start()
    timed_out = False
    try:
        yield
    except TIMEOUTS:
        timed_out = True
        raise
    finally:
        stop.set()
        thread.join()  # a beat in flight ends within stall_bound_s; none may land after the removal
        if not timed_out:
            _remove(fs, path)


def _beat(fs: AbstractFileSystem, path: str) -> None:
    now = datetime.now(timezone.utc).isoformat()
    fs.pipe_file(path, f"upload in progress: {socket.gethostname()} pid {os.getpid()}, beat at {now}\n".encode())


def _beat_until(fs: AbstractFileSystem, path: str, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            _beat(fs, path)
        except (*CONNECTION_ERRORS, OSError) as exc:
            logger.warning("could not rewrite the heartbeat %s (%s); retrying in %.0f s", path, exc, every_s)


def _remove(fs: AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass  # a concurrent writer of the same content removed it
    except (*CONNECTION_ERRORS, OSError) as exc:
        logger.warning("could not remove the heartbeat %s (%s); readers ignore it", path, exc)

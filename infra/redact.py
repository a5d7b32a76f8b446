"""Secrets never land in a run's config, logs or artifacts.

Credentials belong in the environment (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `WANDB_API_KEY`,
`HF_TOKEN`), never in config: a config value holding a URL with a password (`http://key:secret@host`) is refused
(`url_credential_fields`, checked when the config validates, before anything is written). Log records going to
the console and to run.log pass `RedactFilter`, which masks such URLs and the values of the secret environment
variables wherever a message quotes them (an exception from a library, say).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
URL_CREDENTIALS = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@")
MASK = "***"


def redact(text: str) -> str:
    """`text` with URL credentials and the secret environment variables' values masked."""
    text = URL_CREDENTIALS.sub(rf"\1{MASK}@", text)
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 8:  # a short value would mask ordinary words
            text = text.replace(value, MASK)
    return text


def url_credential_fields(tree: Any, path: str = "") -> list[str]:
    """Dotted paths of the string values in a (config) tree that hold a URL with a password."""
    if isinstance(tree, dict):
        return [p for key, value in tree.items() for p in url_credential_fields(value, f"{path}{key}.")]
    if isinstance(tree, list | tuple):
        return [p for i, value in enumerate(tree) for p in url_credential_fields(value, f"{path}{i}.")]
    return [path.rstrip(".")] if isinstance(tree, str) and URL_CREDENTIALS.search(tree) else []


class RedactFilter(logging.Filter):
    """Masks secrets in a record's final message (arguments merged in) and its exception text."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True

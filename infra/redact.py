"""Secrets never land in a run's config, logs or artifacts.

Credentials belong in the environment (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `WANDB_API_KEY`,
`HF_TOKEN`), never in config: a config value holding a URL with credentials (`http://key:secret@host`, a token
as the user: `https://token@host`) is refused (`url_credential_fields`, checked when the config validates, before
anything is written). Log records going to the console and to run.log pass `RedactFilter`, which masks such URLs
and the values of the secret environment variables wherever a message quotes them (an exception from a library).

What counts as credentials (`URL_CREDENTIALS`) in `scheme://USERINFO@host`: RFC 3986 ends the authority (and
so the userinfo) at the first `/`, `?` or `#`, but secrets get pasted unencoded (AWS secret keys hold `/`), so a
`:` before that end starts a password that runs on through `/ ? #` to the next `@`. Hence:
- `user:password@`, the password anything but white space and `@`: `s3://AKIA:wJalr/K7MDENG@bucket/p`;
- `token@`, with no `:` and no `/ ? #` before the `@`: `http://token@host:9000`;
- not an `@` after a `/ ? #` with no `:` before it: that `@` is in the path or query (`s3://bucket/models/v1@2/`);
- not `host:port` then a path or query (`http://host:9000/models/v1@2`): 1-5 digits after the `:` and then
  `/ ? #` are a port, so a password of that shape (`user:12/x@host`) is missed;
- not `git@` alone (`git+ssh://git@github.com/org/repo`): ssh's conventional user, no secret;
- not an e-mail address in plain text (`user@example.com`): there is no `scheme://` before it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
URL_CREDENTIALS = re.compile(
    r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)"
    r"(?!git@)"  # ssh's conventional user, not a secret
    r"(?:[^/?#\s:@\[]*:(?!\d{1,5}[/?#])[^\s@]*"  # user:password; not host:port/path (`[`: an IPv6 host)
    r"|[^/?#\s:@\[]+)"  # a token as the user
    r"@"
)
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
    """Dotted paths of the string values in a (config) tree that hold a URL with credentials."""
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

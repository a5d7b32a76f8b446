"""Secrets stay out of configs and logs (infra.redact): URL credentials are refused in any config field and
masked in log records, as are the secret environment variables' values."""

from __future__ import annotations

import logging

import pytest

from infra.config import ConfigError, load_config
from infra.redact import RedactFilter, redact, url_credential_fields


def test_redact_masks_url_credentials_and_secret_env(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG")
    text = "GET http://AKIA:pass@127.0.0.1:9000/b failed; key wJalrXUtnFEMI/K7MDENG; s3://bucket/x is fine"
    assert redact(text) == "GET http://***@127.0.0.1:9000/b failed; key ***; s3://bucket/x is fine"


def test_credential_fields_are_found_anywhere_in_a_tree():
    tree = {"storage": {"endpoint_url": "https://u:p@host", "root": "s3://b/p"}, "data": {"path": ["a", "ftp://x:y@h/f"]}}
    assert url_credential_fields(tree) == ["storage.endpoint_url", "data.path.1"]


@pytest.mark.parametrize("override", ["storage.endpoint_url=http://AKIA:topsecret@127.0.0.1:9000",
                                      "model.path=https://user:topsecret@example.com/model"])
def test_config_refuses_credentials_without_echoing_them(override):
    with pytest.raises(ConfigError, match="holds a URL with a password") as info:
        load_config(None, [override])
    assert "topsecret" not in str(info.value)


def test_filter_masks_messages_arguments_and_tracebacks(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123")
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "upload to %s failed", ("http://a:b@h",), None)
    try:
        raise RuntimeError("bad key 0123456789abcdef0123")
    except RuntimeError:
        import sys

        record.exc_info = sys.exc_info()
    assert RedactFilter().filter(record)
    formatted = logging.Formatter().format(record)
    assert "http://***@h" in formatted and "0123456789abcdef0123" not in formatted and "a:b@" not in formatted

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
    with pytest.raises(ConfigError, match="holds a URL with credentials") as info:
        load_config(None, [override])
    assert "topsecret" not in str(info.value)


# A password may hold `/` (AWS secret keys do) and a token may stand alone as the user; the secret in each is
# "se/cret" or "tokenonly", so the tests can check that no part of it survives.
CREDENTIAL_URLS = {
    "s3://AKIAX:se/cretK7MDENG@bucket/prefix": "s3://***@bucket/prefix",
    "http://AKIA:se/cret@host": "http://***@host",
    "https://user:se/cret?#x@host/gsm8k": "https://***@host/gsm8k",
    "http://AKIA:/se/cret@host": "http://***@host",  # a password that starts with its `/`
    "http://tokenonly@host:9000": "http://***@host:9000",
    "ssh://git:tokenonly@github.com/o/r": "ssh://***@github.com/o/r",  # git with a password is no convention
}
# An `@` in the path or query, a port before the path, ssh's user git, an IPv6 host, e-mails in plain text.
ORDINARY = ["s3://bucket/path/with@sign/file", "s3://bucket/models/v1@2/", "http://host:9000/models/v1@2",
            "https://host?email=a@b.com", "http://host:9000?x=a@b", "git+ssh://git@github.com/org/repo.git",
            "http://[::1]:9000/a@b", "reach user@example.com at http://host:8080, or admin@example.com"]


@pytest.mark.parametrize("url", CREDENTIAL_URLS)
def test_redact_masks_any_userinfo_even_with_a_slash(url):
    assert redact(f"GET {url} failed") == f"GET {CREDENTIAL_URLS[url]} failed"
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "upload to %s failed", (url,), None)
    assert RedactFilter().filter(record)
    assert record.getMessage() == f"upload to {CREDENTIAL_URLS[url]} failed"


@pytest.mark.parametrize("text", ORDINARY)
def test_redact_leaves_at_signs_outside_the_userinfo(text):
    assert redact(text) == text
    assert url_credential_fields({"storage": {"root": text}}) == []


@pytest.mark.parametrize("override", ["storage.root=s3://AKIAX:se/cretK7MDENG@bucket/prefix",
                                      "storage.endpoint_url=http://AKIA:se/cret@host",
                                      "data.gsm8k_path=https://user:se/cret@host/gsm8k",
                                      "storage.endpoint_url=http://tokenonly@host:9000",
                                      "data.gsm8k_path=https://tokenonly@host/gsm8k"])
def test_config_refuses_slashed_passwords_and_tokens_without_echoing_them(override):
    # endpoint_url's own check fails first on the `/` (a port "se"): the refusal must replace its message,
    # which would quote the password's first part.
    with pytest.raises(ConfigError, match="holds a URL with credentials") as info:
        load_config("recipes/demo.yaml", [override])
    assert "se/cret" not in str(info.value) and "'se'" not in str(info.value) and "tokenonly" not in str(info.value)


def test_config_accepts_an_at_sign_in_a_path():
    config = load_config("recipes/demo.yaml", ["storage.root=s3://bucket/models/v1@2/"])
    assert config.storage.root == "s3://bucket/models/v1@2/"


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

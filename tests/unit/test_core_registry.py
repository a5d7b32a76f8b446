"""Registry: lookups, duplicate registration, errors that list the valid keys; the three real registries."""

import re

import pytest

from stages.core import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, Registry


def test_register_get_keys():
    reg = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    @reg.register("a")
    def a():
        return "a"

    assert reg.get("a") is a and reg.get("b") is b
    assert reg.keys() == ["b", "a"]  # registration order
    assert "a" in reg and "c" not in reg and len(reg) == 2


def test_duplicate_registration_raises():
    reg = Registry("widget")
    reg.register("x")(lambda: 1)
    with pytest.raises(ValueError, match="widget 'x' is already registered"):
        reg.register("x")(lambda: 2)
    assert reg.get("x")() == 1  # the first entry survives


def test_unknown_key_lists_valid_keys():
    reg = Registry("widget")
    reg.register("alpha")(len)
    reg.register("beta")(len)
    with pytest.raises(ValueError, match=r"unknown widget 'gamma'; valid keys: alpha, beta"):
        reg.get("gamma")


@pytest.mark.parametrize(
    "registry, expected",
    [
        (
            ADV_ESTIMATORS,
            {
                "gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "opo", "gpg",
                "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "online_dpo",
            },
        ),
        (POLICY_LOSSES, {"vanilla", "gspo", "gpg", "cispo", "clip_cov", "kl_cov"}),
        (
            KL_ESTIMATORS,
            {k + s for k in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl") for s in ("", "+")},
        ),
    ],
)  # fmt: skip
def test_real_registries_have_the_paper_keys(registry, expected):
    assert set(registry.keys()) == expected
    with pytest.raises(ValueError, match=re.escape("valid keys: " + ", ".join(registry.keys()))):
        registry.get("ppo_typo")


def test_real_registries_reject_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("vanilla")(lambda *a, **k: None)

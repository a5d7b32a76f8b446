"""Configuration: recipes, dotted overrides and the errors users see."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra import sql
from infra.algorithms import AdvEstimator, PolicyLoss, variant_names
from infra.config import Config, ConfigError, config_hash, load_config, parse_override, to_yaml
from infra.store import ArtifactStore

RECIPES = sorted(Path(__file__).resolve().parents[2].joinpath("recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_validates(recipe):
    assert isinstance(load_config(recipe), Config)


def test_overrides_are_parsed_as_yaml_and_create_sections():
    cfg = load_config(None, ["sft.optim.lr=1e-4", "model.lora.rank=4", "tracking.backends=[console,wandb]",
                             "storage.root=./other-store"])
    assert cfg.sft.optim.lr == 1e-4
    assert cfg.model.lora is not None and cfg.model.lora.rank == 4 and cfg.model.lora.alpha == 16.0
    assert cfg.tracking.backends == ["console", "wandb"]
    assert cfg.storage.root == "./other-store"


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("sft.optim.lr")


def test_unknown_key_names_key_value_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["sft.optim.lrr=1e-4"])
    msg = str(err.value)
    assert "sft.optim.lrr" in msg and "1e-4" in msg and "allowed here:" in msg and "lr," in msg


def test_float16_training_is_refused_naming_bfloat16():
    """No loss scaling: dividing the loss by the token count put small fp16 gradients below fp16's range (21 of
    32,768 LoRA gradient entries were 0 after one step of 686 tokens, relative error 7e-2 against 9e-3 in bf16)."""
    with pytest.raises(ConfigError, match=r"model\.dtype=float16: training in float16 needs loss scaling.*bfloat16"):
        load_config(None, ["model.dtype=float16"])
    assert load_config(None, ["model.dtype=float16", "sft.enabled=false", "rl.enabled=false"]).model.dtype == "float16"


def test_an_overlong_buffer_longer_than_the_response_is_refused_at_load():
    """Not at the first scoring, after data prep, SFT and the engines' start."""
    with pytest.raises(ConfigError, match=r"rl\.reward\.overlong_buffer=100000 is longer than the response, "
                                          r"data\.max_response_length=48"):
        load_config("recipes/demo.yaml", ["rl.reward.overlong_buffer=100000"])
    assert load_config("recipes/demo.yaml", ["rl.reward.overlong_buffer=48"]).rl.reward.overlong_buffer == 48


def test_negative_learning_rate_is_an_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"sft\.optim\.lr = -0\.001: Input should be greater than 0"):
        load_config(None, ["sft.optim.lr=-0.001"])


def test_an_estimator_that_compares_samples_needs_several_per_prompt():
    with pytest.raises(ConfigError, match=r"adv_estimator=grpo_passk compares the samples of each prompt: "
                                          r"rl\.rollout\.n=1 must be at least 2"):
        load_config(None, ["rl.algorithm.adv_estimator=grpo_passk", "rl.rollout.n=1"])
    load_config(None, ["rl.algorithm.adv_estimator=grpo", "rl.rollout.n=1"])  # GRPO takes a group of one as verl


def test_every_bad_key_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["sft.epochs=0", "data.truncation=middle"])
    assert "sft.epochs" in str(err.value) and "data.truncation" in str(err.value)


def test_cross_field_check_names_both_fields():
    with pytest.raises(ConfigError, match="sft.train_batch_size=30 must be a multiple of sft.micro_batch_size=8"):
        load_config(None, ["sft.train_batch_size=30", "sft.micro_batch_size=8"])


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="run.seed"):
        load_config(None, ["run.seed.x=1"])
    with pytest.raises(ConfigError, match="run.seed is a value, not a section"):
        load_config(None, ["run.seed=1", "run.seed.x=1"])


def test_missing_recipe_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("recipes/nope.yaml")


def test_resolved_yaml_roundtrips(tmp_path):
    cfg = load_config(None, ["sft.epochs=7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_config_hash_depends_only_on_given_sections():
    a = load_config(None, [])
    b = load_config(None, ["evaluate.batch_size=3"])
    c = load_config(None, ["sft.epochs=9"])
    assert config_hash(a.sft, "x") == config_hash(b.sft, "x")
    assert config_hash(a.sft, "x") != config_hash(c.sft, "x")
    assert config_hash(a.sft, "x") != config_hash(a.sft, "y")


def test_s3_root_with_unknown_protocol_is_rejected():
    with pytest.raises(ConfigError, match="gs://bucket"):
        load_config(None, ["storage.root=gs://bucket"])


@pytest.mark.parametrize("url", ["127.0.0.1:5599", "localhost:9000", "ftp://host", "http://", "http://host:port"])
def test_an_s3_endpoint_must_be_an_http_url_with_a_host_everywhere(url):
    """One check for the config, the store (its CLI's --endpoint-url, AWS_ENDPOINT_URL) and SQL's S3 settings: a
    URL without a scheme used to pass, then failed deep in botocore, while SQL guessed https for it."""
    example = "e.g. http://127.0.0.1:9000"
    with pytest.raises(ConfigError, match=f"storage.endpoint_url = '{url}': .*{example}"):
        load_config(None, [f"storage.endpoint_url={url}"])
    with pytest.raises(ValueError, match=f"endpoint_url='{url}' \\(storage.endpoint_url, .*{example}"):
        ArtifactStore("s3://bucket/prefix", url)
    with pytest.raises(ValueError, match=f"endpoint_url='{url}' \\(storage.endpoint_url, .*{example}"):
        sql.s3_secret_options(url, {})


def test_an_http_or_https_endpoint_is_accepted():
    for url in ("http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com", "https://minio.example.com/"):
        assert load_config(None, [f"storage.endpoint_url={url}"]).storage.endpoint_url == url
    assert load_config(None, ["storage.endpoint_url=null"]).storage.endpoint_url is None


@pytest.mark.parametrize("overrides, key", [
    (["sft.optim.lr=.inf"], "sft.optim.lr = inf"),  # passes gt=0
    (["sft.optim.lr=inf"], "sft.optim.lr = inf"),  # a string that pydantic reads as a float
    (["rl.actor.optim.grad_clip=.inf"], "rl.actor.optim.grad_clip = inf"),  # a section of infra/rl_config.py
    (["storage.min_upload_mib_s=.inf"], "storage.min_upload_mib_s = inf"),
    (["rl.actor.policy_loss=clip_cov", "rl.actor.policy_loss.clip_cov_lb=-.inf"],
     "rl.actor.policy_loss.clip_cov_lb = -inf"),  # a variant of infra/algorithms.py, a field without bounds
    (["rl.actor.policy_loss=clip_cov", "rl.actor.policy_loss.clip_cov_ub=.nan"],
     "rl.actor.policy_loss.clip_cov_ub = nan"),
])
def test_inf_and_nan_are_refused_in_every_float_field(overrides, key):
    with pytest.raises(ConfigError, match=f"{key.replace('.', '[.]')}: inf and nan are not allowed; give a finite"):
        load_config(None, overrides)


@pytest.mark.parametrize("variant", [f"rl.algorithm.adv_estimator={name}" for name in variant_names(AdvEstimator)]
                         + [f"rl.actor.policy_loss={name}" for name in variant_names(PolicyLoss)])
def test_every_default_is_finite(variant):
    """The check above covers every field: no default (of any variant's fields too) may rely on inf."""
    assert isinstance(load_config(None, ["rl.rollout.n=2", variant]), Config)


@pytest.mark.parametrize("content, message", [
    (b"run:\n  seed: [0\n", r"recipe '.*bad.yaml' is not valid YAML: expected ',' or '\]'.* at line 3, column 1"),
    (b"run:\n  name: caf\xe9\n", r"recipe '.*bad.yaml' is not UTF-8 text \(byte 16 is b'\\xe9'\); save it as UTF-8"),
])
def test_a_broken_recipe_is_named(tmp_path, content, message):
    (tmp_path / "bad.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "bad.yaml")


def test_a_malformed_override_value_says_how_to_quote_it():
    with pytest.raises(ConfigError, match=r"override 'run.seed=\[0': the value is not valid YAML .*quote a string"):
        parse_override("run.seed=[0")


def test_the_command_line_prints_the_error_and_exits_2(tmp_path):
    (tmp_path / "bad.yaml").write_bytes(b"run:\n  seed: [0\n")
    project = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "flows.post_train", str(tmp_path / "bad.yaml")], cwd=project,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(project)})
    assert done.returncode == 2 and done.stderr.startswith("error: recipe ") and "Traceback" not in done.stderr


def test_gspo_averages_sequences_unless_a_mode_is_given():
    """Choosing GSPO kept the token-mean default, so long sequences weighed more than short ones (9:1 for 9 and 1
    tokens); the paper's and verl's mean over sequences of their tokens' mean is its default now."""
    assert load_config(None, ["rl.actor.policy_loss=gspo"]).rl.actor.loss_agg_mode == "seq-mean-token-mean"
    assert load_config(None, ["rl.actor.policy_loss={name: gspo}"]).rl.actor.loss_agg_mode == "seq-mean-token-mean"
    given = ["rl.actor.loss_agg_mode=token-mean", "rl.actor.policy_loss=gspo"]
    assert load_config(None, given).rl.actor.loss_agg_mode == "token-mean"
    assert load_config(None, []).rl.actor.loss_agg_mode == "token-mean"

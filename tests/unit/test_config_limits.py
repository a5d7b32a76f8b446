"""Settings that are not supported yet fail with a clear error instead of being ignored."""

import pytest

from infra.config import ConfigError, load_config


def test_more_than_one_worker_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="num_devices_per_node=2, num_nodes=1: training runs on one worker"):
        load_config(None, ["ray.num_devices_per_node=2"])


def test_unknown_evaluation_engine_is_refused_with_the_choices():
    assert load_config(None, ["evaluate.engine=vllm"]).evaluate.engine == "vllm"
    with pytest.raises(ConfigError, match=r"evaluate.engine = 'sglang'.*'auto', 'vllm' or 'hf'"):
        load_config(None, ["evaluate.engine=sglang"])

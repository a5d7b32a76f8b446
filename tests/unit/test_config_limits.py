"""Settings that are not supported yet fail with a clear error instead of being ignored."""

import pytest

from infra.config import ConfigError, load_config


def test_workers_must_divide_every_mini_batch():
    assert load_config(None, ["rl.enabled=true", "ray.num_devices_per_node=2", "ray.num_nodes=2"]).ray.num_nodes == 2
    with pytest.raises(ConfigError, match=r"16 \* 8 = 128 samples per mini-batch must be divisible by the number "
                                          r"of workers, ray.num_devices_per_node \* ray.num_nodes = 3 \* 1 = 3"):
        load_config(None, ["rl.enabled=true", "ray.num_devices_per_node=3"])


def test_unknown_evaluation_engine_is_refused_with_the_choices():
    assert load_config(None, ["evaluate.engine=vllm"]).evaluate.engine == "vllm"
    with pytest.raises(ConfigError, match=r"evaluate.engine = 'sglang'.*'auto', 'vllm' or 'hf'"):
        load_config(None, ["evaluate.engine=sglang"])

"""Settings that are not supported yet fail with a clear error instead of being ignored."""

import pytest

from infra.config import ConfigError, load_config


def test_workers_must_divide_every_mini_batch():
    assert load_config(None, ["rl.enabled=true", "ray.num_devices_per_node=2", "ray.num_nodes=2"]).ray.num_nodes == 2
    with pytest.raises(ConfigError, match=r"16 \* 8 = 128 samples per mini-batch must be divisible by the number "
                                          r"of workers, ray.num_devices_per_node \* ray.num_nodes = 3 \* 1 = 3"):
        load_config(None, ["rl.enabled=true", "ray.num_devices_per_node=3"])


def test_tensor_parallel_rollout_needs_vllm_or_cuda_and_must_divide_the_workers():
    tp2 = ["rl.enabled=true", "ray.num_devices_per_node=4", "rl.rollout.tensor_model_parallel_size=2"]
    assert load_config(None, tp2).rl.rollout.tensor_model_parallel_size == 2
    assert load_config(None, tp2 + ["rl.rollout.engine=cuda"]).rl.rollout.engine == "cuda"
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 needs rl.rollout.engine=vllm or cuda"):
        load_config(None, tp2 + ["rl.rollout.engine=hf"])
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 must divide the number of generating "
                       r"workers, 4"):
        load_config(None, tp2 + ["rl.rollout.tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError, match=r"must divide the number of generating workers, 3 "):
        load_config(None, tp2 + ["ray.rollout_devices_per_node=3"])


def test_sequence_parallel_size_must_divide_the_trainers_and_fp8_needs_the_cuda_engine():
    sp = ["rl.enabled=true", "ray.num_devices_per_node=4", "rl.actor.ulysses_sequence_parallel_size=2"]
    assert load_config(None, sp).rl.actor.ulysses_sequence_parallel_size == 2
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=3 must divide the number of trainer "
                       r"workers, ray.num_devices_per_node \* ray.num_nodes = 4"):
        load_config(None, sp[:2] + ["rl.actor.ulysses_sequence_parallel_size=3"])
    fp8 = ["rl.enabled=true", "rl.rollout.quantization=fp8"]
    assert load_config(None, fp8 + ["rl.rollout.engine=cuda"]).rl.rollout.quantization == "fp8"
    with pytest.raises(ConfigError, match=r"quantization=fp8 needs rl.rollout.engine=cuda"):
        load_config(None, fp8)


def test_asynchronous_modes_need_rollout_devices_and_pushes_within_the_staleness_bound():
    fully = ["rl.enabled=true", "rl.async_training.mode=fully_async"]
    with pytest.raises(ConfigError, match=r"mode=fully_async generates on devices of its own.*"
                       r"ray.rollout_devices_per_node"):
        load_config(None, fully)
    cfg = load_config(None, fully + ["ray.rollout_devices_per_node=1"])
    assert (cfg.ray.num_trainers, cfg.ray.num_rollout_workers, cfg.rl.async_training.staleness) == (1, 1, 1)
    with pytest.raises(ConfigError, match=r"trigger_parameter_sync_step=3 .* raise max_staleness \(=1\) to at least "
                       r"that"):
        load_config(None, fully + ["ray.rollout_devices_per_node=1", "rl.async_training.trigger_parameter_sync_step=3"])
    assert load_config(None, ["rl.async_training.mode=one_step_off", "ray.rollout_devices_per_node=2"]
                       ).rl.async_training.staleness == 1


def test_unknown_evaluation_engine_is_refused_with_the_choices():
    assert load_config(None, ["evaluate.engine=vllm"]).evaluate.engine == "vllm"
    with pytest.raises(ConfigError, match=r"evaluate.engine = 'sglang'.*'auto', 'vllm', 'cuda' or 'hf'"):
        load_config(None, ["evaluate.engine=sglang"])


def test_sft_ranks_must_divide_the_sft_batch():
    assert load_config(None, ["sft.train_batch_size=48", "ray.num_devices_per_node=3"]).ray.num_trainers == 3
    with pytest.raises(ConfigError, match=r"sft.train_batch_size=32 must be divisible by the number of SFT ranks, "
                                          r"ray.num_devices_per_node \* ray.num_nodes = 3"):
        load_config(None, ["ray.num_devices_per_node=3"])
    assert load_config(None, ["sft.enabled=false", "ray.num_devices_per_node=3"]).sft.enabled is False

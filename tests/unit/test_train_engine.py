"""The typed algorithm variants (infra/algorithms.py) and the one update loop (stages/workers/train_engine.py)."""

from __future__ import annotations

import math

import pytest
import torch

from infra.algorithms import AdvEstimator, PolicyLoss, variant_names
from infra.config import ConfigError, load_config
from infra.trainer_config import TrainerConfig
from stages.batch import build_batch
from stages.core import ADV_ESTIMATORS, POLICY_LOSSES
from stages.core.cov_losses import kl_cov_policy_loss
from stages.workers.actor_loss import actor_loss
from stages.workers.train_engine import TrainEngine, global_denominators


def test_every_registered_estimator_and_loss_has_a_config_variant():
    assert sorted(variant_names(AdvEstimator)) == sorted(ADV_ESTIMATORS.keys())
    assert sorted(variant_names(PolicyLoss)) == sorted(POLICY_LOSSES.keys())


def test_variants_take_a_name_or_parameters_in_any_order():
    est = load_config(None, ["rl.algorithm.adv_estimator.lam=0.9", "rl.algorithm.adv_estimator=gae"])
    assert est.rl.algorithm.adv_estimator.params() == {"gamma": 1.0, "lam": 0.9}
    est = load_config("recipes/gsm8k_ppo.yaml", ["rl.algorithm.adv_estimator.lam=0.95"])
    assert est.rl.algorithm.adv_estimator.lam == 0.95 and est.rl.uses_critic
    assert not load_config(None, []).rl.uses_critic  # grpo
    assert load_config(None, ["rl.algorithm.adv_estimator=remax"]).rl.algorithm.adv_estimator.needs_greedy_baseline
    switched = load_config("recipes/gsm8k_ppo.yaml", ["rl.algorithm.adv_estimator=grpo"])
    assert switched.rl.algorithm.adv_estimator.name == "grpo" and not switched.rl.uses_critic


@pytest.mark.parametrize("override, message", [
    ("rl.algorithm.adv_estimator.lam=0.9", "adv_estimator 'grpo' takes: epsilon, name, norm_adv_by_std_in_grpo"),
    ("rl.algorithm.gamma=0.9", "write rl.algorithm.adv_estimator.gamma"),
    ("rl.actor.lr=1e-5", "rl.actor.optim.lr"),
    ("rl.algorithm.adv_estimator=ppo", "does not match any of the expected tags: 'gae', 'grpo'"),
])
def test_misplaced_algorithm_keys_name_the_fix(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, [override])


def _micro(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch = build_batch([[5, 6]] * 4, [[7, 8, 9, 2]] * 4, [[-1.0] * 4] * 4, pad_token_id=0)
    batch.tensors["old_logprobs"] = -torch.rand(4, 4, generator=g, dtype=torch.float64)
    batch.tensors["advantages"] = torch.randn(4, 4, generator=g, dtype=torch.float64)
    return batch


def test_kl_cov_parameters_from_config_reach_the_loss():
    micro = _micro()
    logprobs = micro.tensors["old_logprobs"] + 0.3 * torch.randn(4, 4, dtype=torch.float64,
                                                                  generator=torch.Generator().manual_seed(1))
    model = lambda **kwargs: (logprobs, torch.zeros_like(logprobs))  # noqa: E731
    denominators = global_denominators(micro.response_mask)
    for coef in (0.1, 3.0):
        cfg = load_config(None, ["rl.actor.policy_loss=kl_cov", f"rl.actor.policy_loss.ppo_kl_coef={coef}",
                                 "rl.actor.policy_loss.kl_cov_ratio=0.5"])
        loss, _ = actor_loss(model, micro, denominators, cfg, lambda x: x if isinstance(x, dict) else {})
        t = micro.tensors
        expected, _ = kl_cov_policy_loss(t["old_logprobs"], logprobs, t["advantages"], micro.response_mask,
                                         clip_ratio_low=0.2, clip_ratio_high=0.2, **denominators,
                                         kl_cov_ratio=0.5, ppo_kl_coef=coef)
        assert torch.allclose(loss, expected)
    assert not math.isclose(float(kl_cov_policy_loss(t["old_logprobs"], logprobs, t["advantages"],
                                                     micro.response_mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                                     kl_cov_ratio=0.5, ppo_kl_coef=0.1)[0]), float(loss))


def test_actor_and_critic_roles_report_the_same_loop_metrics_and_skipped_steps():
    cfg = TrainerConfig(micro_batch_size=2, grad_sync_every_micro_batch=True, reshard_after_forward=True)
    metrics = {}
    for role in ("actor", "critic"):
        model = torch.nn.Linear(3, 1)
        engine = TrainEngine(role, model, cfg, total_steps=4, mini_rows=2)
        batch = _micro()
        calls = []

        def loss_fn(micro, denominators):
            calls.append(len(micro))
            bad = len(calls) == 1  # the first mini-batch's gradient is NaN: its step is skipped
            loss = model(torch.ones(len(micro), 3)).sum() * (float("nan") if bad else 1.0)
            return loss, {f"{role}/custom": loss.detach()}

        metrics[role] = engine.update(batch, loss_fn)
        assert calls == [2, 2] and metrics[role][f"{role}/skipped_steps"] == 1
        assert metrics[role][f"{role}/lr"] == cfg.optim.lr
    strip = lambda m, role: {k.removeprefix(role + "/") for k in m}  # noqa: E731
    assert strip(metrics["actor"], "actor") == strip(metrics["critic"], "critic") == {
        "custom", "grad_norm", "loss", "lr", "skipped_steps"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as intended
def test_a_checkpoint_resumes_the_dropout_stream(tmp_path):
    """RL workers saved weights, optimizer and schedule but not their generators: with LoRA dropout a resumed run
    drew other masks than the run it continues."""
    engine = TrainEngine("actor", torch.nn.Linear(3, 1), TrainerConfig(), total_steps=4, mini_rows=2)
    torch.manual_seed(7)
    engine.save(tmp_path)
    expected = torch.nn.functional.dropout(torch.ones(16), 0.5)
    torch.manual_seed(8)  # the resumed process starts from its own seed
    engine.load(tmp_path)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(16), 0.5), expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as intended
def test_a_checkpoint_before_the_first_step_changes_nothing_that_is_trained(tmp_path):
    """torch's get_optimizer_state_dict makes an unstepped optimizer's state by a step with lr 0: an actor saved
    during the critic's warmup then took its first update as AdamW's step 2 (~0.74x), and so did a run resumed from
    that checkpoint."""
    cfg = TrainerConfig(micro_batch_size=4, grad_sync_every_micro_batch=True, reshard_after_forward=True)
    batch = build_batch([[1, 2]] * 4, [[3, 4, 5]] * 4, [[0.0] * 3] * 4, pad_token_id=0)

    def first_update(save: bool, resume: bool = False):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        engine = TrainEngine("actor", model, cfg, total_steps=4, mini_rows=4)
        folder = tmp_path / f"ckpt-{save}-{resume}"
        if save:
            folder.mkdir()
            engine.save(folder)
        if resume:
            engine.load(folder)
        engine.update(batch, lambda micro, den: (model(torch.ones(3)).sum(), {}))
        return model.weight.detach().clone(), float(engine.optimizer.state[model.weight]["step"])

    plain = first_update(save=False)
    assert plain[1] == 1.0
    for saved in (first_update(save=True), first_update(save=True, resume=True)):
        assert saved[1] == 1.0 and torch.equal(saved[0], plain[0])

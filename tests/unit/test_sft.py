"""SFT: the loss is over response tokens only, micro-batching does not change the step, resume is exact."""

import copy
import math

import pytest
import torch
from safetensors import safe_open

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trainer_config import OptimConfig
from stages.model.loading import load_model, load_tokenizer
from stages.model.optim import lr_multiplier
from stages.model.policy import TokenLogprobs
from stages.sft import SFTTrainer, run_sft, sft_policy, summed_token_nll, train_step
from stages.sft_data import SFTExample, num_target_tokens, sft_batch, tokenize_sft
from tests.conftest import TINY_OVERRIDES
from tests.tolerances import assert_close_sgd_steps


@pytest.fixture(scope="module")
def examples(tiny_config, tiny_data_dir, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    return tokenize_sft(tiny_data_dir / "sft_train.parquet", tokenizer, tiny_config.data)


def test_targets_are_response_tokens_ending_with_eos(examples, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    e = examples[0]
    response = tokenizer.decode(e.input_ids[e.num_prompt_tokens :])
    assert response.endswith("<|im_end|>") and "####" in response
    assert tokenizer.decode(e.input_ids[: e.num_prompt_tokens]).endswith("<|im_start|>assistant\n")


def test_loss_is_summed_over_response_tokens_only(tiny_config, tiny_model_dir):
    model = load_model(tiny_model_dir, tiny_config.model)
    ex = [SFTExample([5, 6, 7, 8, 9], 3), SFTExample([5, 6, 7], 2), SFTExample([5, 6, 7, 8, 9], 2, [1, 0, 1])]
    logp = [torch.log_softmax(model(input_ids=torch.tensor([e.input_ids])).logits[0].float(), -1) for e in ex]
    # example 0 predicts ids[3]=8 at position 2 and ids[4]=9 at 3; example 1 ids[2]=7 at 1; example 2 (multi-turn,
    # its second response token a tool token) ids[2]=7 at 1 and ids[4]=9 at 3
    expected = -(logp[0][2, 8] + logp[0][3, 9] + logp[1][1, 7] + logp[2][1, 7] + logp[2][3, 9])
    assert not sft_policy(model, cuda=False).pack  # the padded batch on a CPU; packed rows on CUDA (below)
    for pack in (True, False):
        policy = TokenLogprobs(model, pack=pack)
        torch.testing.assert_close(summed_token_nll(policy, sft_batch(ex, pad_id=0)), expected, rtol=1e-6, atol=1e-6)
    assert num_target_tokens(ex) == 5


def test_micro_batching_does_not_change_the_step(tiny_config, tiny_model_dir, examples):
    batch = examples[:8]
    before = load_model(tiny_model_dir, tiny_config.model).state_dict()
    params = {}
    for micro in (8, 3, 1):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir, tiny_config.model).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # not Adam: its steps amplify float differences
        loss, _ = train_step(sft_policy(model, cuda=False), opt, batch, micro, grad_clip=1e9, pad_id=0)
        params[micro] = (loss, copy.deepcopy(model.state_dict()))
    for micro in (3, 1):
        # the token mean of ~6-nat losses, each within ~1e-6 of its float64 value, summed in another order
        torch.testing.assert_close(params[micro][0], params[8][0], rtol=1e-5, atol=1e-6)
        assert_close_sgd_steps(params[micro][1], params[8][1], before, f"micro-batches of {micro}")


def test_a_step_whose_gradient_norm_is_not_finite_leaves_the_weights_alone(tiny_config, tiny_model_dir, examples):
    """SFT stepped anyway (RL skipped such steps): one overflow made every weight NaN for the rest of the run."""
    model = load_model(tiny_model_dir, tiny_config.model).train()
    before = copy.deepcopy(model.state_dict())
    model.get_output_embeddings().weight.register_hook(lambda grad: grad * float("nan"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, grad_norm = train_step(sft_policy(model, cuda=False), opt, examples[:4], 4, grad_clip=1.0, pad_id=0)
    assert math.isnan(float(grad_norm))
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_validation_pads_a_rank_share_without_counting_the_padding(tiny_config, tiny_model_dir, examples):
    # sharded, every rank runs as many forwards: a shorter share is padded with examples whose tokens do not count
    trainer = SFTTrainer(tiny_config, str(tiny_model_dir))
    share = examples[:17]  # micro-batches of 16: one full, one of 1 row
    padded = share + examples[17:20]
    assert trainer.validation_sum(padded, real=17) == pytest.approx(trainer.validation_sum(share, real=17), rel=1e-6)
    assert trainer.validation_sum(share, real=16) < trainer.validation_sum(share, real=17)


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, lr_scheduler="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, cfg, 110) == pytest.approx(0.1)  # (0+1)/10
    assert lr_multiplier(9, cfg, 110) == pytest.approx(1.0)  # end of warmup
    assert lr_multiplier(60, cfg, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert lr_multiplier(110, cfg, 110) == pytest.approx(0.1)
    linear = OptimConfig(lr=1.0, warmup_steps=0, lr_scheduler="linear")
    assert lr_multiplier(25, linear, 100) == pytest.approx(0.75)


class StopAt(Tracker):
    """A tracker that kills the run (raises) when it is asked to log step `stop`."""

    def __init__(self, stop: int):
        super().__init__([])
        self.stop = stop
        self.seen: list[dict] = []

    def log(self, metrics, step):
        if step == self.stop:
            raise KeyboardInterrupt(f"killed at step {step}")
        self.seen.append({"step": step, **metrics})


def _run(cfg, model_dir, data_dir, out, store, tracker):
    ckpts = StoreCheckpoints(store, "sft-test", max_to_keep=2)
    return run_sft(cfg, model_dir, data_dir, out, ckpts, tracker)


def test_resume_after_a_kill_continues_exactly(tiny_model_dir, tiny_data_dir, tmp_path):
    cfg = load_config(None, TINY_OVERRIDES + ["sft.epochs=2", "sft.save_freq=3"])  # 16 steps
    straight = StopAt(stop=-1)
    _run(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "a", ArtifactStore(str(tmp_path / "s1")), straight)

    store = ArtifactStore(str(tmp_path / "s2"))
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "b", store, StopAt(stop=11))
    assert [m.metadata["step"] for m in store.versions("checkpoint", "sft-test")] == [6, 9]  # kept last 2
    resumed = StopAt(stop=-1)
    _run(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "b", store, resumed)

    assert resumed.seen[0]["step"] == 10  # continued after the checkpoint at step 9
    # Steps 10-16 again, in this process, from the exact saved weights and optimizer state, on the same batches
    # in the same order: the same bits. (No tolerance would do instead: Adam turns any float difference in a
    # gradient entry near 0 into a difference of up to an lr-sized step.)
    by_step = {m["step"]: m for m in straight.seen}
    for m in resumed.seen:
        assert m["train/lr"] == by_step[m["step"]]["train/lr"]
        assert m["train/loss"] == by_step[m["step"]]["train/loss"]
    a = load_model(tmp_path / "a", cfg.model).state_dict()
    b = load_model(tmp_path / "b", cfg.model).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def learned(model_dir, data_dir, tmp_path, *overrides):
    """Two epochs of SFT at a high learning rate; the training loss must fall by > 0.5 nats."""
    cfg = load_config(None, TINY_OVERRIDES + ["sft.epochs=2", "sft.optim.lr=1e-2", *overrides])
    tracker = StopAt(stop=-1)
    result = _run(cfg, model_dir, data_dir, tmp_path / "out", ArtifactStore(str(tmp_path / "s")), tracker)
    first, last = tracker.seen[0]["train/loss"], tracker.seen[-1]["train/loss"]
    assert last < first - 0.5, (first, last)
    return result


def test_sft_learns_and_lora_trains_only_adapters(tiny_model_dir, tiny_data_dir, tmp_path):
    result = learned(tiny_model_dir, tiny_data_dir, tmp_path, "model.lora.rank=4")
    assert math.isfinite(result.final_metrics["val/loss"])
    merged = load_model(result.model_dir, load_config(None).model, trainable=False).state_dict()  # plain names
    base = load_model(tiny_model_dir, load_config(None).model, trainable=False).state_dict()
    assert set(merged) == set(base)
    changed = [n for n in base if not torch.equal(base[n], merged[n])]
    assert changed and all("proj" in n for n in changed)  # LoRA touched linear layers only


def test_gradient_checkpointing_gives_the_same_step(tiny_config, tiny_model_dir, examples):
    batch = examples[:8]
    before = load_model(tiny_model_dir, tiny_config.model).state_dict()
    states = []
    for checkpointing in (False, True):
        cfg = tiny_config.model.model_copy(update={"gradient_checkpointing": checkpointing})
        model = load_model(tiny_model_dir, cfg).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(sft_policy(model, cuda=False), opt, batch, 4, grad_clip=1e9, pad_id=0)
        states.append(model.state_dict())
    assert_close_sgd_steps(states[1], states[0], before)


def test_bf16_sft_trains_fp32_master_weights_and_saves_bf16(tiny_model_dir, tiny_data_dir, tmp_path):
    # model.dtype is what forwards compute in (autocast); the optimizer updates fp32 weights, whose small
    # steps bf16 weights would round away; the saved model is in model.dtype
    result = learned(tiny_model_dir, tiny_data_dir, tmp_path, "model.dtype=bfloat16")
    with safe_open(str(result.model_dir / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled layers, flash attention)")
def test_sft_on_cuda_packed_and_compiled_under_autocast_matches_the_plain_path(tiny_config, tiny_model_dir, examples):
    """fp32 master weights, bf16 autocast (as run_sft on a GPU): the packed, compiled path gives the padded eager
    path's loss and gradients."""
    batch = examples[:8]
    results = []
    for fast in (False, True):
        model = load_model(tiny_model_dir, tiny_config.model).cuda().train()
        policy = sft_policy(model, cuda=True) if fast else TokenLogprobs(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = summed_token_nll(policy, sft_batch(batch, pad_id=0)) / num_target_tokens(batch)
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss0, g0), (loss1, g1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0.02, atol=0.02)
    assert float((g1 - g0).norm() / g0.norm()) < 0.05


def test_offloaded_sft_trains_as_the_plain_path_and_resumes_exactly(tiny_model_dir, tiny_data_dir, tmp_path):
    # sft.offload: FSDP2 in a world of this one process (on a GPU, weights, gradients and optimizer state in host
    # memory); on a CPU the same sharded path: its steps are the plain path's, its DCP checkpoints resume exactly
    cfg = load_config(None, TINY_OVERRIDES + ["sft.epochs=2", "sft.save_freq=3"])  # 16 steps
    plain = StopAt(stop=-1)
    _run(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "plain", ArtifactStore(str(tmp_path / "s0")), plain)
    offloaded = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"offload": True})})
    straight = StopAt(stop=-1)
    _run(offloaded, tiny_model_dir, tiny_data_dir, tmp_path / "a", ArtifactStore(str(tmp_path / "s1")), straight)
    for got, want in zip(straight.seen, plain.seen):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5, abs=1e-6), got["step"]

    store = ArtifactStore(str(tmp_path / "s2"))
    with pytest.raises(KeyboardInterrupt):
        _run(offloaded, tiny_model_dir, tiny_data_dir, tmp_path / "b", store, StopAt(stop=8))
    resumed = StopAt(stop=-1)
    _run(offloaded, tiny_model_dir, tiny_data_dir, tmp_path / "b", store, resumed)
    assert resumed.seen[0]["step"] == 7  # after the checkpoint at step 6
    by_step = {m["step"]: m for m in straight.seen}
    assert all(m["train/loss"] == by_step[m["step"]]["train/loss"] for m in resumed.seen)
    a = load_model(tmp_path / "a", cfg.model).state_dict()
    b = load_model(tmp_path / "b", cfg.model).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.distributed.is_initialized()  # the world of one is gone again


def test_a_checkpoint_of_the_other_layout_is_refused_with_the_fix(tiny_model_dir, tiny_data_dir, tmp_path):
    cfg = load_config(None, TINY_OVERRIDES + ["sft.save_freq=3"])
    store = ArtifactStore(str(tmp_path / "s"))
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "a", store, StopAt(stop=5))
    offloaded = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"offload": True})})
    with pytest.raises(RuntimeError, match=r"holds one unsharded state, but this run trains sharded.*Resume with the "
                                           r"settings that wrote it, or remove"):
        _run(offloaded, tiny_model_dir, tiny_data_dir, tmp_path / "b", store, StopAt(stop=-1))
    assert not torch.distributed.is_initialized()  # the world of one made for it is gone again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FSDP2's CPU offload)")
def test_offloaded_sft_on_cuda_learns_and_saves_the_model_dtype(tiny_model_dir, tiny_data_dir, tmp_path):
    result = learned(tiny_model_dir, tiny_data_dir, tmp_path, "sft.offload=true", "model.dtype=bfloat16")
    with safe_open(str(result.model_dir / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}


def test_truncated_prompts_are_counted_in_the_warning(tiny_config, tiny_data_dir, tiny_model_dir, caplog):
    """data.truncation=right cut every prompt (its assistant header too) without a word."""
    tokenizer = load_tokenizer(tiny_model_dir)
    data = tiny_config.data.model_copy(update={"max_prompt_length": 4, "truncation": "right",
                                               "filter_overlong_prompts": False})
    with caplog.at_level("WARNING", logger="stages.sft_data"):
        examples = tokenize_sft(tiny_data_dir / "sft_train.parquet", tokenizer, data)
    assert all(e.num_prompt_tokens == 4 for e in examples)
    assert f"{len(examples)} truncated (data.truncation=right)" in caplog.text


def test_a_multi_turn_row_ending_with_a_tool_message_is_refused_naming_it(tiny_config, tiny_model_dir, tmp_path):
    """The pending tool messages after the last assistant turn were never added: the row trained as if they were not
    there, silently."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    good = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "#### 4"}]
    rows = [{"prompt": prompt, "response": "#### 4", "turns": turns} for turns in (good, good[:2])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft_train.parquet")
    with pytest.raises(ValueError, match=r"^sft_train\.parquet row 1: its turns end with 1 tool message\(s\): the "
                                         r"last turn must be the assistant's answer$"):
        tokenize_sft(tmp_path / "sft_train.parquet", load_tokenizer(tiny_model_dir), tiny_config.data)

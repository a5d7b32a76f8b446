"""The merge stage for real: a short RL run (Ray worker, FSDP2 actor) checkpoints into a store; the merged
folder loads in transformers with the same logprobs and entropy as the live worker's FSDP model, with and
without LoRA; the command line merges any checkpoint of the store; vLLM serves the merged folder with the
same greedy tokens as transformers (fp32). One Ray instance for the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from infra.checkpoints import StoreCheckpoints
from infra.config import load_config
from infra.store import ArtifactStore
from infra.tracking import Tracker
from infra.trajectories import RunTables
from stages.batch import build_batch
from stages.merge import (
    checkpoint_metadata,
    hf_state,
    merge_checkpoint,
    merge_source,
    read_model_state,
    resolve_checkpoint,
)
from tests.conftest import TINY_OVERRIDES
from tests.tolerances import greedy_margin

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]
PROJECT = Path(__file__).resolve().parents[2]
RL = ["rl.enabled=true", "rl.total_steps=2", "rl.train_batch_size=8", "rl.rollout.n=4", "rl.rollout.engine=hf",
      "rl.actor.ppo_mini_batch_size=4", "rl.actor.micro_batch_size=16", "rl.test_freq=0", "rl.save_freq=0",
      "rl.val_before_train=false", "rl.reward.num_workers=1", "data.max_response_length=16"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "rl.actor.optim.lr=2e-2"]
# fp32, the same weights through FSDP2 (padded batch, chunked head) and through plain transformers (one row):
# these models' (weights of std 0.15) logprobs are within ~2e-5 of their float64 values, so twice that at most
# apart; 1e-4 leaves a margin (as LOGPROB_ATOL in test_vllm_engine.py).
ATOL = 1e-4
# A random model never solves the arithmetic, so every GRPO advantage would be 0 and nothing would change; this
# reward varies within groups (about half the samples earn it), so two steps move the weights.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str) % 2)
'''


def spread_model(src: Path, out: Path, std: float = 0.15) -> Path:
    """A copy of a tiny model with 2-D weights drawn wider than the 0.02 init, so that greedy decoding does not
    repeat one token and argmax margins are not near-ties (engines differing by 1e-6 then agree)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0.0, std)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def init_model(tiny_model_dir, tmp_path_factory) -> Path:
    return spread_model(tiny_model_dir, tmp_path_factory.mktemp("merge-init"))


@pytest.fixture(scope="module")
def probe(tiny_data_dir, init_model):
    """Prompts from the held-out split with arbitrary (seeded) responses of different lengths: teacher-forced
    logprobs and entropy at every response position compare whole output distributions."""
    from stages.data_prep import load_prompts
    from stages.model.loading import load_tokenizer

    tokenizer = load_tokenizer(init_model)
    prompts = load_prompts(tiny_data_dir / "validation.parquet", tokenizer, load_config(None, TINY_OVERRIDES).data)
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, len(tokenizer), (length,), generator=gen).tolist() for length in (5, 12, 1, 9)]
    return prompts.prompt_ids[:4], responses, tokenizer.pad_token_id


class Trained:
    """A finished RL run: its store, its final checkpoint, and what its live worker computed on the probe."""

    def __init__(self, store: ArtifactStore, name: str, worker_logprobs: tuple[torch.Tensor, torch.Tensor],
                 eos_token_id: int):
        self.store, self.name, self.eos_token_id = store, name, eos_token_id
        self.worker_logprobs = worker_logprobs  # (logprobs, entropy), (B, R), from the FSDP-sharded actor
        self.checkpoint = StoreCheckpoints(store, name, 1).latest_ref()


def _train(tiny_data_dir, init_model, tmp_path_factory, probe, name: str, *overrides) -> Trained:
    """RL for two steps (the last one checkpointed), then the worker's logprobs on the probe; the worker is
    stopped before returning, so that the module's runs do not hold Ray's CPUs at the same time."""
    from stages.rl import RLTrainer

    folder = tmp_path_factory.mktemp(name)
    (folder / "reward.py").write_text(REWARD)
    cfg = load_config(None, TINY_OVERRIDES + RL + [f"rl.reward.custom_path={folder / 'reward.py'}", *overrides])
    store = ArtifactStore(str(folder / "store"))
    checkpoints = StoreCheckpoints(store, name, 1, {"init_model": str(init_model)}, checkpoint_metadata(cfg.model))
    trainer = RLTrainer(cfg, str(init_model), tiny_data_dir, checkpoints, RunTables(store, name), Tracker([]))
    try:
        trainer.fit()
        prompts, responses, pad = probe
        batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad)
        worker = trainer.actor.call_one("compute_logprobs", batch, "actor", True)
    finally:
        trainer.close()
    return Trained(store, name, worker, trainer.tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def full(tiny_data_dir, init_model, tmp_path_factory, probe):
    return _train(tiny_data_dir, init_model, tmp_path_factory, probe, "rl-full")


@pytest.fixture(scope="module")
def lora(tiny_data_dir, init_model, tmp_path_factory, probe):
    return _train(tiny_data_dir, init_model, tmp_path_factory, probe, "rl-lora", *LORA)


@torch.no_grad()
def hf_logprobs(model_dir: Path, probe) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row: log softmax(logits) of each response token and the entropy there, from transformers alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logprobs, entropies = [], []
    for prompt, response in zip(*probe[:2]):
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()  # (R, V)
        logp = torch.log_softmax(logits, dim=-1)
        logprobs.append(logp.gather(-1, torch.tensor(response)[:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return logprobs, entropies


def assert_same_model(trained: Trained, merged: Path, probe, init_model: Path) -> None:
    worker_lp, worker_ent = trained.worker_logprobs
    merged_lp, merged_ent = hf_logprobs(merged, probe)
    init_lp, _ = hf_logprobs(init_model, probe)
    for row, response in enumerate(probe[1]):
        r = len(response)
        torch.testing.assert_close(merged_lp[row], worker_lp[row, :r], rtol=0, atol=ATOL)
        torch.testing.assert_close(merged_ent[row], worker_ent[row, :r], rtol=0, atol=ATOL)
    change = max((merged_lp[i] - init_lp[i]).abs().max().item() for i in range(len(probe[1])))
    # the untrained model would fail the comparison above by far: it tells trained from untrained weights
    assert change > 10 * ATOL, f"RL did not change the model (max logprob change {change:.2e}): the test proves nothing"


def test_merged_full_model_equals_the_worker(full, probe, init_model, tmp_path):
    source = merge_source(full.store, full.checkpoint)
    assert source.base_model == str(init_model) and source.step == 2 and source.lora_alpha is None
    result = merge_checkpoint(source, tmp_path / "merged")
    assert result.lora_rank is None and result.dtype == "float32"
    assert_same_model(full, tmp_path / "merged", probe, init_model)
    files = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    from transformers import AutoTokenizer, GenerationConfig

    assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template is not None
    assert GenerationConfig.from_pretrained(tmp_path / "merged").eos_token_id == \
        GenerationConfig.from_pretrained(init_model).eos_token_id


def test_merged_lora_model_equals_the_worker(lora, probe, init_model, tmp_path):
    source = merge_source(lora.store, lora.checkpoint)
    assert source.lora_alpha == 8.0  # from the checkpoint manifest's model config
    result = merge_checkpoint(source, tmp_path / "merged")
    assert result.lora_rank == 4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "lora" in k or "base_layer" in k]  # plain HF names
    assert_same_model(lora, tmp_path / "merged", probe, init_model)


def test_lora_checkpoint_without_alpha_is_refused(lora):
    state = read_model_state(lora.store.get_dir(lora.checkpoint))
    with pytest.raises(ValueError, match="--lora-alpha"):
        hf_state(state, None)


def test_wrong_base_model_is_refused(full, tiny_config, tiny_data_dir, tmp_path):
    from stages.data_prep import corpus_texts
    from stages.model.tiny import build_tiny_model

    other = build_tiny_model(tiny_config.model.tiny.model_copy(update={"num_layers": 1}), corpus_texts(tiny_data_dir),
                             0, tmp_path / "other")
    source = merge_source(full.store, full.checkpoint, base_model=str(other))
    with pytest.raises(ValueError, match=r"do not match the base model.*unexpected=\['model.layers.1"):
        merge_checkpoint(source, tmp_path / "merged")


def test_unknown_checkpoint_lists_the_known_ones(full):
    with pytest.raises(ValueError, match=r"no checkpoint named 'rl-nope'.*known: \['rl-full'\]"):
        resolve_checkpoint(full.store, "rl-nope")
    with pytest.raises(ValueError, match=r"--step 7: checkpoint 'rl-full' has steps \[2\]"):
        resolve_checkpoint(full.store, "rl-full", step=7)


def test_command_line_merges_a_checkpoint_into_a_folder_and_the_store(full, probe, init_model, tmp_path):
    out = tmp_path / "cli-merged"
    # what killed merges left: into this --out an hour ago (removed), into it now (a live one: kept), elsewhere
    killed, live, other = (tmp_path / name for name in (".cli-merged.merge-a1", ".cli-merged.merge-b2", ".x.merge-c3"))
    for folder in (killed, live, other):
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "part").write_bytes(b"0")
    for path in (killed, killed / "model", killed / "model" / "part", other / "model" / "part"):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    proc = subprocess.run(
        [sys.executable, "-m", "stages.merge", "--root", full.store.root, "--checkpoint", full.name, "--out", str(out),
         "--name", "rl-merged"], cwd=PROJECT, env={**os.environ, "PYTHONPATH": str(PROJECT)},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not killed.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.glob(".cli-merged.merge-*")) == [live.name]  # its own temp folder gone
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["checkpoint"] == str(full.checkpoint) and report["out"] == str(out)
    [manifest] = full.store.versions("model", "rl-merged")
    assert str(manifest.ref) == report["model"]
    assert manifest.inputs == {"checkpoint": str(full.checkpoint), "base_model": str(init_model)}
    assert manifest.metadata["checkpoint_step"] == 2
    assert_same_model(full, out, probe, init_model)
    # the stored version holds the same files as the folder
    stored = full.store.get_dir(manifest.ref)
    assert (stored / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    again = subprocess.run([sys.executable, "-m", "stages.merge", "--root", full.store.root, "--checkpoint",
                            full.name, "--out", str(out)], cwd=PROJECT, env={**os.environ, "PYTHONPATH": str(PROJECT)},
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "not an empty folder" in again.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sft_lora_checkpoint_merges_like_peft(tiny_model_dir, tiny_data_dir, tmp_path, dtype):
    """An intermediate SFT checkpoint (plain torch state with peft names, fp32 master weights whatever model.dtype
    is) merges to what peft's own merge_and_unload makes of the same state in fp32, cast to the run's model.dtype;
    config.json says that dtype."""
    from stages.model.loading import DTYPES, load_model
    from stages.sft import CHECKPOINT_FILE, run_sft

    cfg = load_config(None, TINY_OVERRIDES + ["model.lora.rank=4", "model.lora.alpha=8", "sft.optim.lr=1e-2",
                                              "sft.save_freq=4", f"model.dtype={dtype}"])  # 8 steps: one at step 4
    store = ArtifactStore(str(tmp_path / "store"))
    checkpoints = StoreCheckpoints(store, "sft-test", 2, {"base_model": str(tiny_model_dir)},
                                   checkpoint_metadata(cfg.model))
    run_sft(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "final", checkpoints, Tracker([]))
    ref = resolve_checkpoint(store, "sft-test")
    source = merge_source(store, ref)
    assert source.step == 4 and source.base_model == str(tiny_model_dir) and source.lora_alpha == 8.0
    assert source.dtype == dtype  # from the checkpoint manifest's model config
    merged = merge_checkpoint(source, tmp_path / "merged")
    assert merged.lora_rank == 4 and merged.dtype == dtype

    fp32 = cfg.model.model_copy(update={"dtype": "float32"})
    peft_model = load_model(tiny_model_dir, fp32)  # the same peft wrapping SFT trained, in the checkpoint's fp32
    peft_model.load_state_dict(torch.load(store.get_dir(ref) / CHECKPOINT_FILE, weights_only=True)["model"])
    reference = cast_model(peft_model.merge_and_unload().eval(), dtype)
    ours, weights = plain_model(merged.out_dir), load_state_dict_of(merged.out_dir)
    assert {v.dtype for v in weights.values()} == {DTYPES[dtype]}
    assert json.loads((merged.out_dir / "config.json").read_text())["dtype"] == dtype
    for name, value in weights.items():  # fp32: both compute W + s BA, within float32 rounding; bf16: that rounding
        # can move a cast across a rounding boundary, by one bf16 ulp (<= 2^-7 of the value)
        torch.testing.assert_close(value, reference.state_dict()[name].to(value.dtype), rtol=WEIGHT_RTOL[dtype],
                                   atol=1e-7, msg=name)
    base = cast_model(plain_model(tiny_model_dir), dtype)
    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected, before = ours(ids).logits, reference(ids).logits, base(ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=LOGIT_ATOL[dtype])
    assert (logits - before).abs().max() > 1e-2  # the adapters were trained and merged


# fp32: float32 rounding of W + s B A (weights ~0.02); bf16: one ulp, the largest step of a rounding that flips
WEIGHT_RTOL = {"float32": 1e-6, "bfloat16": 2**-7}
# fp32: logits <= 2, float32 rounding of W + s BA; bf16: the few weights one ulp apart moved logits by up to 6.4e-5
# (measured), 1e-3 leaves a margin and stays 10x below the change training made (asserted > 1e-2)
LOGIT_ATOL = {"float32": 1e-5, "bfloat16": 1e-3}


def plain_model(folder: Path):
    """A model folder loaded in float32 (a bf16 one: each weight exactly, widened)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def cast_model(model, dtype: str):
    """model's weights rounded to dtype, computing in float32 as plain_model does: the reference a merged folder
    of that dtype is compared with."""
    from stages.model.loading import DTYPES

    return model.to(DTYPES[dtype]).to(torch.float32)


def test_a_manifest_without_a_dtype_keeps_the_checkpoint_dtype_and_says_so(tiny_model_dir, tiny_data_dir, tmp_path,
                                                                            caplog):
    """A bf16 run's checkpoint whose manifest records no dtype (written before it was recorded, or by hand): the
    merge cannot know the run's dtype, keeps the checkpoint's fp32 and says so."""
    from stages.sft import run_sft

    cfg = load_config(None, TINY_OVERRIDES + ["sft.save_freq=4", "model.dtype=bfloat16"])
    metadata = checkpoint_metadata(cfg.model)
    del metadata["model_config"]["dtype"]
    store = ArtifactStore(str(tmp_path / "store"))
    checkpoints = StoreCheckpoints(store, "sft-test", 2, {"base_model": str(tiny_model_dir)}, metadata)
    run_sft(cfg, tiny_model_dir, tiny_data_dir, tmp_path / "final", checkpoints, Tracker([]))
    source = merge_source(store, resolve_checkpoint(store, "sft-test"))
    assert source.dtype is None
    with caplog.at_level("WARNING", logger="stages.merge"):
        result = merge_checkpoint(source, tmp_path / "merged")
    assert result.dtype == "float32" and "records no model dtype" in caplog.text
    assert {v.dtype for v in load_state_dict_of(result.out_dir).values()} == {torch.float32}
    assert json.loads((result.out_dir / "config.json").read_text())["dtype"] == "float32"


def test_an_offloaded_sft_checkpoint_merges_as_the_plain_one(tiny_model_dir, tiny_data_dir, tmp_path):
    """sft.offload saves its weights as a DCP folder (stages/sft.py); merged, it gives the plain checkpoint's model
    (the two paths' steps agree to float32 rounding)."""
    from stages.sft import run_sft

    merged = {}
    for offload in (False, True):
        cfg = load_config(None, TINY_OVERRIDES + ["model.lora.rank=4", "model.lora.alpha=8", "sft.optim.lr=1e-2",
                                                  "sft.save_freq=4", f"sft.offload={offload}"])
        store = ArtifactStore(str(tmp_path / f"store-{offload}"))
        checkpoints = StoreCheckpoints(store, "sft-test", 2, {"base_model": str(tiny_model_dir)},
                                       checkpoint_metadata(cfg.model))
        run_sft(cfg, tiny_model_dir, tiny_data_dir, tmp_path / f"final-{offload}", checkpoints, Tracker([]))
        source = merge_source(store, resolve_checkpoint(store, "sft-test"))
        assert source.step == 4
        result = merge_checkpoint(source, tmp_path / f"merged-{offload}")
        assert result.lora_rank == 4
        merged[offload] = load_state_dict_of(result.out_dir)
    for name, value in merged[False].items():
        torch.testing.assert_close(merged[True][name], value, rtol=1e-4, atol=1e-5, msg=name)


def load_state_dict_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_serves_the_merged_folder_like_transformers(full, probe, tmp_path):
    import ray
    from transformers import AutoModelForCausalLM

    from stages.rollout.base import SamplingParams
    from stages.rollout.hf import HFRolloutEngine
    from stages.rollout.vllm_engine import VLLMRolloutEngine

    source = merge_source(full.store, full.checkpoint)
    merged = merge_checkpoint(source, tmp_path / "merged").out_dir
    prompts, _, pad = probe
    eos = full.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(eos,))
    engine = ray.remote(num_cpus=1)(VLLMRolloutEngine).remote(str(merged), dtype="float32", seed=0, max_model_len=256)
    try:
        served = ray.get(engine.generate.remote(prompts, params))
    finally:
        ray.kill(engine)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    reference = HFRolloutEngine(model, pad, eos).generate(prompts, params)
    assert greedy_margin(model, prompts, [r.response_ids for r in reference]) > ATOL  # no near-tie on the way
    assert [o.response_ids for o in served] == [o.response_ids for o in reference]
    assert len({tuple(o.response_ids) for o in reference}) > 1, "degenerate model: one response for every prompt"
    for o, r in zip(served, reference):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), rtol=0, atol=ATOL)

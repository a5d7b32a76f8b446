"""The merge's command line checks what it is given before it reads, merges or creates anything: a bad --name or
--lora-alpha, a store root, checkpoint or step that is not there, a --step that is not the named version's, each
exits 2 with one `error:` line naming it, and leaves no folder and no stored model behind. A base model whose
weights have other shapes than the checkpoint's (same architecture, another size) is refused before anything is
written, naming a weight and both shapes. Tiny models (hidden 64 and 32) with SFT-format checkpoints (steps 2, 4).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from infra.config import load_config
from infra.store import ArtifactStore
from stages.merge import checkpoint_metadata, hf_state, main, resolve_checkpoint

TEXTS = [f"{a} + {b} = {a + b}\n#### {a + b}" for a in range(30) for b in range(30)]
STEPS = (2, 4)


def tiny(hidden: int, out: Path) -> Path:
    from stages.model.tiny import build_tiny_model

    cfg = load_config(None, [f"model.tiny.hidden_size={hidden}", "model.tiny.intermediate_size=64"]).model.tiny
    return build_tiny_model(cfg, TEXTS, 0, out)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A store holding checkpoint/sft-x at steps 2 and 4, trained from `base` (hidden 64), and `small`, a base
    model of the same architecture with hidden 32."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("merge-cli")
    base, small = tiny(64, folder / "base"), tiny(32, folder / "small")
    state = AutoModelForCausalLM.from_pretrained(base).state_dict()
    store = ArtifactStore(str(folder / "store"))
    refs = {}
    for step in STEPS:
        (folder / f"ckpt{step}").mkdir()
        torch.save({"step": step, "model": state}, folder / f"ckpt{step}" / "train_state.pt")
        metadata = {**checkpoint_metadata(load_config(None).model), "step": step}
        refs[step] = store.put_dir("checkpoint", "sft-x", folder / f"ckpt{step}", inputs={"base_model": str(base)},
                                   metadata=metadata)
    return {"store": store, "refs": refs, "base": base, "small": small}


def run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    """(exit status, stdout, stderr's lines with `error:`) of the command line, as `python -m` gives them."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if "error:" in line]


def models(store: ArtifactStore) -> list:
    return store.artifacts("model")


def test_the_command_line_merges_into_a_folder_and_the_store(world, tmp_path, capsys):
    """The positive control of the tests below: these arguments, without their one mistake, merge."""
    out = tmp_path / "new" / "out"
    code, stdout, errors = run(capsys, "--root", world["store"].root, "--checkpoint", "sft-x", "--step", "2",
                               "--out", str(out), "--name", "cli-ok")
    assert (code, errors) == (0, [])
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["checkpoint"] == str(world["refs"][2]) and report["step"] == 2 and report["out"] == str(out)
    assert (out / "model.safetensors").is_file()
    assert ("model", "cli-ok") in models(world["store"])


@pytest.mark.parametrize("mistake, message", [
    (["--name", "my model/ü"], r"argument --name: artifact name='my model/ü': use letters"),
    (["--step", "3"], r"error: --step 3: checkpoint 'sft-x' has steps \[2, 4\]"),
    (["--checkpoint", "nope"], r"error: --checkpoint 'nope': no checkpoint named 'nope' .*known: \['sft-x'\]"),
    (["--root", "MISSING"], r"error: there is no store at storage.root=.*missing-store.*no such folder"),
    (["--lora-alpha", "nan"], r"argument --lora-alpha: 'nan': must be a finite number > 0"),
    (["--lora-alpha", "0"], r"argument --lora-alpha: '0': must be a finite number > 0"),
    (["--lora-alpha", "-8"], r"argument --lora-alpha: '-8': must be a finite number > 0"),
    (["--lora-alpha", "inf"], r"argument --lora-alpha: 'inf': must be a finite number > 0"),
])
def test_bad_input_exits_2_with_one_error_line_and_creates_nothing(world, tmp_path, capsys, mistake, message):
    # each mistake replaces the argument of the same flag in the control's arguments (argparse keeps the last)
    mistake = [str(tmp_path / "missing-store") if arg == "MISSING" else arg for arg in mistake]
    out = tmp_path / "new" / "out"
    code, stdout, errors = run(capsys, "--root", world["store"].root, "--checkpoint", "sft-x", "--out", str(out),
                               "--name", "cli-bad", *mistake)
    assert (code, stdout) == (2, "")
    assert len(errors) == 1, errors  # one line; a traceback would not come back here at all
    assert re.search(message, errors[0]), errors[0]
    assert not (tmp_path / "new").exists() and not (tmp_path / "missing-store").exists()
    assert ("model", "cli-bad") not in models(world["store"])


def test_a_step_that_is_not_the_named_versions_is_refused(world, tmp_path, capsys):
    store, refs = world["store"], world["refs"]
    assert resolve_checkpoint(store, str(refs[2]), step=2) == refs[2]  # the version's own step: fine
    spec = f"sft-x@{refs[2].version}"
    code, stdout, errors = run(capsys, "--root", store.root, "--checkpoint", spec, "--step", "4", "--out",
                               str(tmp_path / "out"))
    assert (code, stdout) == (2, "")
    assert errors == [f"error: --step 4: --checkpoint {spec!r} is the checkpoint of step 2; pass --checkpoint "
                      "sft-x --step 4 for step 4, or leave --step out"]
    assert not (tmp_path / "out").exists()


def test_a_base_model_of_other_shapes_is_refused_naming_a_weight_and_both_shapes(world, tmp_path, capsys):
    """Same names (Qwen2, 2 layers), hidden 64 in the checkpoint and 32 in --base-model: nothing is written."""
    out = tmp_path / "out"
    code, stdout, errors = run(capsys, "--root", world["store"].root, "--checkpoint", "sft-x", "--base-model",
                               str(world["small"]), "--out", str(out), "--name", "cli-shapes")
    assert (code, stdout) == (2, "")
    [error] = errors
    # the first mismatched name in sorted order; vocab V is the tokenizer's, the same in both models
    vocab = torch.load(world["store"].get_dir(world["refs"][4]) / "train_state.pt", weights_only=True)[
        "model"]["lm_head.weight"].shape[0]
    assert f"lm_head.weight is ({vocab}, 64) in the checkpoint and ({vocab}, 32) in the base model" in error
    assert "is --base-model the model this checkpoint was trained from?" in error
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no temporary folder left either
    assert ("model", "cli-shapes") not in models(world["store"])


def test_lora_alpha_for_a_checkpoint_without_adapters_is_ignored_with_a_warning(caplog):
    state = {"model.embed_tokens.weight": torch.ones(3, 2)}
    with caplog.at_level(logging.WARNING, logger="stages.merge"):
        merged, rank = hf_state(state, 8.0)
    assert rank is None and torch.equal(merged["model.embed_tokens.weight"], torch.ones(3, 2))  # as it was
    assert "LoRA alpha 8.0 (--lora-alpha) ignored: the checkpoint holds no LoRA adapters" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stages.merge"):
        hf_state(state, None)
    assert caplog.text == ""  # no alpha given: nothing to say

"""Merge stage: a training checkpoint in the store -> a plain Hugging Face model folder (verl's model_merger).

Input: an RL checkpoint (`checkpoint/rl-<key>`, the actor's state read through
`stages.model.fsdp.read_checkpoint_model_state`, however many shards wrote it) or an SFT checkpoint
(`checkpoint/sft-<key>`, `train_state.pt`). Output: safetensors weights with LoRA merged into the base
weights (W + alpha / r * B @ A), config.json, and the base model's tokenizer (with its chat template) and
generation config: a folder that transformers and vLLM load as is.

What a checkpoint does not hold comes from its manifest: the base model from its lineage inputs
(`init_model` for RL, `base_model` for SFT), LoRA's alpha from `metadata.model_config.lora` and the run's
`model.dtype` from `metadata.model_config.dtype` (the pipeline's tasks write all three); r is read from the adapter
tensors. The base model and alpha can be given by hand for a checkpoint saved without them. A checkpoint with
adapters and no alpha is an error, never a silent drop.

Dtype: checkpoints hold fp32 master weights whatever `model.dtype` is; the merge (LoRA included) runs in the
checkpoint's dtype and the result is cast to the run's `model.dtype`, as SFT's own export writes it (a bf16 7B
model is 15 GB, not 30), with config.json's dtype the tensors' own. A manifest without a dtype (written before it
was recorded, or by hand) keeps the checkpoint's dtype, with a warning saying so.

The weights are written by transformers' `save_pretrained(state_dict=...)` from a model built on the meta
device: no second copy of the weights is allocated, shards and tied embeddings are handled as transformers
does for any model.

CLI (any checkpoint in the store):
    python -m stages.merge [--root ROOT] [--endpoint-url URL] --checkpoint SPEC [--step N]
                           [--out DIR] [--name NAME] [--base-model PATH|REF] [--lora-alpha A]
SPEC is `checkpoint/NAME@VERSION`, `NAME@VERSION` or `NAME` (its latest step, or the one `--step` names; with
a version, `--step` must be that version's step). `--out` writes the folder there; `--name` puts it in the store as
the versioned artifact `model/NAME` with lineage inputs {checkpoint, base_model}; give at least one.
Everything the command is given (--name, --lora-alpha, --out, the store root, the checkpoint and its step) is checked
before anything is read, merged or created. Exit status: 0; 2 for bad input (the one `error:` line names it and the
fix), as argparse and `python -m infra.store`; 1 when the storage fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infra.artifacts import ArtifactRef
from infra.config_sections import ModelConfig

if TYPE_CHECKING:  # the store (and its S3 client) is imported where used: SFT and the GPU benches need neither
    from infra.store import ArtifactStore

logger = logging.getLogger(__name__)

BASE_INPUTS = ("init_model", "base_model")  # lineage roles that name the model a checkpoint was trained from
_LORA_A = re.compile(r"\.lora_A\.[^.]+\.weight$")


@dataclass
class MergeSource:
    """Everything a merge needs, resolved from the store."""

    checkpoint: ArtifactRef
    step: int
    folder: Path  # local copy of the checkpoint
    base_model: str  # as recorded in lineage: an artifact ref, a local folder or a hub id
    base_dir: str  # where transformers reads it: a local folder or a hub id
    lora_alpha: float | None
    trust_remote_code: bool
    dtype: str | None = None  # the run's model.dtype, which the merged weights are cast to; None: the checkpoint's


@dataclass
class MergeResult:
    out_dir: Path
    num_tensors: int
    lora_rank: int | None  # None: no adapters in the checkpoint
    dtype: str


def checkpoint_metadata(model_cfg: ModelConfig) -> dict:
    """What a training stage records in each checkpoint's manifest so that it can be merged on its own."""
    return {"model_config": model_cfg.model_dump(mode="json")}


# ---- resolving a checkpoint -----------------------------------------------------------------------


def resolve_checkpoint(store: ArtifactStore, spec: str, step: int | None = None) -> ArtifactRef:
    """`checkpoint/NAME@VERSION`, `NAME@VERSION` or `NAME` (+ `step`, else the latest step) -> a ref."""
    text = spec.strip()
    if "@" in text:
        ref = ArtifactRef.parse(text if "/" in text else f"checkpoint/{text}")
        if ref.kind != "checkpoint":
            raise ValueError(f"--checkpoint {spec!r}: a {ref.kind!r} artifact; pass a checkpoint ref "
                             "(list them with `python -m infra.store list checkpoint`)")
        found = int(store.manifest(ref).metadata.get("step", -1))  # FileNotFoundError naming the ref when absent
        if step is not None and step != found:
            raise ValueError(f"--step {step}: --checkpoint {spec!r} is the checkpoint of step {found}; pass "
                             f"--checkpoint {ref.name} --step {step} for step {step}, or leave --step out")
        return ref
    name = text.removeprefix("checkpoint/")
    by_step = {int(m.metadata["step"]): m.ref for m in store.versions("checkpoint", name)}
    if not by_step:
        known = [n for _, n in store.artifacts("checkpoint")]
        raise ValueError(f"--checkpoint {spec!r}: no checkpoint named {name!r} in {store.root}; known: {known}")
    if step is None:
        return by_step[max(by_step)]
    if step not in by_step:
        raise ValueError(f"--step {step}: checkpoint {name!r} has steps {sorted(by_step)}")
    return by_step[step]


def merge_source(store: ArtifactStore, ref: ArtifactRef, base_model: str | None = None,
                 lora_alpha: float | None = None) -> MergeSource:
    """Read the checkpoint's manifest: base model from lineage (unless given), LoRA alpha from metadata."""
    manifest = store.manifest(ref)
    if base_model is None:
        base_model = next((manifest.inputs[k] for k in BASE_INPUTS if k in manifest.inputs), None)
        if base_model is None:
            raise ValueError(f"{ref}: its manifest names no base model (inputs: {manifest.inputs}); "
                             "pass --base-model with the model folder or artifact ref it was trained from")
    model_cfg = manifest.metadata.get("model_config") or {}
    if lora_alpha is None and model_cfg.get("lora"):
        lora_alpha = float(model_cfg["lora"]["alpha"])
    return MergeSource(checkpoint=ref, step=int(manifest.metadata.get("step", -1)), folder=store.get_dir(ref),
                       base_model=base_model, base_dir=_local_model(store, base_model), lora_alpha=lora_alpha,
                       trust_remote_code=bool(model_cfg.get("trust_remote_code", False)),
                       dtype=model_cfg.get("dtype"))


def _local_model(store: ArtifactStore, model: str) -> str:
    try:
        ref = ArtifactRef.parse(model)
    except ValueError:
        return model  # a local folder or hub id
    return str(store.get_dir(ref))


# ---- the merge ----------------------------------------------------------------------------------


def read_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The trained model's full state dict from an RL or SFT checkpoint folder."""
    from stages.model.fsdp import read_checkpoint_model_state
    from stages.model.safe_load import load_state
    from stages.sft import CHECKPOINT_FILE, SHARDED_DIR

    if (folder / SHARDED_DIR / ".metadata").is_file():  # sharded SFT (offload, several ranks): a DCP folder
        return read_checkpoint_model_state(folder, SHARDED_DIR)
    sft_file = folder / CHECKPOINT_FILE
    if sft_file.is_file():
        return load_state(sft_file, mmap=True)["model"]
    return read_checkpoint_model_state(folder, "actor")


def hf_state(state: dict[str, torch.Tensor], lora_alpha: float | None) -> tuple[dict[str, torch.Tensor], int | None]:
    """Plain HF names -> tensors with LoRA merged; -> (state, LoRA rank or None)."""
    from stages.model.fsdp import hf_weights

    ranks = {int(v.shape[0]) for k, v in state.items() if _LORA_A.search(k)}
    if not ranks:
        if lora_alpha is not None:  # given by hand (a manifest records none without LoRA): say it did nothing
            logger.warning("LoRA alpha %s (--lora-alpha) ignored: the checkpoint holds no LoRA adapters (a full "
                           "fine-tune); its weights are written as they are", lora_alpha)
        return hf_weights(state, None), None
    if len(ranks) > 1:
        raise ValueError(f"LoRA adapters with different ranks {sorted(ranks)}; only one rank is supported")
    if lora_alpha is None:
        raise ValueError("the checkpoint holds LoRA adapters but no LoRA alpha is known (its manifest has no "
                         "metadata.model_config.lora); pass --lora-alpha (model.lora.alpha of the training run)")
    rank = ranks.pop()
    return hf_weights(state, lora_alpha / rank), rank


def cast_state(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The floating tensors of state cast to dtype (a ModelConfig.dtype name). Empties state as it goes, so each
    fp32 tensor is freed once cast when state held the only reference (never two full copies). Names sharing one
    tensor (tied embeddings) share its cast too, so that save_pretrained still writes it once."""
    from stages.model.loading import DTYPES

    target, cast, done = DTYPES[dtype], {}, {}
    for name in list(state):
        value = state.pop(name)
        # keyed by the memory it views: a tensor popped and freed shares no address with one still in state
        view = (value.data_ptr(), tuple(value.shape), value.stride())
        if view not in done:
            done[view] = value.to(target) if value.is_floating_point() else value
        cast[name] = done[view]
    return cast


def write_hf_folder(state: dict[str, torch.Tensor], base_dir: str, out_dir: Path,
                    trust_remote_code: bool = False) -> Path:
    """Save `state` (HF names) with the base model's config, tokenizer and generation config to out_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from stages.model.loading import load_tokenizer

    config = AutoConfig.from_pretrained(base_dir, trust_remote_code=trust_remote_code)
    config.use_cache = True
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"checkpoint weights have dtypes {sorted(map(str, dtypes))}; expected one floating dtype")
    dtype = dtypes.pop()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    _check_weights(state, expected, getattr(config, "tie_word_embeddings", False))
    try:
        model.generation_config = GenerationConfig.from_pretrained(base_dir)
    except OSError:
        logger.warning("%s has no generation_config.json; writing one derived from config.json", base_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=dict(state), safe_serialization=True)  # a copy: it drops tied keys
    load_tokenizer(base_dir, trust_remote_code).save_pretrained(out_dir)  # errors without a chat template
    return out_dir


def _check_weights(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], tied: bool) -> None:
    """The checkpoint's names and shapes are the base model's (`expected`: name -> shape), before anything is
    written: save_pretrained writes mismatched shapes that transformers then cannot load."""
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint weights do not match the base model's architecture: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}; is --base-model the model this checkpoint was trained from?")
    wrong = [name for name in sorted(expected) if tuple(state[name].shape) != expected[name]]
    if wrong:
        name = wrong[0]
        raise ValueError(f"checkpoint weights do not match the base model's shapes: {name} is "
                         f"{tuple(state[name].shape)} in the checkpoint and {expected[name]} in the base model "
                         f"({len(wrong)} of {len(expected)} weights differ); is --base-model the model this "
                         "checkpoint was trained from?")
    if tied and "lm_head.weight" in state and "model.embed_tokens.weight" in state:
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise ValueError("config has tie_word_embeddings but the checkpoint's lm_head and embeddings differ")


def merge_checkpoint(source: MergeSource, out_dir: Path) -> MergeResult:
    """Write the merged HF folder of `source` to out_dir."""
    state, rank = hf_state(read_model_state(source.folder), source.lora_alpha)
    if source.dtype is None:
        logger.warning("%s: its manifest records no model dtype (metadata.model_config.dtype); writing the "
                       "checkpoint's own dtype", source.checkpoint)
    else:
        state = cast_state(state, source.dtype)
    write_hf_folder(state, source.base_dir, out_dir, source.trust_remote_code)
    dtype = str(next(v.dtype for v in state.values() if v.is_floating_point())).removeprefix("torch.")
    logger.info("merged %s (step %d%s) with %s -> %s", source.checkpoint, source.step,
                f", LoRA r={rank} merged" if rank else "", source.base_model, out_dir)
    return MergeResult(out_dir, len(state), rank, dtype)


def store_merged(store: ArtifactStore, source: MergeSource, result: MergeResult, name: str,
                 config_hash: str = "") -> ArtifactRef:
    """Put a merged folder in the store as the versioned artifact model/<name>, with its lineage."""
    return store.put_dir("model", name, result.out_dir, config_hash=config_hash,
                         inputs={"checkpoint": str(source.checkpoint), "base_model": source.base_model},
                         metadata={"checkpoint_step": source.step, "lora_rank": result.lora_rank,
                                   "dtype": result.dtype})


# ---- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from infra.store import StoreError

    args = _parse_args(argv)
    try:
        report = _run(args)
    except (FileNotFoundError, ValueError) as exc:  # bad input: no such store, checkpoint or step; a wrong base model
        print(f"error: {exc}", file=sys.stderr)
        return 2  # argparse's status for bad input, as `python -m infra.store`
    except StoreError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(json.dumps(report))
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, those checkable without the store checked here (argparse's `error:` and exit status 2)."""
    parser = argparse.ArgumentParser(prog="python -m stages.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="outputs/store", help="storage.root (a folder or s3://bucket/prefix)")
    parser.add_argument("--endpoint-url", default=None, help="S3 endpoint (storage.endpoint_url)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint/NAME@VERSION, NAME@VERSION or NAME")
    parser.add_argument("--step", type=int, default=None, help="with a NAME: this step instead of the latest; with "
                        "a NAME@VERSION: must be that version's step")
    parser.add_argument("--out", type=Path, default=None, help="write the merged HF folder here")
    parser.add_argument("--name", type=_model_name, default=None,
                        help="put the merged folder in the store as model/NAME")
    parser.add_argument("--base-model", default=None, help="override the base model named by lineage")
    parser.add_argument("--lora-alpha", type=_lora_alpha, default=None,
                        help="LoRA alpha (a finite number > 0: model.lora.alpha of the training run), for a LoRA "
                        "checkpoint whose manifest lacks it; a checkpoint without adapters ignores it, with a warning")
    args = parser.parse_args(argv)
    if args.out is None and args.name is None:
        parser.error("give --out DIR and/or --name NAME")
    if args.out is not None and args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out}: exists and is not an empty folder; pass a new or empty folder")
    return args


def _model_name(text: str) -> str:
    """--name, by the rule the store applies to artifact names (ArtifactRef's), before any merge work."""
    try:
        ArtifactRef("model", text, "0" * 16)  # any valid version: only the name is checked
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _lora_alpha(text: str) -> float:
    """--lora-alpha: nan would write NaN weights and 0 drop the adapters without a word."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0 (model.lora.alpha of the training "
                                         "run, e.g. 16)")
    return value


def _run(args: argparse.Namespace) -> dict:
    """Check the store, the checkpoint and its step (nothing created yet), then merge; -> the report."""
    from infra.store import ArtifactStore

    store = ArtifactStore(args.root, args.endpoint_url)
    store.check_exists()  # FileNotFoundError naming the root; looking never creates a store
    source = merge_source(store, resolve_checkpoint(store, args.checkpoint, args.step), args.base_model,
                          args.lora_alpha)
    report: dict = {"checkpoint": str(source.checkpoint), "step": source.step, "base_model": source.base_model}
    # Merge into a temporary folder next to --out, then rename: --out is complete or absent.
    prefix = f".{args.out.name}.merge-" if args.out else ".merge-"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        remove_killed_merges(args.out.parent, prefix)
    with tempfile.TemporaryDirectory(dir=args.out.parent if args.out else None, prefix=prefix) as tmp:
        result = merge_checkpoint(source, Path(tmp) / "model")
        if args.name is not None:
            report["model"] = str(store_merged(store, source, result, args.name))
        if args.out is not None:
            os.rename(result.out_dir, args.out)  # replaces an empty folder
            report["out"] = str(args.out)
    return report


def remove_killed_merges(parent: Path, prefix: str) -> None:
    """The temporary folders that killed merges into the same --out left in parent, once untouched for an hour
    (as the store's gc treats its own leftovers; a live merge writes its shards as it goes)."""
    from infra.store_gc import GC_MIN_AGE_S, remove_stale_beside

    remove_stale_beside(parent, prefix, GC_MIN_AGE_S)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())

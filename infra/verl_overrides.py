"""verl's command-line overrides turned into ours: `python -m flows.post_train RECIPE --verl KEY=VALUE ...`.

Everything after `--verl` is a verl `ppo_trainer.yaml` override in Hydra's syntax (`key=value`, `+key=value`;
values `True`/`False`, `null`, numbers such as `1e-6`, lists such as `'["console","wandb"]'`, quoted strings); a
key given twice takes its last value, as in Hydra. `translate` maps each through the table of infra/verl_keys.py
and returns:

- the native overrides to run with: `rl.enabled=true sft.enabled=false` first (verl's trainer is RL from
  `actor_rollout_ref.model.path`; a native override can turn SFT back on), the user's own native overrides, the
  mapped ones, and `run.source_overrides`, the record (verl override -> the native overrides it became) that the
  run's config.yaml keeps;
- one console line per verl key: what it set, or why it sets nothing.

Every problem is reported at once (`VerlKeyError`, a ConfigError: exit code 2): a native override that does not
validate, a key outside the table (with the nearest key the table has), a refused key or value with its reason, two
verl keys setting one field to different values, a verl key and a native override setting the same field.

`trainer.total_epochs` needs the number of training rows, known only after data prep: the record holds
`rl.total_steps=<after data prep: ...>` until the flow calls `resolve_after_data_prep` with the row count.
`python -m infra.verl_overrides` prints the README table.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.config import Config, ConfigError, apply_override, load_config, parse_override, validate
from infra.verl_convert import AfterDataPrep, Given
from infra.verl_keys import ROWS, TABLE, VerlKey

IMPLIED = ["rl.enabled=true", "sft.enabled=false"]
PENDING = "<after data prep: "
INT = re.compile(r"[+-]?\d[\d_]*")
FLOAT = re.compile(r"[+-]?(\d[\d_]*\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)", re.IGNORECASE)


class VerlKeyError(ConfigError):
    """verl overrides (and native ones given with them) that cannot run here; the message has one line per problem."""


@dataclass
class Translation:
    overrides: list[str]  # what to run with: implied, the user's native ones, the mapped ones, the record
    lines: list[str]  # one per verl key, for the console
    record: dict[str, list[str]]  # 'verl key=value' -> the native overrides it became


# --------------------------------------------------------------------------------------------------
# Hydra's override syntax


def parse_value(raw: str) -> Any:
    """A value in Hydra's override grammar: bool, null, int, float, quoted string, [list], {dict}, or a string."""
    text = raw.strip()
    if "${" in text:
        raise ValueError("interpolations (${...}) are resolved by Hydra; give the value itself")
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text[:1] in ("[", "{"):
        try:
            return _scalars(yaml.safe_load(text))
        except yaml.YAMLError:
            raise ValueError(f"{text!r} is not a list or mapping in Hydra's syntax, e.g. '[console,wandb]'") from None
    return _scalar(text)


def _scalar(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "null":
        return None
    if INT.fullmatch(text):
        return int(text.replace("_", ""))
    if FLOAT.fullmatch(text):
        return float(text.replace("_", ""))
    return text


def _scalars(value: Any) -> Any:
    """YAML 1.1 leaves '1e-6' a string; Hydra reads it as a float."""
    if isinstance(value, list):
        return [_scalars(v) for v in value]
    if isinstance(value, dict):
        return {k: _scalars(v) for k, v in value.items()}
    return _scalar(value) if isinstance(value, str) else value


def parse_arg(arg: str) -> tuple[str, str, Any]:
    """'key=value' (optionally '+key' / '++key') -> (key, the value as given, the value)."""
    if arg.startswith("~"):
        raise ValueError("deleting a key (~key) is not supported")
    key, sep, raw = arg.lstrip("+").partition("=")
    if not sep or not key.strip():
        raise ValueError("expected KEY=VALUE with a verl key, e.g. data.train_batch_size=1024")
    return key.strip(), raw, parse_value(raw)


def as_text(value: Any) -> str:
    """A value as our override syntax (YAML) writes it."""
    if isinstance(value, AfterDataPrep):
        return f"{PENDING}{value}>"
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()


# --------------------------------------------------------------------------------------------------
# Translation


def translate(recipe: str | Path | None, overrides: list[str], verl_args: list[str]) -> Translation:
    """Map `verl_args` onto the config of `recipe` + `overrides`; raises VerlKeyError listing every problem."""
    errors: list[str] = []
    given: dict[str, tuple[str, Any, int]] = {}  # key -> (value as given, value, times given)
    for arg in verl_args:
        try:
            key, raw, value = parse_arg(arg)
        except ValueError as exc:
            errors.append(f"{arg}: {exc}")
            continue
        given[key] = (raw, value, given[key][2] + 1 if key in given else 1)
    base, valid = _base(recipe, list(overrides), errors)
    ctx = Given({key: value for key, (_, value, _) in given.items()}, base)
    mapped, lines, record = _map(given, ctx, errors)
    errors += _clashes(mapped, valid)
    if errors:
        raise VerlKeyError("overrides that cannot run here (README 'From verl' lists verl's keys):\n  "
                           + "\n  ".join(errors))
    natives = [f"{key}={as_text(v)}" for key, (v, _) in mapped.items() if not isinstance(v, AfterDataPrep)]
    lines.insert(0, f"(verl's trainer: RL from the model as given, no SFT) -> {' '.join(IMPLIED)}")
    return Translation(IMPLIED + list(overrides) + natives + [f"run.source_overrides={json.dumps(record)}"],
                       lines, record)


def _base(recipe: str | Path | None, overrides: list[str], errors: list[str]) -> tuple[Config, list[str]]:
    """The recipe with the native overrides, which the verl keys are mapped onto, and the overrides in it. A native
    override that does not validate is added to `errors` and left out, so that the verl keys are still checked
    (against the config without it); a recipe that does not load raises its ConfigError."""
    try:
        return load_config(recipe, IMPLIED + overrides), overrides
    except ConfigError:
        pass
    valid: list[str] = []
    for native in overrides:
        try:
            load_config(recipe, IMPLIED + valid + [native])
        except ConfigError as exc:
            errors += str(exc).removeprefix("invalid configuration:\n  ").split("\n  ")
            continue
        valid.append(native)
    return load_config(recipe, IMPLIED + valid), valid


def _map(given: dict, ctx: Given, errors: list[str]) -> tuple[dict, list[str], dict]:
    mapped: dict[str, tuple[Any, str]] = {}  # our key -> (value, the verl override that set it)
    lines, record = [], {}
    for key, (raw, value, times) in given.items():
        row, text = TABLE.get(key), f"{key}={raw}"
        if row is None or row.apply is None:
            errors.append(f"{text}: {_unknown(key) if row is None else 'refused: ' + row.note}")
            continue
        try:
            out = row.apply(value, ctx)
        except ValueError as exc:
            errors.append(f"{text}: {exc}")
            continue
        except TypeError as exc:
            errors.append(f"{text}: a value of the wrong type ({exc})")
            continue
        for ours, v in out.items():
            if ours in mapped and mapped[ours][0] != v:
                errors.append(f"{text} sets {ours}={as_text(v)}, but {mapped[ours][1]} sets it to "
                              f"{as_text(mapped[ours][0])}: give one")
            mapped[ours] = (v, text)
        record[text] = [f"{ours}={as_text(v)}" for ours, v in out.items()]
        lines.append(_line(text, record[text], row, times))
    return mapped, lines, record


def _line(text: str, natives: list[str], row: VerlKey, times: int) -> str:
    line = f"{text} -> {' '.join(natives) or 'nothing to set'}"
    if row.note and (row.kind != "same" or not natives):
        line += f"  # {row.note}"
    if times > 1:
        line += f"  (given {times} times: the last applies, as in Hydra)"
    return line


def _unknown(key: str) -> str:
    """Why `key` is not in the table, with the nearest key that is (a key whose end it is, else by spelling)."""
    if is_native(key):
        return "one of this project's keys, not verl's: give it before --verl (everything after --verl is verl's)"
    ends = [k for k in TABLE if k.endswith("." + key)]
    near = ends if len(ends) == 1 else difflib.get_close_matches(key, list(TABLE), n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"not a verl key this project maps or refuses (it knows {len(TABLE)}){hint}"


def is_native(key: str) -> bool:
    """Whether `key` names a field of this project's config (a recipe's key given after --verl by mistake;
    `data.max_prompt_length` is both verl's and ours)."""
    node: object = Config
    for part in key.split("."):
        fields = getattr(node, "model_fields", None)
        if not fields or part not in fields:
            return False
        node = fields[part].annotation
    return True


def _clashes(mapped: dict, overrides: list[str]) -> list[str]:
    """A field set both by a verl key and by a native override (or one inside the other's section)."""
    errors = []
    for native in overrides:
        path = ".".join(parse_override(native)[0])
        for ours, (_, text) in mapped.items():
            if ours == path or ours.startswith(path + ".") or path.startswith(ours + "."):
                errors.append(f"{text} sets {ours}, and so does the override {native}: give it once")
    return errors


# --------------------------------------------------------------------------------------------------
# After data prep: the step count of verl's trainer.total_epochs


def pending(cfg: Config) -> list[str]:
    """The recorded verl overrides whose values wait for the training rows' count."""
    return [text for text, natives in cfg.run.source_overrides.items() if any(PENDING in n for n in natives)]


def resolve_after_data_prep(cfg: Config, rows: int) -> tuple[Config, list[str]]:
    """Set what waited for the number of training rows (rl.total_steps from trainer.total_epochs, a warmup
    ratio of it); returns the new config, its record updated, and one line per key set."""
    waiting = pending(cfg)
    if not waiting:
        return cfg, []
    given = {key: value for key, _, value in map(parse_arg, cfg.run.source_overrides)}
    ctx, tree, lines = Given(given, cfg, rows), cfg.model_dump(mode="json"), []
    for text in waiting:
        key, _, value = parse_arg(text)
        try:
            out = TABLE[key].apply(value, ctx)
        except ValueError as exc:
            raise ConfigError(f"{text}: {exc}") from None
        natives = [f"{ours}={as_text(v)}" for ours, v in out.items()]
        for native in natives:
            apply_override(tree, *parse_override(native))
        tree["run"]["source_overrides"][text] = natives
        lines.append(f"{text} -> {' '.join(natives)}  # {rows} training rows")
    return validate(tree), lines


# --------------------------------------------------------------------------------------------------
# The README table


def markdown_table(rows: list[VerlKey] = ROWS) -> str:
    """verl key -> our key -> note, one line per row of the table, after a line of counts (README "From verl")."""
    n = counts(rows)
    lines = [f"{len(rows)} verl keys: {n['same'] + n['via']} set our keys ({n['same']} as given, {n['via']} "
             "converted), "
             f"{n['only']} are accepted only with the value this project uses anyway (another value is refused), "
             f"{n['no_setting']} are accepted and set nothing (the note says why), {n['refused']} refused.", "",
             "| verl key | here | note |", "| --- | --- | --- |"]
    for row in rows:
        here = {"refused": "**refused**", "only": "as is", "no_setting": "no setting"}.get(
            row.kind, ", ".join(f"`{k.strip()}`" for k in row.ours.split(",")))
        lines.append(f"| `{row.key}` | {here} | {row.note.replace('|', '/')} |")
    return "\n".join(lines)


def counts(rows: list[VerlKey] = ROWS) -> dict[str, int]:
    return {kind: sum(r.kind == kind for r in rows) for kind in ("same", "via", "only", "no_setting", "refused")}


if __name__ == "__main__":
    print(markdown_table())

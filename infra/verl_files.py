"""Conversion of verl's `data.train_files` / `data.val_files` to ours, for the table in infra/verl_keys.py: the files
must be .parquet or .jsonl, in one folder that holds them and nothing else (data prep reads a folder, `data.path`),
the validation files found by their names and the columns verl's RL layout (data/reading.py's and data/files.py's
rules, imported lazily: infra reading upwards, as infra/rl_config.py and infra/cluster.py do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.verl_convert import Given, Overrides


def files_folder(value: Any, given: Given) -> Overrides:
    """One folder that holds the train and val files and nothing else, split by file names as data prep does."""
    train = _paths(given.get("data.train_files", None))
    val = _paths(given.get("data.val_files", None))
    if not train:
        raise ValueError("give data.train_files (a parquet file, or a list of them)")
    _check_files(train)
    try:
        _check_files(val)
    except ValueError:
        return {}  # reported under data.val_files
    if not val and len(train) == 1:
        return _with_columns({"data.source": "file", "data.path": str(train[0])}, train, given)
    return _with_columns(_one_folder(train, val), train + val, given)


def val_files(value: Any, given: Given) -> Overrides:
    if not given.is_given("data.train_files"):
        raise ValueError("give data.train_files too: the two are read from one folder")
    _check_files(_paths(value))
    try:
        return files_folder(value, given)
    except ValueError:
        return {}  # reported once, under data.train_files


def _check_files(paths: list[Path]) -> None:
    """Each path is a .parquet or .jsonl file that exists."""
    for path in paths:
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        if not path.exists():
            raise ValueError(f"{path} does not exist{where}; give the path of a .parquet or .jsonl file")
        if not path.is_file():
            raise ValueError(f"{path} is a folder; give the .parquet or .jsonl files in it")
        if path.suffix not in (".parquet", ".jsonl"):
            raise ValueError(f"{path} is a {path.suffix or 'suffix-less'} file; give .parquet or .jsonl files")


def _one_folder(train: list[Path], val: list[Path]) -> Overrides:
    """data.path = the folder of the train and val files, which must hold them and nothing else, the validation files
    being the ones whose names say so (data/reading.py `split_files`)."""
    from data.reading import data_files, split_files  # the rules data prep reads files by

    folders = sorted({str(p.resolve().parent) for p in train + val})
    if len(folders) > 1:
        raise ValueError(f"the train and val files are in {len(folders)} folders ({', '.join(folders)}); here data "
                         "prep reads one folder (data.path), so put the train and val files together in a folder of "
                         "their own and give their paths there")
    folder = Path(folders[0])
    found = sorted(p.resolve() for p in data_files(folder))
    others = [p for p in found if p not in {q.resolve() for q in train + val}]
    if others:
        raise ValueError(f"data.path reads a whole folder here, and {folder} also holds {', '.join(map(str, others))}; "
                         "put the train and val files in a folder of their own")
    expect = {"train": sorted(p.resolve() for p in train), "validation": sorted(p.resolve() for p in val)}
    split = split_files(found)
    if split != (expect if val else {"all": found}):
        named = [p.name for p in split.get("validation", [])]
        raise ValueError(f"here the validation files are found by name (a word test/val/validation/valid/dev/eval): "
                         f"in {folder} they would be {named}, not {[p.name for p in val]}; rename the files")
    return {"data.source": "file", "data.path": str(folder)}


def _with_columns(out: Overrides, files: list[Path], given: Given) -> Overrides:
    """`out`, once the files have verl's RL columns (data/files.py `verl_layout_problem` says what is missing)."""
    from data.files import verl_layout_problem
    from data.reading import column_names

    problem = verl_layout_problem(column_names(files), ", ".join(map(str, files)), given.base.data.columns)
    if problem:
        raise ValueError(problem)
    return out


def _paths(value: Any) -> list[Path]:
    values = [] if value is None else [value] if isinstance(value, str) else list(value)
    return [Path(v).expanduser() for v in values]

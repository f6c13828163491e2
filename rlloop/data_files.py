"""Where a run's rows come from: a parquet/jsonl file, a directory of them (a hub snapshot: its README's configs, or
else its file names, say which files are which split), a `save_to_disk` directory, or a Hugging Face hub dataset, as a
`datasets.Dataset`. Each is read as `datasets.load_dataset` reads it, with the same `split` (slices such as
`train[:100]` too) and `name` (`data.subset`); an unreadable one is a DataError that names the config key, the file
and, for JSON, the line."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from rlloop.errors import DataError

log = logging.getLogger(__name__)

FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def is_local(path: str) -> bool:
    """A file or directory on this machine (or meant to be one) rather than a hub id."""
    return Path(path).exists() or path.startswith((".", "/")) or path.endswith(tuple(FILE_FORMATS))


def _first_text(file: Path) -> bytes:
    """The first non-whitespace byte of a file (b"" for a blank one), read a chunk at a time: reading a 1.2 GB jsonl
    whole to see that it is not empty took 2.3 GB."""
    with file.open("rb") as f:
        while chunk := f.read(1 << 16):
            if text := chunk.lstrip():
                return text[:1]
    return b""


def _empty_json(file: Path) -> bool:
    try:
        return file.stat().st_size < 1 << 20 and json.loads(file.read_bytes()) in ([], {})
    except ValueError:
        return False


def _bad_json_line(file: Path) -> str | None:
    """Where a JSON(-lines) file that `datasets` refused is broken, as 'line N: problem', if one line is to blame."""
    if _first_text(file) == b"[":  # one JSON array: the parser knows the line
        try:
            json.loads(file.read_text(errors="replace"))
        except ValueError as e:
            return f"line {getattr(e, 'lineno', '?')}: not valid JSON: {e}"
        return None
    with file.open(errors="replace") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                return f"line {n}: not valid JSON ({e}): {line[:80]!r}"
            if not isinstance(row, dict):
                return f"line {n}: expected a JSON object (one row), got {type(row).__name__}"
    return None


def _parquet_rows(files: list[Path]) -> int | None:
    """Rows in these parquet files by their footers; None when one is not readable parquet."""
    import pyarrow.parquet as pq

    try:
        return sum(pq.read_metadata(f).num_rows for f in files)
    except Exception:
        return None


def _split_names(split: str, key: str) -> list[str]:
    """The splits a `datasets` split string reads: 'train[:10%]+test' -> ['train', 'test']."""
    import datasets

    try:
        datasets.ReadInstruction.from_spec(split)
    except (ValueError, AssertionError) as e:
        raise DataError(f"{key.split('.')[0]}.split {split!r}: {e}") from None
    return [part.split("[")[0].strip() for part in split.split("+")]


def _check_split(split: str, have: list[str], where, key: str) -> None:
    if missing := [name for name in _split_names(split, key) if name not in have]:
        raise DataError(
            f"{key.split('.')[0]}.split {split!r}: {where} has no {missing[0]!r} split (it has {', '.join(have)})"
        )


def _unreadable(error: Exception, files: list[Path], fmt: str, path, key: str) -> DataError:
    """A DataError for files `datasets` could not read, naming the file (and line) to blame."""
    for f in files:
        where = _bad_json_line(f) if fmt == "json" else None
        if where:
            return DataError(f"{key} {f} {where}")
    if fmt == "parquet" and _parquet_rows(files) == 0:  # readable, but pyarrow refuses zero-row batches
        return DataError(f"{key} {path}: no rows")
    if fmt == "json" and all(map(_empty_json, files)):  # `[]` or `{}`: datasets says "corresponds to no data"
        return DataError(f"{key} {path}: no rows")
    reason = " ".join(str(error.__cause__ or error).split())[:300]
    return DataError(f"{key} {path}: cannot read as {fmt} ({reason}); is it a broken or truncated file?")


def _no_rows(files: list[Path], fmt: str, path, key: str) -> None:
    if fmt == "json" and not any(_first_text(f) for f in files):
        raise DataError(f"{key} {path}: no rows (empty file)")


def _load_file(file: Path, split: str, subset: str | None, key: str):
    import datasets

    section = key.split(".")[0]
    if file.suffix not in FILE_FORMATS:
        raise DataError(f"{key} {file}: unsupported format {file.suffix!r} (use .parquet, .jsonl or .json)")
    if subset is not None:
        raise DataError(f"{section}.subset {subset!r}: a single file ({file}) has no subsets; leave it null")
    _check_split(split, ["train"], f"{file} (a single file)", key)
    if file.stat().st_size == 0:
        raise DataError(f"{key} {file}: no rows (empty file)")
    fmt = FILE_FORMATS[file.suffix]
    _no_rows([file], fmt, file, key)
    try:
        return datasets.load_dataset(fmt, data_files=[str(file)], split=split)
    except Exception as e:  # pyarrow / datasets errors: find the line to blame
        raise _unreadable(e, [file], fmt, file, key) from None


def _subset_error(error: ValueError, path: str, subset: str | None, key: str) -> DataError | None:
    """The DataError for a dataset that needs `data.subset` (a config name) or has no such one; None for others."""
    import datasets

    if "Config name is missing" not in str(error) and "BuilderConfig" not in str(error):
        return None
    try:
        configs = ", ".join(datasets.get_dataset_config_names(path))
    except Exception:  # datasets' own message lists them
        configs = " ".join(str(error).split())
    section = key.split(".")[0]
    if subset is None:
        return DataError(f"{key} {path} has several subsets (configs): set {section}.subset to one of {configs}")
    return DataError(f"{section}.subset {subset!r}: {path} has no such subset (config); it has {configs}")


def _names(files, directory: Path, most: int = 4) -> str:
    names = [Path(os.path.relpath(f, directory)).as_posix() for f in files]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _load_directory(directory: Path, split: str, subset: str | None, key: str):
    """A directory as `datasets.load_dataset(directory, name=subset, split=split)` reads it: the files of each split
    by its README's `configs:`, or else by their names (train-*.parquet, data/test.jsonl, eval.jsonl; all of them
    "train" when no name says a split). Files that neither puts in a split are refused, not left out."""
    import datasets
    from datasets.data_files import DEFAULT_PATTERNS_ALL, get_data_patterns, resolve_pattern

    directory = directory.resolve()
    try:
        builder = datasets.load_dataset_builder(str(directory), name=subset)
    except FileNotFoundError:  # datasets' EmptyDatasetError, DataFilesNotFoundError: no data file at all
        raise DataError(f"{key} {directory}: a directory with no .parquet, .jsonl or .json files in it") from None
    except ValueError as e:
        if "file format" in str(e):  # "Couldn't infer the same data file format for all splits"
            raise DataError(f"{key} {directory}: a directory mixing parquet and json files; keep one format") from None
        raise _subset_error(e, str(directory), subset, key) or DataError(f"{key} {directory}: {e}") from None
    if builder.name not in ("parquet", "json"):
        raise DataError(f"{key} {directory}: holds {builder.name} files; rlloop reads .parquet, .jsonl or .json")
    by_split = {str(s): sorted(Path(f) for f in files) for s, files in builder.config.data_files.items()}
    declared = datasets.load.dataset_module_factory(str(directory)).builder_configs_parameters.metadata_configs
    if not declared:  # by file names: datasets reads the files a name puts in a split and drops the rest unsaid
        every = {Path(f) for f in resolve_pattern("**", str(directory), allowed_extensions=list(FILE_FORMATS))}
        left = sorted(every - {f for files in by_split.values() for f in files})
        if {FILE_FORMATS[f.suffix] for f in left} - {builder.name}:
            raise DataError(f"{key} {directory}: a directory mixing parquet and json files; keep one format")
        if left:
            raise DataError(
                f"{key} {directory}: its file names put {_names(sorted(every - set(left)), directory)} in a split "
                f"({', '.join(by_split)}), and {_names(left, directory)} in none, which would be left out: name each "
                f"file for its split (train-*.parquet, test-*.parquet), declare `configs:` in a README.md, or set "
                f"{key} to one file"
            )
    _check_split(split, list(by_split), directory, key)
    subset_name = f" (subset {builder.config.name})" if builder.config.name != "default" else ""
    said = f"{key} {directory}{subset_name}: reading split {split!r} of " + "; ".join(
        f"{s}: {_names(files, directory)}" for s, files in by_split.items()
    )
    if not declared and get_data_patterns(str(directory)) == DEFAULT_PATTERNS_ALL and len(by_split["train"]) > 1:
        # verl's data/ holds dapo-math-17k.parquet and aime-2024.parquet: one "train" split, the eval set too
        log.warning(
            "%s; no file name says a split, so all of them are trained on: if one is held out, set %s to the file to "
            "train on, or name the held-out one test-*",
            said,
            key,
        )
    else:
        log.info(said)
    wanted = {name: by_split[name] for name in _split_names(split, key)}
    files = [f for name_files in wanted.values() for f in name_files]
    _no_rows(files, builder.name, directory, key)
    try:  # the files, not the directory: datasets (5.2) caches a directory with README configs by its name and the
        # config's alone, and another snapshot of that name (or new files in this one) gave the old rows
        return datasets.load_dataset(
            builder.name, data_files={s: [str(f) for f in fs] for s, fs in wanted.items()}, split=split
        )
    except Exception as e:
        raise _unreadable(e, files, builder.name, directory, key) from None


def _load_saved(directory: Path, split: str, subset: str | None, key: str):
    """A directory written by `Dataset.save_to_disk` (one split, "train") or a DatasetDict's (`split` of it, slices
    as datasets reads them)."""
    import datasets

    if subset is not None:
        raise DataError(
            f"{key.split('.')[0]}.subset {subset!r}: a save_to_disk directory has no subsets; leave it null"
        )
    try:
        saved = datasets.load_from_disk(str(directory))
    except Exception as e:
        raise DataError(f"{key} {directory}: cannot read as a saved dataset ({type(e).__name__}: {e})") from None
    splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
    _check_split(split, list(splits), directory, key)
    parts = datasets.ReadInstruction.from_spec(split).to_absolute({name: len(d) for name, d in splits.items()})
    read = [splits[p.splitname].select(range(p.from_, p.to)) for p in parts]
    return read[0] if len(read) == 1 else datasets.concatenate_datasets(read)


def _load_hub(path: str, split: str, subset: str | None, key: str):
    import datasets

    _split_names(split, key)  # a malformed one is refused before the hub is asked
    try:
        return datasets.load_dataset(path, name=subset, split=split)
    except ValueError as e:
        if error := _subset_error(e, path, subset, key):
            raise error from None
        if "split" in str(e).lower():
            raise DataError(f"{key.split('.')[0]}.split {split!r}: {path}: {e}") from None
        raise DataError(f"{key} {path!r}: {e}") from e
    except Exception as e:  # the hub raises many kinds; the message is what matters
        raise DataError(
            f"{key} {path!r} (split {split!r}): could not load from the Hugging Face hub ({e}); without network, "
            f"download it first (hf download --repo-type dataset {path} --local-dir DIR) and set {key} to DIR, or "
            "to a local parquet/jsonl file"
        ) from e


def load_rows(path: str, split: str = "train", key: str = "data.path", subset: str | None = None):
    """A `datasets.Dataset` from a hub id, a parquet/jsonl file or a directory of them: `split` (and, for a hub id or
    a directory with configs, `subset`) as `datasets.load_dataset` takes them; errors name `key`."""
    local = Path(path)
    if local.is_file():
        return _load_file(local, split, subset, key)
    if local.is_dir():
        if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
            return _load_saved(local, split, subset, key)
        return _load_directory(local, split, subset, key)
    if is_local(path):
        raise DataError(f"{key} {path}: no such file or directory")
    return _load_hub(path, split, subset, key)

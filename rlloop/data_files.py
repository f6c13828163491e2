"""Where a run's rows come from: a parquet/jsonl file, a directory of them (the split asked for, by the hub's file
naming), a `save_to_disk` directory, or a Hugging Face hub dataset, as a `datasets.Dataset`; an unreadable one is a
DataError that names the config key, the file and, for JSON, the line."""

from __future__ import annotations

import json
from pathlib import Path

from rlloop.errors import DataError

FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def is_local(path: str) -> bool:
    """A file or directory on this machine (or meant to be one) rather than a hub id."""
    return Path(path).exists() or path.startswith((".", "/")) or path.endswith(tuple(FILE_FORMATS))


def _bad_json_line(file: Path) -> str | None:
    """Where a JSON(-lines) file that `datasets` refused is broken, as 'line N: problem', if one line is to blame."""
    text = file.read_text(errors="replace")
    if text.lstrip().startswith("["):  # one JSON array: the parser knows the line
        try:
            json.loads(text)
        except ValueError as e:
            return f"line {getattr(e, 'lineno', '?')}: not valid JSON: {e}"
        return None
    for n, line in enumerate(text.splitlines(), 1):
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


def _load_files(files: list[Path], fmt: str, path: str, key: str):
    import datasets

    if fmt == "json" and not any(f.read_bytes().strip() for f in files):
        raise DataError(f"{key} {path}: no rows (empty file)")
    try:
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # pyarrow / datasets errors: find the file (and line) to blame
        for f in files:
            where = _bad_json_line(f) if fmt == "json" else None
            if where:
                raise DataError(f"{key} {f} {where}") from None
        if fmt == "parquet" and _parquet_rows(files) == 0:  # readable, but pyarrow refuses zero-row batches
            raise DataError(f"{key} {path}: no rows") from None
        reason = " ".join(str(e.__cause__ or e).split())[:300]
        raise DataError(f"{key} {path}: cannot read as {fmt} ({reason}); is it a broken or truncated file?") from None


def _split_files(directory: Path, split: str, key: str) -> list[Path]:
    """The data files of `split` in a directory, named as on the hub (train-00000-of-00002.parquet, data/test.jsonl,
    eval.jsonl; a directory whose names say no split is all "train"), picked as `datasets.load_dataset(directory,
    split=split)` picks them: reading every file mixed a snapshot's test split into its training data."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        by_split = DataFilesDict.from_local_or_remote(get_data_patterns(str(directory)), base_path=str(directory))
    except FileNotFoundError:  # datasets' EmptyDatasetError too: no file at all
        by_split = {}
    named = {str(s): sorted(Path(f) for f in fs if Path(f).suffix in FILE_FORMATS) for s, fs in by_split.items()}
    named = {s: fs for s, fs in named.items() if fs}
    if not named:
        raise DataError(f"{key} {directory}: a directory with no .parquet, .jsonl or .json files in it")
    if split not in named:
        raise DataError(f"{key} {directory}: no {split!r} split in it (its files name {', '.join(sorted(named))})")
    return named[split]


def _load_saved(directory: Path, split: str, key: str):
    """A directory written by `Dataset.save_to_disk` (or a DatasetDict's: `split` of it)."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(directory))
    except Exception as e:
        raise DataError(f"{key} {directory}: cannot read as a saved dataset ({type(e).__name__}: {e})") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(f"{key} {directory}: no {split!r} split in it (it has {', '.join(saved)})")
        saved = saved[split]
    return saved


def load_rows(path: str, split: str = "train", key: str = "data.path"):
    """A `datasets.Dataset` from a hub id, a parquet/jsonl file or a directory of them; errors name `key`."""
    import datasets

    local = Path(path)
    if local.is_file():
        if local.suffix not in FILE_FORMATS:
            raise DataError(f"{key} {path}: unsupported format {local.suffix!r} (use .parquet, .jsonl or .json)")
        if local.stat().st_size == 0:
            raise DataError(f"{key} {path}: no rows (empty file)")
        return _load_files([local], FILE_FORMATS[local.suffix], path, key)
    if local.is_dir():
        if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
            return _load_saved(local, split, key)
        files = _split_files(local, split, key)
        formats = {FILE_FORMATS[f.suffix] for f in files}
        if len(formats) > 1:
            raise DataError(f"{key} {path}: a directory mixing parquet and json files; keep one format")
        return _load_files(files, formats.pop(), path, key)
    if is_local(path):
        raise DataError(f"{key} {path}: no such file or directory")
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as e:  # the hub raises many kinds; the message is what matters
        raise DataError(f"{key} {path!r} (split {split!r}): could not load from the Hugging Face hub: {e}") from e

"""Which rows a source gives: a hub snapshot's configs and splits, `data.subset`, `data.split` on a file, repeated
prompts (`data.dedup`), literal dotted column names, and the errors for what cannot be read as asked."""

import json
import logging
import tracemalloc
from pathlib import Path

import datasets
import pandas as pd
import pytest
from transformers import AutoTokenizer

from rlloop.config import DataSection, load_config
from rlloop.data import PromptData, load_datasets
from rlloop.errors import DataError
from rlloop.tiny import ASSETS, make_rows

TINY = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ASSETS / "model")


def frame(n: int, first: int = 0) -> pd.DataFrame:
    """n rows in the DAPO schema, prompts "first + 0" ... with answers first + 1 ...: each distinct."""
    return pd.DataFrame(make_rows([(i, 1) for i in range(first, first + n)], "train"))


def answers(section: DataSection, tok) -> list[str]:
    data = PromptData(section.model_copy(update=dict(shuffle=False)), tok)
    return [p.answer for p in data.next_batch(len(data))]


def snapshot(root: Path, files: dict[str, pd.DataFrame], readme: str | None = None) -> Path:
    for name, rows in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        rows.to_parquet(root / name)
    if readme is not None:
        (root / "README.md").write_text(readme)
    return root


def test_a_snapshots_readme_configs_say_which_files_are_which_split(tmp_path, tok, caplog):
    """The README declares data/dapo-math.parquet train and data/aime-2024.parquet test (names that say no split):
    the directory trained on both, AIME included. As datasets reads it: train alone, and one line says which files
    each split has."""
    readme = (
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/dapo-math.parquet\n"
        "  - split: test\n    path: data/aime-2024.parquet\n---\n"
    )
    d = snapshot(tmp_path, {"data/dapo-math.parquet": frame(6), "data/aime-2024.parquet": frame(3, first=100)}, readme)
    caplog.set_level(logging.INFO, logger="rlloop")
    assert answers(DataSection(path=str(d)), tok) == [str(i + 1) for i in range(6)]
    assert "split 'train' of train: data/dapo-math.parquet; test: data/aime-2024.parquet" in caplog.text
    assert answers(DataSection(path=str(d), split="test"), tok) == ["101", "102", "103"]


def test_a_snapshot_of_several_subsets_needs_data_subset(tmp_path, tok):
    """open-r1/DAPO-Math-17k-Processed declares configs all, en and cn (all = en + cn): the directory read all three,
    each prompt twice. Now it names data.subset and the subsets; eval.subset picks the eval set's."""
    configs = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n" for c in ("all", "en", "cn")
    )
    d = snapshot(
        tmp_path / "openr1",
        {"all/train-00000-of-00001.parquet": frame(5), "en/train-00000-of-00001.parquet": frame(3)}
        | {"cn/train-00000-of-00001.parquet": frame(2, first=3)},
        f"---\nconfigs:\n{configs}---\n",
    )
    with pytest.raises(
        DataError, match=r"openr1 has several subsets \(configs\): set data.subset to one of all, en, cn"
    ):
        PromptData(DataSection(path=str(d)), tok)
    with pytest.raises(
        DataError, match=r"data.subset 'fr': .*openr1 has no such subset \(config\); it has all, en, cn"
    ):
        PromptData(DataSection(path=str(d), subset="fr"), tok)
    assert answers(DataSection(path=str(d), subset="cn"), tok) == ["4", "5"]
    assert len(PromptData(DataSection(path=str(d), subset="all"), tok)) == 5
    cfg = load_config(TINY, [f"eval.path={d}", "eval.subset=en"])
    _, held_out = load_datasets(cfg, tok)
    assert [p.answer for p in held_out.next_batch(3)] == ["1", "2", "3"]
    with pytest.raises(DataError, match=r"eval.path .*openr1 has several subsets .* set eval.subset to one of"):
        load_datasets(load_config(TINY, [f"eval.path={d}"]), tok)


def test_files_that_no_name_puts_in_a_split_are_refused_not_dropped(tmp_path, tok):
    """dapo-math-17k.parquet next to my_extra_train.parquet: datasets reads the file whose name says "train" and drops
    the DAPO file unsaid (10 rows to train on, not 210); next to hard-test.parquet there was no train split at all."""
    extra = snapshot(tmp_path / "extra", {"dapo-math-17k.parquet": frame(20), "my_extra_train.parquet": frame(2)})
    with pytest.raises(
        DataError,
        match=r"extra: its file names put my_extra_train.parquet in a split \(train\), and "
        r"dapo-math-17k.parquet in none, which would be left out.*set data.path to one file",
    ):
        PromptData(DataSection(path=str(extra)), tok)
    held_out = snapshot(tmp_path / "held", {"dapo-math-17k.parquet": frame(20), "hard-test.parquet": frame(2)})
    with pytest.raises(
        DataError, match=r"put hard-test.parquet in a split \(test\), and dapo-math-17k.parquet in none"
    ):
        PromptData(DataSection(path=str(held_out)), tok)


def test_a_directory_whose_names_say_no_split_is_read_whole_with_a_warning(tmp_path, tok, caplog):
    """verl's data/ folder holds dapo-math-17k.parquet and its eval set aime-2024.parquet: as datasets reads it, both
    are "train"; that is said, naming the files, rather than training on AIME unsaid."""
    verl = snapshot(tmp_path / "data", {"dapo-math-17k.parquet": frame(20), "aime-2024.parquet": frame(3, first=50)})
    assert len(PromptData(DataSection(path=str(verl)), tok)) == 23
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("rlloop")]
    assert len(warned) == 1
    assert "of train: aime-2024.parquet, dapo-math-17k.parquet; no file name says a split" in warned[0]


def test_data_split_of_a_single_file_is_read_as_datasets_reads_it(tmp_path, tok):
    """A file is one split, "train": a slice of it reads that slice (it read the whole file), another split is an
    error naming data.split (it read the whole file too)."""
    path = tmp_path / "d.parquet"
    frame(10).to_parquet(path)
    assert answers(DataSection(path=str(path), split="train[:3]"), tok) == ["1", "2", "3"]
    assert answers(DataSection(path=str(path), split="train[80%:]"), tok) == ["9", "10"]
    with pytest.raises(DataError, match=r"data.split 'test': .*d.parquet \(a single file\) has no 'test' split"):
        PromptData(DataSection(path=str(path), split="test"), tok)
    with pytest.raises(DataError, match=r"data.subset 'en': a single file .* has no subsets"):
        PromptData(DataSection(path=str(path), subset="en"), tok)


def test_a_blank_file_is_found_empty_without_reading_it_whole(tmp_path, tok):
    """Whether a jsonl file has any text was found by reading it whole (2.3 GB for DAPO-Math-17k's 1.2 GB)."""
    path = tmp_path / "blank.jsonl"
    path.write_text("\n" * (32 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="blank.jsonl: no rows"):
            PromptData(DataSection(path=str(path)), tok)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (8 << 20)


def test_repeated_prompts_are_trained_on_once_and_resume_in_the_same_order(tmp_path, tok, caplog):
    """The hub's DAPO-Math-17k is 17,398 prompts, each ~103 times: an epoch drew the same prompt many times. Each
    distinct (prompt, answer) is now kept once (its first row), and a resume draws what the run would have."""
    rows = make_rows([(i, 1) for i in range(7)] * 4 + [(0, 1), (1, 1)], "train")  # 30 rows, 7 distinct
    rows[29]["reward_model"]["ground_truth"] = "99"  # a prompt again, with another answer
    path = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(path)
    caplog.set_level(logging.INFO, logger="rlloop")
    section = DataSection(path=str(path))
    data = PromptData(section, tok, seed=3)
    assert "d.parquet: 30 rows, 8 distinct (prompt, answer) pairs" in caplog.text
    epoch = data.next_batch(8)
    assert sorted(p.index for p in epoch) == [0, 1, 2, 3, 4, 5, 6, 29]  # each pair's first row
    # as the eval reads its rows: by position, in file order
    assert [(p.index, p.answer) for p in map(data.get, range(len(data)))][-2:] == [(6, "7"), (29, "99")]
    drawn = data.next_batch(5)
    trained = PromptData(section, tok, seed=3)
    trained.next_batch(10)
    resumed = PromptData(section, tok, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(trained.state_dict())))
    assert [p.index for p in resumed.next_batch(3)] == [p.index for p in drawn[2:]]
    every = PromptData(section.model_copy(update=dict(dedup=False)), tok, seed=3)
    assert len(every) == 30
    with pytest.raises(DataError, match=r"has 8 rows, .* in data of 30 \(.*resume it with data.dedup=false\)"):
        PromptData(section, tok).load_state_dict(every.state_dict())


def test_a_literal_dotted_column_name_is_read(tmp_path, tok):
    """pandas.json_normalize writes `reward_model.ground_truth` as one column: it was "not found", in an error that
    listed it among the columns."""
    flat = pd.json_normalize(make_rows([(1, 2), (3, 4)], "train"), max_level=1)
    assert "reward_model.ground_truth" in flat.columns
    flat.to_parquet(tmp_path / "flat.parquet")
    data = PromptData(DataSection(path=str(tmp_path / "flat.parquet"), shuffle=False), tok)
    data.validate()
    assert [p.answer for p in data.next_batch(2)] == ["3", "7"]


def test_a_blank_user_message_is_an_error_even_after_a_system_prompt(tmp_path, tok):
    """A system prompt with a blank user turn (a conversion that read the wrong field) passed: the policy was asked
    nothing."""
    rows = make_rows([(1, 2), (3, 4)], "train")
    rows[1]["prompt"] = [{"role": "system", "content": "Answer with Answer: $Answer"}, {"role": "user", "content": " "}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DataError, match=r"d.jsonl: row 1 \(0-based\), data.prompt_key 'prompt': .*whose last \(the user"
    ):
        PromptData(DataSection(path=str(path)), tok).validate()


def test_an_unreachable_hub_dataset_says_to_download_it(tok):
    with pytest.raises(
        DataError, match=r"could not load from the Hugging Face hub .*download it first .* set data.path"
    ):
        PromptData(DataSection(path="BytedTsinghua-SIA/DAPO-Math-17k"), tok)


def test_two_snapshots_of_one_name_give_their_own_rows(tmp_path, tok):
    """datasets caches a directory whose README declares configs by its name and config alone: a second snapshot of
    that name (another revision, or new files in the same place) gave the first one's rows."""
    readme = "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n    path: en/train-*\n---\n"
    for n, revision in ((3, "a"), (5, "b")):
        d = snapshot(tmp_path / revision / "snap", {"en/train-00000-of-00001.parquet": frame(n)}, readme)
        assert len(PromptData(DataSection(path=str(d), subset="en"), tok)) == n


def test_a_save_to_disk_directory_gives_the_split_and_slice_asked_for(tmp_path, tok):
    """`Dataset.save_to_disk` (one split, "train", a state.json) and `DatasetDict.save_to_disk` (dataset_dict.json)
    read as `datasets` reads them: the slice of the split asked for, not the whole split."""
    datasets.Dataset.from_pandas(frame(10)).save_to_disk(tmp_path / "one")
    assert answers(DataSection(path=str(tmp_path / "one")), tok) == [str(i) for i in range(1, 11)]
    assert answers(DataSection(path=str(tmp_path / "one"), split="train[:3]"), tok) == ["1", "2", "3"]
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_pandas(frame(6)), test=datasets.Dataset.from_pandas(frame(4, first=50))
    )
    splits.save_to_disk(tmp_path / "dict")
    assert answers(DataSection(path=str(tmp_path / "dict"), split="test[50%:]"), tok) == ["53", "54"]


def test_a_split_string_joining_splits_reads_each_of_them(tmp_path, tok):
    """`data.split: train+test[:2]` on a snapshot directory reads what `datasets` reads: all of train, then the first
    two rows of test."""
    files = {"data/train-00000.parquet": frame(3), "data/test-00000.parquet": frame(4, first=50)}
    snap = snapshot(tmp_path / "snap", files)
    assert answers(DataSection(path=str(snap), split="train+test[:2]"), tok) == ["1", "2", "3", "51", "52"]


def test_a_directory_of_one_file_no_name_puts_in_a_split_is_read_without_a_warning(tmp_path, tok, caplog):
    """The warning that every file is trained on is for a directory whose files might hold a held-out set; one file
    holds none: it is read, said at info level only."""
    one = snapshot(tmp_path / "data", {"dapo-math-17k.parquet": frame(5)})
    assert len(PromptData(DataSection(path=str(one)), tok)) == 5
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("rlloop")]
    assert warned == []

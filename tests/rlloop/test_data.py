"""Prompt data: the sources users point at (jsonl, parquet, directory, hub id), errors, order and resume."""

import json
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoTokenizer

from rlloop.config import DataSection, load_config
from rlloop.data import PromptData, load_datasets
from rlloop.errors import DataError
from rlloop.tiny import ASSETS, make_rows

TRAIN = ASSETS / "data" / "train.jsonl"
TINY = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ASSETS / "model")


def rows(n=10, long_every=0):
    out = make_rows([(i, i + 1) for i in range(n)], "train")
    for i, r in enumerate(out):
        if long_every and i % long_every == 0:
            r["prompt"][0]["content"] += " pad" * 100
    return out


def test_jsonl_prompts_use_the_chat_template(tok):
    data = PromptData(DataSection(path=str(TRAIN), shuffle=False), tok)
    first = data.next_batch(1)[0]
    row = json.loads(TRAIN.read_text().splitlines()[0])
    assert first.answer == row["reward_model"]["ground_truth"]
    text = tok.decode(first.token_ids)
    assert text.startswith("<|im_start|>user\n" + row["prompt"][0]["content"])
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_parquet_and_directory_sources_agree(tmp_path, tok):
    (tmp_path / "parts").mkdir()
    df = pd.DataFrame(rows(10))
    df.iloc[:5].to_parquet(tmp_path / "parts" / "a.parquet")
    df.iloc[5:].to_parquet(tmp_path / "parts" / "b.parquet")
    df.to_parquet(tmp_path / "all.parquet")
    a = PromptData(DataSection(path=str(tmp_path / "all.parquet")), tok, seed=3).next_batch(10)
    b = PromptData(DataSection(path=str(tmp_path / "parts")), tok, seed=3).next_batch(10)
    assert [p.token_ids for p in a] == [p.token_ids for p in b]
    assert sorted(p.answer for p in a) == sorted(str(2 * i + 1) for i in range(10))


def test_a_directory_holding_several_splits_gives_the_one_asked_for(tmp_path, tok):
    """A hub snapshot's data/train-*.parquet and data/test-*.parquet: data.path at the snapshot trains on the train
    split alone (as `datasets.load_dataset(dir, split=...)` reads it), not on both; a `save_to_disk` directory reads
    too. The shipped tiny data directory holds train.jsonl and eval.jsonl: 336 rows to train on, not 400."""
    import datasets

    (tmp_path / "snap" / "data").mkdir(parents=True)
    df = pd.DataFrame(rows(10))
    df.iloc[:6].to_parquet(tmp_path / "snap" / "data" / "train-00000-of-00001.parquet")
    df.iloc[6:].to_parquet(tmp_path / "snap" / "data" / "test-00000-of-00001.parquet")
    (tmp_path / "snap" / "README.md").write_text("a dataset card")
    assert len(PromptData(DataSection(path=str(tmp_path / "snap")), tok)) == 6
    assert len(PromptData(DataSection(path=str(tmp_path / "snap"), split="test"), tok)) == 4
    with pytest.raises(DataError, match=r"snap has no 'validation' split \(it has train, test\)"):
        PromptData(DataSection(path=str(tmp_path / "snap"), split="validation"), tok)
    assert len(PromptData(DataSection(path=str(ASSETS / "data")), tok)) == len(TRAIN.read_text().splitlines()) == 336
    datasets.DatasetDict(train=datasets.Dataset.from_pandas(df)).save_to_disk(tmp_path / "saved")
    assert len(PromptData(DataSection(path=str(tmp_path / "saved")), tok)) == 10


def test_seeded_order_and_resume(tok):
    full = PromptData(DataSection(path=str(TRAIN)), tok, seed=7)
    first = [p.index for p in full.next_batch(300)] + [p.index for p in full.next_batch(100)]  # crosses an epoch
    again = PromptData(DataSection(path=str(TRAIN)), tok, seed=7)
    again.next_batch(300)
    resumed = PromptData(DataSection(path=str(TRAIN)), tok, seed=7)
    resumed.load_state_dict(again.state_dict())
    assert [p.index for p in resumed.next_batch(100)] == first[300:]
    assert [p.index for p in PromptData(DataSection(path=str(TRAIN)), tok, seed=8).next_batch(20)] != first[:20]
    assert sorted(first[: len(full)]) == list(range(len(full)))  # an epoch is a permutation
    assert first[len(full) :] != first[: 400 - len(full)]  # and each epoch a new one


def test_a_position_in_other_data_is_refused(tmp_path, tok):
    """--resume after data.path changed: the checkpoint's position would index rows that are not there (an
    IndexError mid-run), or silently other ones."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(rows(1)[0]) + "\n")
    trained = PromptData(DataSection(path=str(TRAIN)), tok, seed=7)
    trained.next_batch(40)
    with pytest.raises(DataError, match=r"one.jsonl has 1 rows, and the checkpoint's position is in data of \d+"):
        PromptData(DataSection(path=str(path)), tok).load_state_dict(trained.state_dict())


def test_a_resume_on_other_data_is_refused_before_anything_starts_and_the_run_is_left_as_it_was(tmp_path, caplog):
    """It was refused once Ray and the actors were up, after the run's config.yaml, metrics and report had been
    rewritten with the refused command's settings. And a resume that goes on names the settings it changes."""
    from rlloop.checkpoint import save_checkpoint
    from rlloop.config import load_config, to_yaml
    from rlloop.loop import train
    from rlloop.run_dir import warn_of_changes

    cfg = load_config(TINY, [f"run.dir={tmp_path}"])
    position = {"seed": 0, "epoch": 0, "position": 32, "dropped": 0, "rows": 7}  # a checkpoint of 7-row data
    save_checkpoint(tmp_path, 2, {"data": position}, lambda path: Path(path, "weights").write_text("w"))
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(TINY, [f"run.dir={tmp_path}", "train.lr=0.5"])))
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    with pytest.raises(DataError, match="the checkpoint's position is in data of 7"):
        train(cfg, resume=True)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    warn_of_changes(cfg)
    assert f"train.lr: 0.5 -> {cfg.train.lr}" in caplog.text

    # A Ray job's paths are in Ray's copy of its working_dir, a new one for the resumed job: not a change
    copy = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_{}/data/train.jsonl"
    (tmp_path / "config.yaml").write_text(
        to_yaml(load_config(TINY, [f"run.dir={tmp_path}", f"data.path={copy.format('a57c')}"]))
    )
    caplog.clear()
    warn_of_changes(load_config(TINY, [f"run.dir={tmp_path}", f"data.path={copy.format('5711')}"]))
    assert "settings other than the run's" not in caplog.text
    warn_of_changes(
        load_config(TINY, [f"run.dir={tmp_path}", f"data.path={copy.format('5711').replace('train', 'other')}"])
    )
    assert "data.path: " in caplog.text  # another file in the copy is still a change


def test_a_prompt_the_tokenizer_cannot_encode_names_its_row(tmp_path, tok):
    """The tiny character tokenizer has no unknown token: a character it lacks is a data error, not a traceback."""
    bad = rows(3)
    bad[2]["prompt"][0]["content"] = "Solve: 数学 + 9"
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    data = PromptData(DataSection(path=str(path), shuffle=False), tok)
    assert len(data.next_batch(2)) == 2
    with pytest.raises(DataError, match="bad.jsonl: row 2: the tokenizer cannot encode it"):
        data.next_batch(1)
    # and the check before a run finds it, though the row is short (rows within the length bound went untokenized)
    with pytest.raises(DataError, match="bad.jsonl: row 2: the tokenizer cannot encode it"):
        PromptData(DataSection(path=str(path)), tok).validate()


def byte_level_tokenizer(chat_template: str, nfc: bool = False):
    """A byte-level BPE without merges (a token per UTF-8 byte of the normalized text), optionally with Qwen's NFC."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    if nfc:
        core.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(tokenizer_object=core, chat_template=chat_template)


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_tokenizer_that_encodes_any_text_is_told_from_one_that_does_not(tok):
    from rlloop.data import encodes_any_text

    assert encodes_any_text(byte_level_tokenizer("{{ messages[0]['content'] }}"))
    assert not encodes_any_text(tok)  # the tiny character vocabulary, no unknown token


def test_chat_template_kwargs_reach_the_prompts_and_their_length_check(tmp_path):
    """Qwen3's template (TRL ships a copy) with data.chat_template_kwargs {enable_thinking: false} ends the prompt in
    an empty think block; the check before the run counts it too, so a prompt it pushes past the limit is found
    then, not when drawn."""
    trl = pytest.importorskip("trl", reason="the Qwen3 chat template comes from TRL (pip install -e '.[dev]')")
    import importlib.resources

    qwen3 = byte_level_tokenizer((importlib.resources.files(trl) / "chat_templates" / "qwen3.jinja").read_text())
    path = write_rows(tmp_path / "rows.jsonl", rows(1))
    thinking = PromptData(DataSection(path=path), qwen3).next_batch(1)[0].token_ids
    off = DataSection(path=path, chat_template_kwargs={"enable_thinking": False})
    not_thinking = PromptData(off, qwen3).next_batch(1)[0].token_ids
    assert qwen3.decode(not_thinking) == qwen3.decode(thinking) + "<think>\n\n</think>\n\n"
    fits_without = off.model_copy(update=dict(max_prompt_len=len(thinking) + 3, on_long_prompt="error"))
    PromptData(fits_without.model_copy(update=dict(chat_template_kwargs={})), qwen3).validate()
    with pytest.raises(DataError, match=f"row 0 has {len(not_thinking)} prompt tokens > data.max_prompt_len"):
        PromptData(fits_without, qwen3).validate()


def test_a_row_the_chat_template_refuses_is_a_data_error_before_the_run(tmp_path):
    """Templates raise on turns they do not take (Mistral's and Llama 2's on a system message or unalternated roles):
    the check before the run names the row, as drawing it would."""
    refuses_system = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with_system = rows(3)
    with_system[1]["prompt"].insert(0, {"role": "system", "content": "Be brief."})
    data = PromptData(
        DataSection(path=write_rows(tmp_path / "r.jsonl", with_system)), byte_level_tokenizer(refuses_system)
    )
    with pytest.raises(DataError, match="r.jsonl: row 1: the chat template refuses it: no system messages"):
        data.validate()


def test_the_length_check_counts_the_text_as_the_tokenizer_normalizes_it(tmp_path):
    """NFC decomposes U+0958 (3 UTF-8 bytes) into two characters (6 bytes): a bound on the raw bytes let a prompt of
    twice the limit's tokens through the check before the run (data.on_long_prompt: error)."""
    long_row = rows(1)
    long_row[0]["prompt"] = [{"role": "user", "content": "\u0958" * 40}]
    tokenizer = byte_level_tokenizer("{{ messages[0]['content'] }}", nfc=True)
    section = DataSection(path=write_rows(tmp_path / "r.jsonl", long_row), max_prompt_len=130, on_long_prompt="error")
    with pytest.raises(DataError, match="row 0 has 240 prompt tokens > data.max_prompt_len=130"):
        PromptData(section, tokenizer).validate()


def test_long_prompts_are_dropped_and_counted_or_an_error(tmp_path, tok, caplog):
    """The check before the run says how many will be left out (an eval file's were left out unsaid)."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(10, long_every=3)))
    data = PromptData(DataSection(path=str(path), max_prompt_len=100, shuffle=False), tok)
    data.validate()
    assert "d.jsonl: 4 of its 10 prompts are longer than data.max_prompt_len=100 tokens and are left out" in caplog.text
    batch = data.next_batch(6)
    assert len(batch) == 6 and all(len(p.token_ids) <= 100 for p in batch) and data.dropped == 3
    strict = PromptData(DataSection(path=str(path), max_prompt_len=100, shuffle=False, on_long_prompt="error"), tok)
    with pytest.raises(DataError, match="max_prompt_len=100"):
        strict.next_batch(2)


def test_long_eval_prompts_are_left_out_even_when_long_training_prompts_are_an_error(tmp_path, tok):
    """data.on_long_prompt=error is for the training data: the eval set, read with the training data's limit, leaves
    out the rows past it rather than ending the run."""
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(6, long_every=3)))  # rows 0 and 3 far too long
    cfg = load_config(TINY, ["data.on_long_prompt=error", f"eval.path={path}"])
    train, held_out = load_datasets(cfg, tok)
    held_out.validate()
    kept = [p.index for p in map(held_out.get, range(len(held_out))) if p is not None]
    assert kept == [1, 2, 4, 5] and held_out.dropped == 2
    assert train.cfg.on_long_prompt == "error"


def test_every_prompt_too_long_is_an_error_not_a_hang(tok):
    with pytest.raises(DataError, match="every prompt"):
        PromptData(DataSection(path=str(TRAIN), max_prompt_len=5), tok).next_batch(2)


def test_missing_column_names_it_and_lists_columns(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": "1+1", "answer": "2"}) + "\n" for _ in range(3)))
    with pytest.raises(DataError, match=r"column 'prompt' \(data.prompt_key\).*\['answer', 'question'\]"):
        PromptData(DataSection(path=str(path)), tok)
    data = PromptData(
        DataSection(path=str(path), prompt_key="question", answer_key="answer"), tok
    )  # a plain-string prompt column
    assert data.next_batch(1)[0].answer == "2"


def test_whole_numbers_in_a_float_column_are_written_as_integers(tmp_path, tok):
    """Arrow reads answers 3 and 2.5 as float64: the ground truth must be "3", which DAPO matches with "Answer: 3"."""
    table = rows(3)
    for r, answer in zip(table, (3, 2.5, -4)):
        r["reward_model"]["ground_truth"] = answer
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in table))
    data = PromptData(DataSection(path=str(path), shuffle=False), tok)
    assert [p.answer for p in data.next_batch(3)] == ["3", "2.5", "-4"]


def test_a_float32_answer_column_keeps_its_own_digits(tmp_path, tok):
    """A float32 column comes widened to float64: its 0.1 was the ground truth "0.10000000149011612", which no
    "Answer: 0.1" ever matched. A float64 column's 1.2345678901234 stays as written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [r["prompt"][0]["content"] for r in rows(3)]
    answers = {"f32": pa.array([0.1, 2.5, 1e-7], pa.float32()), "f64": pa.array([0.1, 1.2345678901234, 1e300])}
    for name, column in answers.items():
        pq.write_table(pa.table({"prompt": prompts, "answer": column}), tmp_path / f"{name}.parquet")
    read = {
        name: [
            p.answer
            for p in PromptData(
                DataSection(path=str(tmp_path / f"{name}.parquet"), shuffle=False, answer_key="answer"), tok
            ).next_batch(3)
        ]
        for name in answers
    }
    assert read == {"f32": ["0.1", "2.5", "1e-07"], "f64": ["0.1", "1.2345678901234", "1e+300"]}


def test_bad_sources(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "dir").mkdir()
    for path, message in [
        (tmp_path / "empty.jsonl", "no rows"),
        (tmp_path / "nope.jsonl", "no such file"),
        (tmp_path / "dir", "no .parquet"),
        (tmp_path / "x.csv", "unsupported format"),
    ]:
        with pytest.raises(DataError, match=message):
            PromptData(DataSection(path=str(path)), tok)


def test_hub_id_goes_through_the_hub_loader_and_fails_clearly_offline(tok):
    with pytest.raises(DataError, match="could not load from the Hugging Face hub"):
        PromptData(DataSection(path="BytedTsinghua-SIA/DAPO-Math-17k"), tok)


def test_a_prompts_cursor_draws_that_prompt_again(tok):
    """What a checkpoint stores for a prompt not yet trained: loaded, it draws that prompt next."""
    cfg = load_config(TINY, [])
    data, _ = load_datasets(cfg, tok)
    for p in data.next_batch(5):
        again, _ = load_datasets(cfg, tok)
        again.load_state_dict(p.cursor)
        assert again.next_batch(1)[0].index == p.index


def test_the_dropped_count_survives_a_resume(tmp_path, tok):
    """data/dropped_prompts goes on from the checkpoint's count after a resume, not from 0."""
    path = tmp_path / "mixed.jsonl"
    data = rows(20, long_every=2)  # every other prompt far past max_prompt_len
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    section = DataSection(path=str(path), max_prompt_len=100, on_long_prompt="drop")
    trained = PromptData(section, tok, seed=1)
    trained.next_batch(5)
    assert trained.dropped > 0
    resumed = PromptData(section, tok, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(trained.state_dict())))
    assert resumed.dropped == trained.dropped
    assert [p.index for p in resumed.next_batch(3)] == [p.index for p in trained.next_batch(3)]


def test_a_missing_relative_data_file_is_named_not_looked_for_on_the_hub(tmp_path, tok, monkeypatch):
    """A relative path to a .jsonl/.parquet file that is not there is a missing file (the message says so), not a
    hub id that could not be downloaded."""
    monkeypatch.chdir(tmp_path)
    for name in ("train.jsonl", "data/train.parquet"):
        with pytest.raises(DataError, match=f"data.path {name}: no such file or directory"):
            PromptData(DataSection(path=name), tok)

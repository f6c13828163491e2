"""Reward rules (DAPO's, boxed + math-verify, custom) and the scorer's failure handling."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from rlloop.config import RewardSection
from rlloop.errors import RewardError
from rlloop.reward_scorer import RewardScorer
from rlloop.rewards import dapo_reward, last_boxed, math_reward, normalize_final_answer, resolve

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("so the sum is 12.\nAnswer: 12", "12", 1.0),
        ("Answer: 11\nwait, no.\nAnswer: 12", "12", 1.0),  # the last Answer line counts
        ("Answer: 12\nactually Answer: 13", "12", -1.0),
        ("answer:  1,000", "1000", 1.0),  # case-insensitive, thousands separator
        ("Answer: $\\boxed{34}$", "34", 1.0),
        ("Answer: 5 degrees", "5", 1.0),  # units removed as in Minerva normalisation
        ("Answer: x = 7", "7", 1.0),  # the right-hand side of '='
        ("the answer is 12", "12", -1.0),  # no Answer line
        ("", "12", -1.0),
    ],
)
def test_dapo_reward(response, answer, expected):
    assert dapo_reward(response, answer) == expected


def test_dapo_reward_reads_only_the_last_300_characters():
    assert dapo_reward("Answer: 12\n" + "x" * 300, "12") == -1.0


def test_normalize_final_answer():
    assert normalize_final_answer("\\frac12") == "\\frac{1}{2}"
    assert normalize_final_answer("\\text{ 42 }") == "42"


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("thus \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1} then \\boxed{2}", "2", 1.0),
        ("\\boxed{\\sqrt{4}}", "2", 1.0),
        ("\\boxed{3}", "2", 0.0),
        ("no box, 2", "2", 0.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_last_boxed_nested():
    assert last_boxed("\\boxed{a} and \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    # without a brace, verl's reading (up to the next $), never a later, unrelated brace group
    assert last_boxed("so $\\boxed 7$. Check: {x+1} is even") == "7"
    assert last_boxed("\\boxedfoo {1}") is None


def test_resolve_errors_name_the_problem():
    with pytest.raises(ValueError, match="expected one of"):
        resolve("nope")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="has no function"):
        resolve("tests.rlloop.reward_fns:missing")


@pytest.mark.parametrize("fn", ["verl_style", "keyword_only", "response_only"])
def test_a_function_that_cannot_be_called_with_response_and_answer_is_refused(fn):
    """It failed on every sample, found only once the engines had started and generated."""
    with pytest.raises(ValueError, match=rf"reward.fn .*:{fn}': is called as fn\(response: str, answer: str\)"):
        resolve(f"tests.rlloop.reward_fns_wrong:{fn}")
    assert resolve("tests.rlloop.reward_fns_wrong:with_defaults")("r", "a") == 1.0


def test_a_module_that_exits_on_import_or_a_file_path_is_named():
    with pytest.raises(ValueError, match="cannot import module 'tests.rlloop.reward_fns_exit_on_import': SystemExit"):
        resolve("tests.rlloop.reward_fns_exit_on_import:score")
    with pytest.raises(ValueError, match="not a file path"):
        resolve("/home/me/my_reward.py:compute_score")


@pytest.mark.parametrize(
    "fn, failure",
    [
        ("dapo", -1.0),
        ("rlloop.rewards:dapo_reward", -1.0),  # the same function by its path: it defaulted to 0, above -1
        ("math", 0.0),
        ("tests.rlloop.reward_fns:raises", 0.0),
    ],
)
def test_a_failed_sample_scores_as_a_wrong_answer_by_default(fn, failure):
    """With dapo's -1 for a wrong answer and a failure reward of 0, a sample that timed out got its group's best
    advantage."""
    assert RewardSection(fn=fn).failure_reward == failure
    assert RewardSection(fn=fn, failure_reward=0.5).failure_reward == 0.5


def test_scorer_failures_get_the_failure_reward_and_are_counted(caplog):
    scorer = RewardScorer(RewardSection(fn="tests.rlloop.reward_fns:raises", failure_reward=-3.0, workers=1))
    try:
        with caplog.at_level("WARNING", logger="rlloop.reward_scorer"):
            assert scorer.score(["ok", "boom", "fine", "boom"], ["1"] * 4) == [1.0, -3.0, 1.0, -3.0]
            assert scorer.errors == 2
            scorer.cfg = scorer.cfg.model_copy(update={"fn": "tests.rlloop.reward_fns:not_a_number"})
            assert scorer.score(["a"], ["1"]) == [-3.0]
            assert scorer.errors == 3
        # each kind once: a new kind later in the run was never logged (only the first failure was)
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 2 and "raised RuntimeError" in warned[0] and "instead of a number" in warned[1], warned
    finally:
        scorer.close()


def test_scorer_timeout_kills_the_stuck_worker_and_goes_on(tmp_path):
    scorer = RewardScorer(
        RewardSection(fn="tests.rlloop.reward_fns:slow", timeout_s=2.0, failure_reward=-1.0, workers=1)
    )
    pid_file = tmp_path / "stuck.pid"
    try:
        scores = scorer.score(["a", f"sleep:{pid_file}", "b", "c"], ["1"] * 4)
        assert scores == [0.5, -1.0, 0.5, 0.5]
        assert scorer.timeouts == 1
        with pytest.raises(ProcessLookupError):  # the stuck worker was killed (and reaped), not left sleeping,
            os.kill(int(pid_file.read_text()), 0)
        assert not pid_file.with_suffix(".pid.woke").exists()  # nor waited out
        assert scorer.score(["d"], ["1"]) == [0.5]  # the scorer still works afterwards
    finally:
        scorer.close()


def test_hanging_samples_cost_their_own_sample_and_worker_only(tmp_path):
    """Two workers, 3 of 32 samples hang. Each fails alone, as a timeout, and only its own worker is replaced: every
    sample runs once (its chunk-mates done before it are kept, the other worker's chunk runs on), and 2 + 3 + 1
    workers start in all. The old pool ran the stuck sample's chunk again one sample at a time (the stuck one waiting
    out a second limit and killing the pool again) and restarted the other worker's chunk with each kill: it took
    ~3 x as long (11 s here, against 4 s)."""
    calls = tmp_path / "calls"
    scorer = RewardScorer(
        RewardSection(fn="tests.rlloop.reward_fns:counted", timeout_s=2.0, failure_reward=-1.0, workers=2)
    )
    responses = [f"{'hang' if i in (3, 12, 21) else 'ok'} {i}" for i in range(32)]
    try:
        assert scorer.score(["warm-up"] * 4, [str(tmp_path / "warm-up")] * 4) == [1.0] * 4  # chunks of 8 from now on
        scores = scorer.score(responses, [str(calls)] * 32)
        assert scores == [-1.0 if r.startswith("hang") else 1.0 for r in responses]
        assert (scorer.timeouts, scorer.errors) == (3, 0)
        pids, ran = zip(*(line.split(" ", 1) for line in calls.read_text().splitlines()))
        assert sorted(ran) == sorted(responses)  # each sample ran once
        # a new worker per hanging sample, and a spare (kept once the function has hung): 2 + 3 + 1
        assert len(set(pids)) <= scorer.worker_starts <= 6
    finally:
        scorer.close()
    assert not multiprocessing.active_children()


def test_scorer_survives_a_dying_worker():
    scorer = RewardScorer(RewardSection(fn="tests.rlloop.reward_fns:dies", failure_reward=0.0, workers=1))
    try:
        scores = scorer.score(["die"], ["1"])
        assert scores == [0.0] and scorer.errors == 1
        assert scorer.score(["ok", "ok"], ["1", "1"]) == [1.0, 1.0]
    finally:
        scorer.close()


def test_a_dying_worker_fails_only_the_sample_that_killed_it():
    """Two workers: "die" kills its own while "slow" is still running in the other. The pool breaks under both, but
    only the sample that dies again when run alone is the culprit."""
    scorer = RewardScorer(
        RewardSection(fn="tests.rlloop.reward_fns:dies_later", timeout_s=10.0, failure_reward=-7.0, workers=2)
    )
    try:
        assert scorer.score(["slow", "die"], ["1", "1"]) == [1.0, -7.0] and scorer.errors == 1
    finally:
        scorer.close()


def test_a_worker_killed_from_outside_mid_sample_costs_that_sample_nothing():
    """The OOM killer ends a worker while it scores a sample that is fine: the sample runs once more on a new worker
    and is scored, not given the failure reward (only a sample that kills its worker again is to blame)."""
    scorer = RewardScorer(
        RewardSection(fn="tests.rlloop.reward_fns:dies_later", timeout_s=30.0, failure_reward=-7.0, workers=1)
    )
    try:
        assert scorer.score(["ok"], ["1"]) == [1.0]  # the worker is up
        (worker,) = multiprocessing.active_children()
        killer = threading.Timer(0.4, os.kill, (worker.pid, signal.SIGKILL))  # "slow" runs for 1 s
        killer.start()
        assert scorer.score(["slow"], ["1"]) == [1.0]
        killer.join()
        assert (scorer.errors, scorer.timeouts, scorer.worker_starts) == (0, 0, 2)
    finally:
        scorer.close()


def test_each_sample_of_a_chunk_has_its_own_time_limit():
    """reward.timeout_s is per sample, from the answer to the sample before: six samples of 1 s each, sent to the one
    worker in chunks of three, all finish within a 2.5-s limit (a chunk's third ends 3 s after the chunk was sent)."""
    scorer = RewardScorer(
        RewardSection(fn="tests.rlloop.reward_fns:dies_later", timeout_s=2.5, failure_reward=-1.0, workers=1)
    )
    try:
        assert scorer._chunk_size(6) == 3
        assert scorer.score(["slow"] * 6, ["1"] * 6) == [1.0] * 6
        assert (scorer.errors, scorer.timeouts) == (0, 0)
    finally:
        scorer.close()


def test_a_worker_killed_between_calls_is_replaced():
    """A worker that dies while idle (the OOM killer) breaks the pool: the next call gets a new one, not an error."""
    scorer = RewardScorer(RewardSection(fn="tests.rlloop.reward_fns:exact", failure_reward=-1.0, workers=2))
    try:
        assert scorer.score(["1", "2"], ["1", "1"]) == [1.0, 0.0]
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
        time.sleep(0.5)
        assert scorer.score(["1", "2"], ["1", "1"]) == [1.0, 0.0] and scorer.errors == 0
    finally:
        scorer.close()


def test_a_value_whose_float_raises_is_a_failure_not_a_crash():
    scorer = RewardScorer(RewardSection(fn="tests.rlloop.reward_fns:lazy_value", failure_reward=-1.0, workers=1))
    try:
        assert scorer.score(["a"], ["1"]) == [-1.0] and scorer.errors == 1
    finally:
        scorer.close()


@pytest.mark.parametrize(
    "fn, culprit, want, counter",
    [("raises", "boom", 1.0, "errors"), ("slow", "sleep", 0.5, "timeouts"), ("dies", "die", 1.0, "errors")],
)
def test_a_failing_sample_in_a_chunk_fails_alone(fn, culprit, want, counter):
    """After a warm-up call (fast samples: chunks of 16 from then on), the one sample of 40 that raises, hangs or kills
    its worker gets the failure reward and is counted once, and the other 39, its chunk-mates included, are scored."""
    scorer = RewardScorer(
        RewardSection(fn=f"tests.rlloop.reward_fns:{fn}", timeout_s=2.0, failure_reward=-1.0, workers=1)
    )
    responses = ["ok"] * 40
    responses[13] = culprit
    try:
        assert scorer.score(["ok"] * 4, ["1"] * 4) == [want] * 4
        assert scorer._chunk_size(40) > 1  # the culprit has chunk-mates (16 unless the host is slow)
        scores = scorer.score(responses, ["1"] * 40)
        assert scores == [want] * 13 + [-1.0] + [want] * 26
        assert (scorer.errors, scorer.timeouts) == ((1, 0) if counter == "errors" else (0, 1))
    finally:
        scorer.close()


DRIVER = """
import torch  # what a driver's main module imports, a spawned reward worker imports again before its first sample
from rlloop.config import RewardSection
from rlloop.reward_scorer import RewardScorer

if __name__ == "__main__":
    scorer = RewardScorer(RewardSection(fn={spec!r}, timeout_s=0.3, failure_reward=-1.0, workers=2))
    print(scorer.score({responses!r}, ["1", "1", "1", "3"]), scorer.errors, scorer.timeouts)
    scorer.close()
"""


@pytest.mark.parametrize(
    "spec, responses",
    [
        ("tests.rlloop.reward_fns:exact", ["1", "2", "1", "3"]),
        ("math", [r"\boxed{1}", r"\boxed{2}", r"\boxed{1}", r"\boxed{3}"]),
    ],
)
def test_a_short_time_limit_is_not_spent_starting_the_workers(tmp_path, spec, responses):
    """A limit shorter than a worker's start (~1 s of imports) used to fail every sample of an instant function,
    pool after pool; `math`'s too, whose math-verify was imported at its first sample, not at the worker's start."""
    (tmp_path / "driver.py").write_text(DRIVER.format(spec=spec, responses=responses))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "driver.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip().splitlines()[-1] == "[1.0, 0.0, 1.0, 1.0] 0 0", out.stdout + out.stderr[-3000:]


def test_what_a_timed_out_function_started_goes_with_its_worker(tmp_path):
    """A code-execution reward runs a subprocess; one that hangs outlived the killed worker and the run."""
    scorer = RewardScorer(
        RewardSection(fn="tests.rlloop.reward_fns:runs_a_child", timeout_s=1.0, failure_reward=-1.0, workers=1)
    )
    pid_file = tmp_path / "child.pid"
    try:
        assert scorer.score([str(pid_file)], ["1"]) == [-1.0] and scorer.timeouts == 1
    finally:
        scorer.close()
    assert ended(int(pid_file.read_text()))


def ended(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` is gone or a zombie (killed, its parent gone, not yet reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_workers_that_die_as_they_start_end_the_scoring_with_one_clear_error():
    """A reward module that kills the process importing it in a worker (as a script without a main guard does):
    new pools were started forever, and no sample was ever scored."""
    scorer = RewardScorer(RewardSection(fn="tests.rlloop.reward_fns_child_dies:score", workers=1))
    try:
        with pytest.raises(RewardError, match="died .* as they started, 3 in a row.*if __name__"):
            scorer.score(["1"], ["1"])
    finally:
        scorer.close()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("value", ["1e39", "-3.5e38"])
def test_a_reward_past_float32_is_a_failure_not_an_infinite_advantage(value):
    scorer = RewardScorer(RewardSection(fn="tests.rlloop.reward_fns:as_float", failure_reward=-1.0, workers=1))
    try:
        assert scorer.score([value, "3e38"], ["1", "1"]) == [-1.0, 3e38] and scorer.errors == 1
    finally:
        scorer.close()

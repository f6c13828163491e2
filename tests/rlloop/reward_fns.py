"""Custom reward functions used by the tests through `reward.fn: tests.rlloop.reward_fns:NAME`."""

import os
import subprocess
import time

from rlloop.rewards import dapo_reward


def exact(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


def constant(response: str, answer: str) -> float:
    """Every response scores the same: no group carries a signal."""
    return 1.0


def fails_on_odd_length(response: str, answer: str) -> float:
    """Raises for about half the responses, deterministically: a run's failures are a count to compare."""
    if len(response) % 2:
        raise RuntimeError("odd length")
    return exact(response, answer)


def always_raises(response: str, answer: str) -> float:
    raise KeyError("answer")  # e.g. a field the function expects and the data does not have


def raises(response: str, answer: str) -> float:
    if "boom" in response:
        raise RuntimeError("reward function failed")
    return 1.0


def slow(response: str, answer: str) -> float:
    """Hangs on "sleep"; "sleep:PATH" writes the hanging worker's pid to PATH first and PATH.woke if it wakes up."""
    if "sleep" in response:
        pid_file = response.partition(":")[2]
        if pid_file:
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
        time.sleep(60)
        if pid_file:
            open(pid_file + ".woke", "w").close()
    return 0.5


def not_a_number(response: str, answer: str):
    return "high"


def dies(response: str, answer: str) -> float:
    if "die" in response:
        os._exit(1)
    return 1.0


def dies_later(response: str, answer: str) -> float:
    """ "slow" takes 1 s; "die" kills its worker 0.3 s in, while the other worker is still busy."""
    if "slow" in response:
        time.sleep(1.0)
    if "die" in response:
        time.sleep(0.3)
        os._exit(1)
    return 1.0


class _LazyValue:
    def __float__(self):
        raise ZeroDivisionError("lazy value")


def lazy_value(response: str, answer: str):
    return _LazyValue()


def agree_first_128(response: str, answer: str) -> float:
    """The first 128 samples scored (over every worker process, counted in the file RLLOOP_TEST_SCORED) all score 1:
    their groups carry no signal. Later ones score their response's length parity: groups that disagree."""
    fd = os.open(os.environ["RLLOOP_TEST_SCORED"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b".")
        scored = os.lseek(fd, 0, os.SEEK_CUR)  # an append's end is this call's own place in the count
    finally:
        os.close(fd)
    return 1.0 if scored <= 128 else float(len(response) % 2)


def runs_a_child(response: str, answer: str) -> float:
    """A code-execution reward whose program hangs: starts `sleep 600`, writes its pid to the file `response`, waits."""
    child = subprocess.Popen(["sleep", "600"])
    with open(response, "w") as f:
        f.write(str(child.pid))
    child.wait()
    return 1.0


def as_float(response: str, answer: str) -> float:
    return float(response)


def informative_quarter(response: str, answer: str) -> float:
    """DAPO's reward for a quarter of the prompts (answers divisible by 4); 0 for every sample of the rest, so that
    dynamic sampling drops about three groups in four."""
    return dapo_reward(response, answer) if answer.isdigit() and int(answer) % 4 == 0 else 0.0


def counted(response: str, answer: str) -> float:
    """Writes "PID RESPONSE" to the file `answer` at each call, then hangs on responses that start with "hang"."""
    with open(answer, "a") as f:
        f.write(f"{os.getpid()} {response}\n")
    if response.startswith("hang"):
        time.sleep(60)
    return 1.0

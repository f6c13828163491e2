"""Custom reward functions used by the tests through `reward.fn: tests.rlloop.reward_fns:NAME`."""

import os
import time


def exact(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


def raises(response: str, answer: str) -> float:
    if "boom" in response:
        raise RuntimeError("reward function failed")
    return 1.0


def slow(response: str, answer: str) -> float:
    if "sleep" in response:
        time.sleep(60)
    return 0.5


def not_a_number(response: str, answer: str):
    return "high"


def dies(response: str, answer: str) -> float:
    if "die" in response:
        os._exit(1)
    return 1.0

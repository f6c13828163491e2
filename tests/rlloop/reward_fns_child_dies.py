"""A reward module whose import kills any process but the main one: what a reward worker meets when a script that
starts a run has no main guard (the spawned worker imports it again and fails), or the OOM killer takes it as it
starts."""

import multiprocessing
import os

if multiprocessing.parent_process() is not None:
    os._exit(1)


def score(response: str, answer: str) -> float:
    return 1.0

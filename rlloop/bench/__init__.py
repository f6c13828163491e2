"""Benchmarks: `python -m rlloop.bench NAME`. Most compare systems side by side; each ends with one JSON line."""

import argparse


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a usage error, exit 2, otherwise)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not >= 1")
    return value

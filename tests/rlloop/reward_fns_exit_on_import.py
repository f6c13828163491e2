"""A reward module that parses the command line on import, as a script does, and exits: argparse's usage text ended
the run, naming neither reward.fn nor the module."""

import argparse

argparse.ArgumentParser().parse_args(["--no-such-flag"])


def score(response, answer):
    return 1.0

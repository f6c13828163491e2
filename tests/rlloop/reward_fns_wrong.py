"""Reward functions that cannot be called as fn(response, answer): refused by `resolve`, before the run starts."""


def verl_style(data_source, solution_str, ground_truth, extra_info=None):  # verl's compute_score
    return 1.0


def keyword_only(*, response, answer):
    return 1.0


def response_only(response):
    return 1.0


def with_defaults(response, answer, scale=1.0, **extra):  # callable as fn(response, answer): accepted
    return scale

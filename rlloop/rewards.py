"""Reward functions: the built-ins, and the resolution of `reward.fn` (rlloop/reward_scorer.py runs them).

Built-ins:
- `dapo`: DAPO's own rule (verl `math_dapo.compute_score`): the last "Answer: X" line in the final 300 characters,
  normalised as in Minerva, compared with the normalised ground truth; +1 correct, -1 otherwise.
- `math`: the last `\\boxed{...}`, graded for equivalence with `math-verify`; 1 correct, 0 otherwise.
- `package.module:function`: any `function(response: str, answer: str) -> float`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Callable

FLOAT32_MAX = 3.4028234663852886e38  # np.finfo(np.float32).max: the rollout keeps rewards in float32, past it inf

# --- DAPO (verl/utils/reward_score/math_dapo.py, Minerva normalisation) ---------------------------------------------
SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]
REMOVED_EXPRESSIONS = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(answer: str) -> str:
    answer = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_reward(response: str, answer: str) -> float:
    matches = ANSWER_LINE.findall(response[-300:])
    if not matches:
        return -1.0
    return 1.0 if normalize_final_answer(matches[-1]) == normalize_final_answer(answer) else -1.0


# --- boxed answers graded with math-verify ---------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces nested); for `\\boxed X` without a brace, as verl's
    `last_boxed_only_string` reads it, what follows up to the next `$`."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    after = text[start + len("\\boxed") :]
    if not after.lstrip().startswith("{"):
        bare = after.split("$")[0].strip() if after[:1].isspace() else ""  # not \\boxedX, another command
        return bare or None
    depth, begin = 0, text.find("{", start)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin + 1 : i]
    return None


def math_reward(response: str, answer: str) -> float:
    from math_verify import parse, verify

    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    gold = parse(f"${answer}$")
    pred = parse(f"${boxed}$")
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


BUILTIN = {"dapo": dapo_reward, "math": math_reward}
WRONG_ANSWER = {dapo_reward: -1.0, math_reward: 0.0}  # each built-in's score for a wrong answer


def wrong_answer_score(spec: str) -> float:
    """What `reward.fn` gives a wrong answer, known for the built-ins (by name or by module path); 0 for others."""
    fn = BUILTIN.get(spec) or next((f for f in BUILTIN.values() if spec == f"{__name__}:{f.__name__}"), None)
    return WRONG_ANSWER.get(fn, 0.0)


def resolve(spec: str) -> Callable[[str, str], float]:
    """`dapo`, `math` or `package.module:function`; raises ValueError naming what is wrong."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"reward.fn {spec!r}: expected one of {sorted(BUILTIN)} or 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward.fn {spec!r}: expected 'package.module:function', with both parts")
    if module_name.endswith(".py") or "/" in module_name:  # verl's custom_reward_function.path takes a file
        raise ValueError(
            f"reward.fn {spec!r}: give a module importable from the launch directory (my_rewards:fn for "
            "my_rewards.py there, or on PYTHONPATH), not a file path"
        )
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # the module's own code may raise, not parse, or parse argv and exit
        raise ValueError(f"reward.fn {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.fn {spec!r}: module {module_name!r} has no function {attr!r}")
    check_signature(spec, fn)
    return fn


def check_signature(spec: str, fn: Callable) -> None:
    """A function that cannot be called as fn(response, answer) failed on every sample, found only once the engines
    had started and generated (verl's compute_score(data_source, solution_str, ground_truth) is the usual one)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without one: taken on trust
        return
    try:
        signature.bind("response", "answer")
    except TypeError as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"reward.fn {spec!r}: is called as fn(response: str, answer: str) -> float, and {name}{signature} "
            f"cannot be ({e})"
        ) from None

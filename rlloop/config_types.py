"""The value types of the run config's keys and `Section`, the base of every YAML section: the ranges and refusals
that several keys share (counts, probabilities, timeouts, paths, rewards, top-k), declared once; rlloop/config.py
declares the sections with them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, ClassVar, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator

from rlloop.rewards import FLOAT32_MAX
from rollout.types import INT32_MAX

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]


def _within_float32(value: float) -> float:
    if abs(value) > FLOAT32_MAX:
        raise ValueError("rewards are float32: at most 3.4e38 in size")
    return value


Reward = Annotated[float, AfterValidator(_within_float32)]


def _top_k(k: int) -> int:  # the engine holds it as int32, and reads any value <= 0 as off
    if not -1 <= k <= INT32_MAX:
        raise ValueError(f"-1 (or 0) turns top-k off; otherwise the number of tokens kept, 1 to {INT32_MAX}")
    return k


TopK = Annotated[int, AfterValidator(_top_k)]  # -1 (or 0, as in HF): off; else sample from the k most likely tokens
Prob = Annotated[float, Field(gt=0, le=1)]
# Every timeout in the config: above 0 and at most 7 days, so that no wait overflows (threading's and Ray's waits
# turn seconds into C integers: `reward.timeout_s=1e12` and `cluster.actor_timeout_s=1e308` overflowed) and no
# value stands in for "never" (a null actor timeout is the way to say it).
MAX_TIMEOUT_S = 7 * 24 * 3600


def _at_most_a_week(seconds: float) -> float:
    if seconds > MAX_TIMEOUT_S:
        raise ValueError(f"a timeout is at most {MAX_TIMEOUT_S} s (7 days)")
    return seconds


TimeoutS = Annotated[float, Field(gt=0), AfterValidator(_at_most_a_week)]
# A local path or hub id; `~` is the home directory, as in a shell (a hub id never starts with it). Never empty:
# `data.path=''` read the working directory, and `run.dir=''` wrote the run into it.
PathStr = Annotated[str, Field(min_length=1), AfterValidator(os.path.expanduser)]


def _types_in(annotation) -> set:
    """The types an annotation names, through unions, Optional and containers' arguments."""
    return {annotation, *(t for arg in get_args(annotation) for t in _types_in(arg))}


class Section(BaseModel):
    # no knob takes inf or nan: `reward.timeout_s: inf` overflowed a wait, `failure_reward: nan` poisoned advantages
    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True, allow_inf_nan=False)
    # A component's field that another section sets (`knobs_of`): key -> where its value comes from
    wired_from: ClassVar[dict[str, str]] = {}

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value, info):
        """pydantic's lax mode reads True as 1: `train.lr=on` (YAML's boolean) would train at lr 1.0."""
        types = _types_in(cls.model_fields[info.field_name].annotation)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(item, bool) for item in items) and types & {int, float} and bool not in types:
            raise ValueError("expected a number, not a boolean (YAML reads yes/no/on/off as booleans)")
        return value


def knobs_of(component: type, wired: Mapping[str, str] | None = None) -> type[Section]:
    """A YAML section holding a component config's own knobs: every field of the (pydantic) dataclass `component`
    except the `wired` ones, which the run config fills in from other sections (field -> where its value comes from,
    which an unknown-key error names). Types, defaults and ranges are the component's, so a field added there is a
    YAML key here with nothing else to edit."""
    wired = dict(wired or {})
    fields = {name: (f.annotation, f) for name, f in component.__pydantic_fields__.items() if name not in wired}
    section = create_model(f"{component.__name__}Knobs", __base__=Section, **fields)
    section.wired_from = wired
    return section


def component_kwargs(section: BaseModel, component: type) -> dict:
    """The values of `section` that are fields of `component`."""
    return {
        name: getattr(section, name) for name in component.__pydantic_fields__ if name in type(section).model_fields
    }


def mapping_settings(root: type[BaseModel]) -> tuple[str, ...]:
    """The settings ("section.name") of `root`'s sections whose value is a mapping (a `dict[...]` field): one value
    each, which a child file or an override replaces as a whole."""
    return tuple(
        f"{section}.{name}"
        for section, field in root.model_fields.items()
        for name, setting in field.annotation.model_fields.items()
        if get_origin(setting.annotation) is dict
    )

"""SyncConfig: how one run's weights travel from the trainer to the engines, validated on construction.

The single declaration of the sync knobs: rlloop's YAML section `sync:` is made from these fields, and the factories
(`weight_sync.make_sender` / `make_receiver`, `rlloop.ray_sync.make_ray_sender` / `make_ray_receiver`) take it whole.
A pydantic dataclass, as the other components' configs, so that each field declares its own range, a bad value fails
with the field named, and it pickles to Ray actors as is.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass

PositiveInt = Annotated[int, Field(ge=1)]
# A pathlib.Path is accepted and stored as str (the factories took one); `~` is the home directory, as in a shell;
# never empty (it would name the working directory)
PathStr = Annotated[
    str,
    BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v),
    Field(min_length=1),
    AfterValidator(os.path.expanduser),
]


@dataclass(config=ConfigDict(extra="forbid"))
class SyncConfig:
    run_id: str  # names the run's shm segments / disk subdirectory / Ray mailbox; filled in by the orchestrator
    transport: Literal["shm", "disk", "ray"] = "shm"  # "ray" is built by rlloop.ray_sync: weight_sync stays Ray-free
    delta: bool = True  # send what changed since the last version; a keyframe now and then (protocol.py)
    keyframe_every: PositiveInt = 10  # a keyframe, then keyframe_every - 1 deltas
    keep: PositiveInt = 2  # versions the disk and Ray transports retain
    dir: PathStr | None = None  # the disk transport's root, shared between hosts

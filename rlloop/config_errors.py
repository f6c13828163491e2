"""Config errors: `ConfigError`, and pydantic's validation errors as one line each that names the key path.

`rlloop.run` exits with code 2 on a ConfigError. An unknown key gets the closest known one as a hint (or the keys its
section accepts), so a typo in a YAML file or an override says what was meant.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel

# What YAML (and so a file or an override) makes of text it reads as another type
TEXT_HINT = (
    "YAML reads yes/no/on/off as booleans, leading-zero numbers as octal (0123 is 83) and an empty value as null; "
    "quote it"
)


class ConfigError(Exception):
    """A config problem; the message names the key path. `rlloop.run` exits with code 2 on it."""


@contextmanager
def path_errors(key: str, path) -> Iterator[None]:
    """What the OS answers a look-up of `path` (a part over 255 bytes: ENAMETOOLONG; a directory it may not enter) as
    a ConfigError naming `key`, not a traceback from whichever check touched the path first."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"{key}: {path}: {e.strerror or e}") from None


def flow_mapping_hint(key, value) -> str:
    """How to write the mapping that YAML read as `{key: null}` when `key` holds a colon: `{a:b}`, with no space after
    the colon (Hydra's and JSON's habit), is YAML for the one key 'a:b' with no value."""
    if not (isinstance(key, str) and ":" in key and value is None):
        return ""
    name, _, written = key.partition(":")
    return (
        f" (YAML reads {{{key}}} as the key {key!r} with no value: put a space after the colon, {{{name}: {written}}})"
    )


def section_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The section class at `loc` (a path of field names from `root`); None when it is not a section."""
    cls: type = root
    for part in loc:
        field = cls.model_fields.get(str(part)) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return None
        cls = field.annotation
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def known_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    """The keys the section at `loc` accepts; [] when it is not a section."""
    section = section_at(root, loc)
    return list(section.model_fields) if section else []


def _unknown_key(err: dict, root: type[BaseModel], prefix: str) -> str:
    """Why a key is unknown: another section sets it, or the closest known key, or the keys its section accepts."""
    section = section_at(root, (prefix, *err["loc"][:-1]) if prefix else err["loc"][:-1])
    key = str(err["loc"][-1])
    wired = getattr(section, "wired_from", {})
    if key in wired:
        return f"not a key of this section: its value is set from {wired[key]}"
    known = list(section.model_fields) if section else []
    # the key of another section (train.tis_cap for grpo.tis_cap) first, then a typo of one of this section's
    elsewhere = [f"{name}.{key}" for name in root.model_fields if key in known_keys(root, (name,))]
    close = elsewhere or difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else (f"; known keys here: {', '.join(known)}" if known else "")
    return f"unknown key{hint}{flow_mapping_hint(err['loc'][-1], err.get('input'))}"


def describe(err: dict, root: type[BaseModel], prefix: str = "") -> str:
    """One line per pydantic error of validating `root`: the key path, then what is wrong (a model-level check names
    its keys itself)."""
    loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    got = err.get("input")
    if err["type"] == "extra_forbidden":
        return f"{loc}: {_unknown_key(err, root, prefix)}"
    if err["type"] == "missing":
        return f"{loc}: required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and loc and msg.split(" ", 1)[0] in known_keys(root, loc.split(".")):
        return f"{loc}.{msg}"  # a section's own check names its key bare: "profile_steps [40] go past steps=30"
    shown = isinstance(got, (str, int, float, list, tuple)) or got is None
    # A section's own check (a value_error at the section's path, or at no path) gets the whole section as input:
    # nothing worth echoing; a mapping where a value belongs is worth saying.
    mapping = isinstance(got, dict) and loc and err["type"] != "value_error"
    suffix = f", got {got!r}" if shown else (", got a mapping" if mapping else "")
    hint = flow_mapping_hint(err["loc"][-1], got) if err["loc"] else ""
    if err["type"] in ("string_type", "literal_error") and (got is None or isinstance(got, (bool, int, float))):
        hint += f" ({TEXT_HINT})"  # a text field YAML turned into something else
    return (f"{loc}: " if loc else "") + msg + suffix + hint

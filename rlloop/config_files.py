"""Reading a run config: YAML files, each merged over the file it `inherit`s from, then dotted command-line overrides,
into one plain dict (OmegaConf). Sections merge key by key; a mapping-valued setting (data.chat_template_kwargs,
cluster.*_resources, cluster.*_runtime_env) is one value, which a child file or an override replaces as a whole.
Relative paths in a file resolve against that file's directory when they exist there, so
`examples/grpo_dapo_tiny.yaml` works from any working directory. rlloop.config validates the result."""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlloop.config_errors import ConfigError, path_errors

PATH_KEYS = ("model.path", "model.tokenizer", "data.path", "eval.path")


def _load_yaml(path: Path, whole: tuple[str, ...], seen: tuple[Path, ...] = ()) -> dict:
    """One YAML file merged over the file it `inherit`s from (`whole`: the settings replaced, not merged), with its
    relative paths made absolute."""
    path = path.resolve()
    by = f" (inherited by {seen[-1]})" if seen else ""
    if path.is_dir():
        raise ConfigError(f"config file {path}{by} is a directory; expected a YAML file (examples/grpo_dapo.yaml)")
    if path.exists() and not path.is_file():  # /dev/null, a pipe: not "not found"
        raise ConfigError(
            f"config file {path}{by} is not a regular file; expected a YAML file (examples/grpo_dapo.yaml)"
        )
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}{by}")
    if path in seen:
        raise ConfigError(f"inherit: cycle through {path}")
    try:  # read first, so that an unreadable file is not reported as bad YAML
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}{by}: cannot read it: {e}") from None
    try:
        # the top level's type first: OmegaConf reads a bare word as a key, and fails on a number with no message
        top = yaml.safe_load(text)
        node = OmegaConf.to_container(OmegaConf.create(text)) if isinstance(top, dict) else top
    except Exception as e:  # OmegaConf's own errors, yaml.YAMLError and friends
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split()) or type(e).__name__}") from None
    if node is None:  # empty, or comments only
        node = {}
    if not isinstance(node, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections at the top level (run:, model:, data:, ...), got "
            f"{type(node).__name__} {node!r:.60}"
        )
    _no_null_sections(node, str(path))
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = (node.get(section) or {}).get(name) if isinstance(node.get(section), dict) else None
        if isinstance(value, str) and not Path(value).is_absolute():
            with path_errors(f"{path}: {key}", value):
                if (path.parent / value).exists():
                    node[section][name] = str((path.parent / value).resolve())
    parent = node.pop("inherit", None)
    if parent is None:
        return _merge({}, node, whole)  # its null mappings read as {}
    if not isinstance(parent, str):
        raise ConfigError(f"inherit: expected a file path, got {parent!r}")
    base = _load_yaml(path.parent / parent, whole, seen + (path,))
    for key, value in node.items():
        if isinstance(base.get(key), dict) and not isinstance(value, dict):
            raise ConfigError(
                f"{path}: {key}: expected a mapping of settings (over the section {key}: of {path.parent / parent}), "
                f"got {type(value).__name__} {value!r:.60}"
            )
    try:
        return _merge(base, node, whole)
    except Exception as e:  # OmegaConf's errors, TypeError for containers it cannot merge
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"{path}: cannot merge it over {path.parent / parent}: {reason}") from None


def _merge(base: dict, over: dict, whole: tuple[str, ...]) -> dict:
    """`over` merged into `base`, section by section and key by key, except the `whole` settings that `over` sets:
    those replace `base`'s value as a whole (OmegaConf would merge the mappings: `{}` could never clear one), and a
    null reads as `{}`. Both dicts are the caller's own, changed in place."""
    for key in whole:
        section, name = key.split(".")
        if isinstance(over.get(section), dict) and name in over[section]:
            if over[section][name] is None:
                over[section][name] = {}
            if isinstance(base.get(section), dict):
                base[section].pop(name, None)
    return OmegaConf.to_container(OmegaConf.merge(base, over))


def _no_null_sections(node: dict, where: str) -> None:
    """A top-level key with no value (`train:` above only a comment, or `run=null`) would replace the whole section,
    inherited settings included, by its defaults once any override sets a key in it: refused."""
    for key, value in node.items():
        if value is None and key != "inherit":
            raise ConfigError(
                f"{where}: {key}: a section cannot be null (it would reset every {key} setting, inherited ones "
                f"too, to its default); give it settings, or leave it out"
            )


def _check_override(item: str) -> None:
    """`a.b.c=value`: a key of non-empty dotted names, then `=`; the value may itself hold `=`."""
    key = item.split("=", 1)[0]
    if item[:1] in ("+", "~"):
        raise ConfigError(f"override {item!r}: write plain key.path=value (no Hydra-style {item[0]!r} prefix)")
    if "=" not in item or not key:
        raise ConfigError(f"override {item!r}: expected key.path=value, e.g. train.lr=2e-6")
    if any(not part or part != part.strip() for part in key.split(".")):
        raise ConfigError(f"override {item!r}: key {key!r} has an empty or space-padded part; expected key.path=value")


def read_config(path: Path, overrides: list[str] = (), whole: tuple[str, ...] = ()) -> dict:
    """The plain dict of `path` (following `inherit:`) with the `a.b=c` overrides applied, one at a time so that an
    error names the override that caused it. The `whole` settings (mapping-valued ones, "section.name") are replaced
    as a whole by a child file or an override, not merged. Raises ConfigError; rlloop.config validates the keys."""
    merged = _load_yaml(path, whole)
    for item in overrides:
        _check_override(item)
        key = item.split("=", 1)[0]
        # the mapping settings at or under `key` are replaced; `cluster.rollout_resources.node_a=1` sets one entry
        replaced = tuple(s for s in whole if f"{s}.".startswith(f"{key}."))
        try:
            override = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
            _no_null_sections(override, f"override {item!r}")
            merged = _merge(merged, override, replaced)
        except ConfigError:
            raise
        except Exception as e:  # OmegaConf's errors, and yaml's or TypeError for values it cannot parse or merge
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"override {item!r}: {reason}") from None
    try:
        return OmegaConf.to_container(OmegaConf.create(merged), resolve=True)
    except OmegaConfBaseException as e:  # e.g. an ${interpolation} that points nowhere
        raise ConfigError(f"config: {' '.join(str(e).split())}") from None

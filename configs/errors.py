"""Config errors that say where and what to change: the YAML file and its line, or the override.

:class:`ConfigError` is the one error of a bad config file, override or key (a ``ValueError``,
the house error policy). This module turns what PyYAML and pydantic raise into messages of one
shape: the source (``FILE line L, column C`` or ``override 'KEY=VALUE'``), the dotted key, what is
wrong, and the fix; an unknown key gets the nearest known key (:func:`difflib.get_close_matches`).
It imports no torch and nothing of the bus, like the rest of :mod:`configs`.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the fix."""


def _mark_text(err: yaml.YAMLError) -> tuple[str, str]:
    """``("line L, column C", problem)`` of a PyYAML error (its 0-based marks made 1-based; the
    problem says where the construct it was parsing began when that is elsewhere); ``("", text)``
    when PyYAML gives no position."""
    mark = getattr(err, "problem_mark", None)
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).strip()
    if context:
        began = ""
        if context_mark is not None and (
            mark is None or (context_mark.line, context_mark.column) != (mark.line, mark.column)
        ):
            began = f" that began at line {context_mark.line + 1}, column {context_mark.column + 1}"
        problem = f"{problem}, {context}{began}"
    mark = mark or context_mark
    if mark is None:
        return "", problem
    return f"line {mark.line + 1}, column {mark.column + 1}", problem


def read_yaml_file(path: Path) -> tuple[dict[str, Any], str]:
    """Read and parse a YAML config file.

    Returns:
        ``(mapping, text)``: the top-level mapping (``{}`` for an empty file) and the file's text
        (kept to find the line of a key later, :func:`key_line`).

    Raises:
        ConfigError: the file is missing or unreadable, is not valid YAML (naming the line and
            column PyYAML reports), or its top level is not a mapping.
    """
    if not path.is_file():
        hint = ""
        if "=" not in str(path) and path.suffix not in (".yaml", ".yml") and "/" not in str(path):
            hint = f"; if you meant an override, write it as {path}=VALUE"
        raise ConfigError(f"config file {path} does not exist{hint}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where, problem = _mark_text(err)
        raise ConfigError(
            f"config file {path}{', ' + where if where else ''}: not valid YAML ({problem}); "
            "fix the syntax there (check indentation, a missing ':' or an unclosed bracket or quote)"
        ) from None
    if data is None:
        return {}, text
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a YAML mapping at the top level (key: value lines), "
            f"not a {type(data).__name__}"
        )
    return data, text


def parse_override(override: str) -> tuple[list[str], Any]:
    """Split a ``dotted.key=value`` override into its key parts and its value parsed as YAML.

    Returns:
        ``(["trainer", "max_steps"], 20)`` for ``"trainer.max_steps=20"``.

    Raises:
        ConfigError: no ``=``, an empty key part, or a value that is not valid YAML (naming the
            override, the column within the value and the fix).
    """
    if "=" not in override:
        raise ConfigError(
            f"override {override!r} must look like key.sub=value (no '=' in it); "
            f"write {override.strip()}=VALUE, or give a config file path that exists"
        )
    key, _, value = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: the key {key.strip()!r} must look like key.sub (no empty parts)")
    try:
        return parts, yaml.safe_load(value)
    except yaml.YAMLError as err:
        where, problem = _mark_text(err)
        where = where.replace("line 1, ", "")  # a one-line value: the column is the useful part
        problem = problem.replace("line 1, ", "")
        raise ConfigError(
            f"override {override!r}: the value {value!r} is not valid YAML"
            f"{' at ' + where if where else ''} ({problem}); fix it, or quote the value to pass "
            "it as a string (KEY='\"VALUE\"' in a shell)"
        ) from None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field's type (``X``, ``X | None``, ``list[X]``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _model_at(model: type[BaseModel], parts: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model reached by walking ``parts`` (field names; list indices skipped) from ``model``."""
    for part in parts:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _section_model(field.annotation) if field is not None else None
        if model is None:
            return None
    return model


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of ``model`` and its nested sections (``trainer``, ``trainer.max_steps``, ...)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        inner = _section_model(field.annotation)
        if inner is not None:
            keys.extend(_all_keys(inner, f"{prefix}{name}."))
    return keys


def nearest_key(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The known dotted key closest to the unknown key at ``loc`` (``("trainer", "max_step")``):
    first among its section's own keys, then any key of the config ending in a close name
    (``trainer.group_size`` -> ``producers.group_size``); None when nothing is close
    (:func:`difflib.get_close_matches`, cutoff 0.6)."""
    name = str(loc[-1])
    parent = tuple(loc[:-1])
    section = _model_at(model, parent)
    if section is not None:
        close = difflib.get_close_matches(name, list(section.model_fields), n=1, cutoff=0.6)
        if close:
            return ".".join([*(str(p) for p in parent), close[0]])
    everywhere = _all_keys(model)
    leaves = {k.rsplit(".", 1)[-1] for k in everywhere}
    close = difflib.get_close_matches(name, sorted(leaves), n=1, cutoff=0.75)
    if close:
        matches = [k for k in everywhere if k.rsplit(".", 1)[-1] == close[0]]
        return " or ".join(matches[:3])
    return None


def key_line(text: str, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the key at ``loc`` in YAML ``text`` (the deepest part of it present),
    or None when the file does not hold it or cannot be composed."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)]
            if not match:
                break
            key_node, node = match[0]
            line = key_node.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _source(loc: tuple[Any, ...], path: Path, text: str, overrides: list[tuple[list[str], str]]) -> str:
    """Where the value at ``loc`` came from: the last override at or above it; else the file (with
    the key's line when the file holds it), plus the overrides below it (a section's or the whole
    config's check reads both)."""
    dotted = [str(p) for p in loc]
    for parts, override in reversed(overrides):
        if dotted[: len(parts)] == parts:
            return f"override {override!r}"
    line = key_line(text, loc) if loc else None
    below = [repr(o) for parts, o in overrides if parts[: len(dotted)] == dotted]
    return (
        f"{path}"
        + (f" line {line}" if line else "")
        + (f" with override{'s' if len(below) > 1 else ''} {', '.join(below)}" if below else "")
    )


def describe_validation(
    err: ValidationError, model: type[BaseModel], path: Path, text: str, overrides: list[tuple[list[str], str]]
) -> str:
    """The message of a config that parsed but does not validate: one line per error,
    ``  KEY: what is wrong (got VALUE); from SOURCE`` (SOURCE as :func:`_source`), an unknown key with
    the nearest known one.

    Args:
        err: pydantic's error for ``model.model_validate``.
        model: the config model (:class:`configs.schema.RunConfig`).
        path: the config file; ``text`` its YAML text (for line numbers).
        overrides: ``(key parts, override text)`` in the order applied.
    """
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        source = _source(loc, path, text, overrides)
        if e["type"] == "extra_forbidden":
            near = nearest_key(model, loc)
            fix = f"did you mean {near}?" if near else "remove it or check the spelling"
            lines.append(f"  {key}: unknown key ({source}); {fix} (every key: `busctl up --dry-run`)")
        elif isinstance(e.get("input"), dict):
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')} ({source})")
        else:
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r}; {source})")
    given = f" with {len(overrides)} override{'s' if len(overrides) > 1 else ''}" if overrides else ""
    return f"invalid config {path}{given}:\n" + "\n".join(lines)

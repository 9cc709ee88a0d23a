"""The configuration reference, generated from the config models: ``python -m configs.reference``.

Walks :class:`configs.schema.RunConfig` and every section below it (pydantic models derived from
:class:`configs.base.Section`) and renders ``docs/configuration.md``: one table per section (its
docstring, then each key as a dotted path with its type, default, bounds and description) and
the cross-field checks each section's validators enforce (their error messages, read from the
source). Lists of sections (``task.rewards``, ``eval.tasks``) are documented by their item
fields as ``task.rewards[].name``. The committed file must equal a fresh rendering
(``tests/docs/test_config_reference.py``); run this module after changing a config model.

Imports no torch (like the config package).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from configs.base import Section
from configs.schema import RunConfig

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
"""Where ``python -m configs.reference`` writes the reference."""


@dataclass(frozen=True)
class SectionRef:
    """One section of the config tree.

    Attributes:
        path: dotted path of the section (``"trainer.loss"``; ``""`` for the top level;
            ``"task.rewards[]"`` for the items of a list of sections).
        model: the pydantic model of the section.
    """

    path: str
    model: type[BaseModel]


def _section_in(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The section model an annotation holds, and how: ``"one"`` (``X``), ``"optional"``
    (``X | None``), ``"list"`` (``list[X]``); ``(None, "")`` for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation, "one"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
        if len(models) == 1 and type(None) in args:
            return models[0], "optional"
    if origin is list and len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], Section):
        return args[0], "list"
    return None, ""


def _child_path(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def sections(model: type[BaseModel] = RunConfig, path: str = "") -> list[SectionRef]:
    """Every section under ``model`` (itself first), depth first in field order."""
    out = [SectionRef(path, model)]
    for name, field in model.model_fields.items():
        sub, how = _section_in(field.annotation)
        if sub is not None:
            out += sections(sub, _child_path(path, name) + ("[]" if how == "list" else ""))
    return out


def type_name(annotation: Any) -> str:
    """A readable type: ``int``, ``float or null``, ``one of `a`, `b```, ``list[str]``."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and not get_args(annotation):
        if issubclass(annotation, Section):
            return "section"
        return annotation.__name__
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    return str(annotation).replace("typing.", "")


def _value(value: Any) -> str:
    """A default as YAML would spell it (JSON for containers)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if value == "" or value.strip() != value else value
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value)


def default_text(field: FieldInfo) -> str:
    """The default of a field: ``required``, a value, or the value its factory makes."""
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return f"`{_value(value)}`"


def bounds_text(field: FieldInfo) -> str:
    """The constraints pydantic checks on one field: ``>= 0, < 1, finite, pattern ...``."""
    parts = []
    for meta in field.metadata:
        if isinstance(meta, Ge):
            parts.append(f">= {_value(meta.ge)}")
        elif isinstance(meta, Gt):
            parts.append(f"> {_value(meta.gt)}")
        elif isinstance(meta, Le):
            parts.append(f"<= {_value(meta.le)}")
        elif isinstance(meta, Lt):
            parts.append(f"< {_value(meta.lt)}")
        elif isinstance(meta, MinLen):
            parts.append(f"length >= {meta.min_length}")
        elif isinstance(meta, MaxLen):
            parts.append(f"length <= {meta.max_length}")
        elif getattr(meta, "allow_inf_nan", True) is False:
            parts.append("finite")
        elif getattr(meta, "pattern", None):
            parts.append(f"matches `{meta.pattern}`")
    return ", ".join(parts)


def _md(text: str) -> str:
    """Plain text as markdown: reST literals become code spans; outside code spans ``*`` and
    a ``<`` that could open an HTML tag are escaped (no emphasis, no tags)."""
    spans = text.replace("``", "`").split("`")
    for i in range(0, len(spans), 2):  # even pieces lie outside code spans
        spans[i] = re.sub(r"<(?=[A-Za-z/!?])", r"\\<", spans[i].replace("*", "\\*"))
    return "`".join(spans)


def _cell(text: str) -> str:
    """Text fit for one markdown table cell: one line, pipes escaped, see :func:`_md`."""
    return _md(" ".join(text.split())).replace("|", "\\|")


def _summary(model: type[BaseModel]) -> str:
    """The first line of a section's docstring."""
    return _cell(inspect.cleandoc(model.__doc__ or "").split("\n\n")[0])


def _slug(path: str) -> str:
    """The GitHub anchor of the heading ``## `path` ``."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _heading(path: str) -> str:
    return path or "top level"


def validator_checks(model: type[BaseModel]) -> list[str]:
    """The cross-field checks of a section's own model validators: each validator's docstring
    when it has one, else the messages of the ``ValueError`` it raises, with the interpolated
    values shown as ``…``."""
    checks = []
    for name, dec in model.__pydantic_decorators__.model_validators.items():
        func = getattr(model, name, None) or dec.func
        if name not in model.__dict__:
            continue  # inherited: documented with its own section
        func = inspect.unwrap(getattr(func, "__func__", func))
        if func.__doc__:
            checks.append(inspect.cleandoc(func.__doc__).split("\n\n")[0].replace("\n", " "))
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        raises = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Raise)), key=lambda n: n.lineno)
        checks += [_message_template(n.exc.args[0]) for n in raises if isinstance(n.exc, ast.Call) and n.exc.args]
    return [c for c in checks if c]


def _message_template(node: ast.expr) -> str:
    """The literal text of an error-message expression (str, f-string, implicit concatenation)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_template(node.left) + _message_template(node.right)
    return ""


def section_markdown(ref: SectionRef) -> str:
    """The markdown of one section: heading, docstring, table of keys, cross-field checks."""
    doc = _md(inspect.cleandoc(ref.model.__doc__ or ""))
    lines = [f"## `{_heading(ref.path)}`", "", doc, ""]
    if ref.path.endswith("[]"):
        lines += [f"Each item of the list `{ref.path[:-2]}` is a mapping with these keys.", ""]
    lines += ["| key | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in ref.model.model_fields.items():
        path = _child_path(ref.path, name)
        sub, how = _section_in(field.annotation)
        description = field.description or (_summary(sub) if sub is not None else "")
        if sub is None:
            kind, default = type_name(field.annotation), default_text(field)
        elif how == "one":
            kind, default = f"section [`{path}`](#{_slug(path)})", "(section)"
        elif how == "optional":
            kind, default = f"section [`{path}`](#{_slug(path)}) or null", default_text(field)
        else:
            kind, default = f"list of [`{path}[]`](#{_slug(path + '[]')}) items", default_text(field)
        lines.append(
            f"| `{path}` | {_cell(kind)} | {_cell(default)} | {_cell(bounds_text(field))} | {_cell(description)} |"
        )
    checks = validator_checks(ref.model)
    if checks:
        lines += ["", "Refused combinations (the error `busctl up` prints, `…` standing for the values):", ""]
        lines += [f"- {_cell(c)}" for c in checks]
    return "\n".join(lines) + "\n"


HEADER = """\
# Configuration reference

<!-- Generated by `python -m configs.reference` from the models in configs/ (schema.py, rollout.py);
do not edit by hand: change the models and regenerate. tests/docs/test_config_reference.py fails
when this file is stale. -->

A run is one `RunConfig` (`configs/schema.py`), read from a YAML file (default
`configs/reverse_text.yaml`) with dotted overrides on top:

```
busctl up configs/gsm8k.yaml trainer.max_steps=20 trainer.loss.kl_tau=0.01
busctl up --dry-run sampling.temp_scheduler='{type: cosine, end_temperature: 0.5}'
```

Each override is `key.sub=value`, the value parsed as YAML. Unknown keys are errors, every value
is validated against the bounds below, and a bad key or value makes `busctl up` print the key
and the fix and exit with code 2. `busctl up --dry-run [CONFIG] [overrides]` prints the resolved,
validated config without running anything; every run saves it as `RUN_DIR/config.yaml`.

Types: `section` is a nested mapping (its own table below); `X or null` may be `null` (YAML
`null` or `~`); `one of` lists the accepted strings. Bounds are checked per key; the checks
across keys are listed under their section.
"""


def render() -> str:
    """The whole reference (markdown) for the current config models."""
    refs = sections()
    toc = ["## Sections", ""] + [
        f"- [`{_heading(r.path)}`](#{_slug(_heading(r.path))}): {_summary(r.model)}" for r in refs
    ]
    parts = [HEADER, "\n".join(toc) + "\n"] + [section_markdown(r) for r in refs]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Write the reference to ``docs/configuration.md`` (or ``--out``); ``--check`` only
    compares and exits 1 when the file is stale."""
    parser = argparse.ArgumentParser(prog="python -m configs.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOC_PATH, help="output file (default: docs/configuration.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from a fresh rendering")
    ns = parser.parse_args(argv)
    return write_or_check(ns.out, render(), check=ns.check, command="python -m configs.reference")


def write_or_check(out: Path, text: str, *, check: bool, command: str, note: str = "") -> int:
    """Write a generated document, or with ``check`` only compare it (exit code 1 and a hint to
    run ``command`` when ``out`` differs). Shared by the generated docs' command lines.

    Returns:
        The exit code: 0, or 1 for a stale file under ``check``.
    """
    if check:
        if (out.read_text() if out.is_file() else "") != text:
            print(f"{out} is stale: run `{command}`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

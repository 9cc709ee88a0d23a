"""docs/configuration.md: generated from the config models, complete, and never stale."""

from __future__ import annotations

import re
import typing
from typing import get_args

import yaml
from pydantic import BaseModel

from configs import reference
from configs.schema import RunConfig, load_config


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """Every pydantic model an annotation names (X, X | None, list[X])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every non-section key under ``model`` (list items as ``key[].sub``)."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        subs = _models_in(field.annotation)
        if not subs:
            out.append(path)
        is_list = typing.get_origin(field.annotation) is list
        for sub in subs:
            out += _leaves(sub, f"{path}[]." if is_list else f"{path}.")
    return out


def _rows(text: str) -> dict[str, list[str]]:
    """``{dotted key: [type, default, bounds, description]}`` from the reference's tables."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
    return rows


def test_committed_reference_is_fresh() -> None:
    committed = reference.DOC_PATH.read_text() if reference.DOC_PATH.is_file() else ""
    assert committed == reference.render(), (
        "docs/configuration.md is stale (a config model changed): "
        "run `python -m configs.reference` and commit the result"
    )


def test_every_leaf_key_has_a_row() -> None:
    rows = _rows(reference.render())
    leaves = _leaves(RunConfig)
    assert len(leaves) > 100
    missing = [p for p in leaves if p not in rows]
    assert not missing, f"keys missing from the reference: {missing}"
    assert all(len(r) == 4 for r in rows.values())
    assert all(r[3] for p, r in rows.items() if p in leaves), "every key has a description"


def test_rows_carry_types_bounds_and_cross_checks() -> None:
    text = reference.render()
    rows = _rows(text)
    assert rows["trainer.loss.kl_tau"][:3] == ["float", "`0.0`", ">= 0, finite"]
    assert rows["trainer.loss.eps_clip"][2] == "> 0, < 1, finite"
    assert rows["trainer.loss.type"][0] == "one of `aipo`, `ppo_clip`, `importance_sampling`, `gspo`"
    assert rows["sampling.seed"][:2] == ["int or null", "`null`"]
    assert rows["task.rewards[].name"][1:3] == ["required", "length >= 1"]
    assert rows["bus.curve_client"][2].startswith("matches `")
    assert "section [`trainer.loss`](#trainerloss)" in rows["trainer.loss"][0]
    # a model validator's refusal is listed under its section
    assert "- trainer.batch_size (…) must be a multiple of producers.group_size (…)" in text
    assert "## `trainer.loss`\n\nThe policy loss and its options" in text


def test_documented_defaults_are_the_defaults() -> None:
    """Each default, read back as YAML and given as an override, leaves the config unchanged."""
    default = RunConfig().model_dump(mode="json")
    rows = _rows(reference.render())
    checked = 0
    for path, (_kind, shown, _bounds, _desc) in rows.items():
        if "[]" in path or not shown.startswith("`") or shown == "`(section)`":
            continue
        parent = default
        for part in path.split(".")[:-1]:
            parent = parent[part]
        if parent is None:
            continue  # a key of an optional section that is off by default (sampling.temp_scheduler)
        text = shown.strip("`")
        node_new, node_old = load_config(None, [f"{path}={text}"]).model_dump(mode="json"), default
        for part in path.split("."):
            node_new, node_old = node_new[part], node_old[part]
        assert node_new == node_old, f"{path}: documented default {text!r} reads back as {yaml.safe_load(text)!r}"
        checked += 1
    assert checked > 100


def test_check_flag_detects_a_stale_file(tmp_path) -> None:
    out = tmp_path / "configuration.md"
    out.write_text("stale\n")
    assert reference.main(["--out", str(out), "--check"]) == 1
    assert reference.main(["--out", str(out)]) == 0
    assert reference.main(["--out", str(out), "--check"]) == 0
    assert out.read_text() == reference.render()

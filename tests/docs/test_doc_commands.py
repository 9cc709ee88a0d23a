"""The hand-written docs name only real config keys, and their `busctl up` commands are valid."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from busctl import cli as busctl
from configs.reference import sections
from configs.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
HAND_WRITTEN = [ROOT / "README.md", ROOT / "docs" / "quickstart.md", ROOT / "docs" / "operations.md"]
PEER_KEYS_DOC = ROOT / "docs" / "coming-from-trl.md"  # its tables' first column holds TRL's and verl's keys
OWN_DOCS = [*HAND_WRITTEN[1:], PEER_KEYS_DOC]  # README.md also names message types (`eval.result`) in code spans


def _keys() -> set[str]:
    """Every dotted config key (sections included), list items as ``key[].sub``."""
    keys = set()
    for ref in sections():
        for name in ref.model.model_fields:
            keys.add(f"{ref.path}.{name}" if ref.path else name)
    return keys


FILE_SUFFIXES = (".py", ".json", ".jsonl", ".yaml", ".yml", ".md", ".safetensors", ".prom", ".key", ".txt", ".png")


def _dotted_keys(text: str, top: set[str]) -> set[str]:
    """Config keys the text names: a whole code span `` `a.b` ``, or ``a.b=value`` anywhere,
    where ``a`` is a top-level key (file names like ``metrics.jsonl`` excluded)."""
    spans = re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", text)
    assignments = re.findall(r"(?<![\w/.-])([a-z_]+(?:\.[a-z_]+)+)=", text)
    return {t for t in [*spans, *assignments] if t.split(".")[0] in top and not t.endswith(FILE_SUFFIXES)}


@pytest.mark.parametrize("path", OWN_DOCS, ids=lambda p: p.name)
def test_config_keys_named_in_the_docs_exist(path: Path) -> None:
    keys = _keys()
    top = {k for k in keys if "." not in k} - {"name"}
    text = path.read_text()
    if path == PEER_KEYS_DOC:  # verl's `trainer.save_freq` is not rlbus's: only the rlbus columns are checked
        text = re.sub(r"(?m)^\|[^|\n]*\|", "|", text)
    named = _dotted_keys(text, top)
    unknown = sorted(k for k in named if k not in keys)
    assert not unknown, f"{path.name} names config keys that do not exist: {unknown} (see docs/configuration.md)"


def _up_commands(text: str) -> list[list[str]]:
    """The arguments after ``busctl up`` of every command line in a code block (not --resume;
    not ``text`` blocks, which hold usage synopses)."""
    commands = []
    for lang, block in re.findall(r"```([a-z]*)\n(.*?)```", text, re.S):
        if lang == "text":
            continue
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^(?:\S*/)?busctl up (.*)$", line)
            if m and "--resume" not in line and "[" not in line:  # not a usage synopsis
                commands.append(shlex.split(m.group(1)))
    for span in re.findall(r"`(?:\S*/)?busctl up ([^`]+)`", text):  # inline, possibly across a line break
        if "--resume" not in span and "..." not in span and "[" not in span:
            commands.append(shlex.split(" ".join(span.split())))
    return commands


def _stand_in_model(tmp_path: Path) -> Path:
    """A directory that passes busctl up's model checks (config.json, a tokenizer with a chat template)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return model


@pytest.mark.parametrize("path", HAND_WRITTEN, ids=lambda p: p.name)
def test_busctl_up_commands_in_the_docs_resolve(path: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    for args in _up_commands(path.read_text()):
        if any(a.startswith("bus.curve_keys_dir=") for a in args):
            keys = tmp_path / "keys"
            if not keys.exists():
                assert busctl.main(["keys", str(keys)]) == 0
            args = [f"bus.curve_keys_dir={keys}" if a.startswith("bus.curve_keys_dir=") else a for a in args]
        args = [a for a in args if a != "--dry-run"]
        # a model directory the docs name (/models/...) stands in as a real one: the command's config is checked,
        # and --dry-run checks model paths like busctl up does
        args = [
            f"{a.partition('=')[0]}={_stand_in_model(tmp_path)}"
            if a.startswith(("model.path=", "teacher.model_path="))
            else a
            for a in args
        ]
        # a GPU recipe (trainer.device: cuda) is checked under a one-GPU plan: busctl's CUDA_VISIBLE_DEVICES=0, as
        # tests/busctl/test_placement.py simulates it (a dry run starts nothing, so no GPU is needed)
        gpu = bool(args) and args[0].endswith(".yaml") and load_config(ROOT / args[0]).trainer.device == "cuda"
        with monkeypatch.context() as env:
            if gpu:
                env.setenv("CUDA_VISIBLE_DEVICES", "0")
            code = busctl.main(["up", "--dry-run", *args])
        out = capsys.readouterr()
        assert code == 0, f"{path.name}: `busctl up {' '.join(args)}` is invalid:\n{out.out}{out.err}"

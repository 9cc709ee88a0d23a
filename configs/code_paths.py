"""``task.code_paths``: the user's folders on the import path of busctl and of every component.

A relative entry starts at the config file's folder (one set by an override, at the working directory)
and is saved absolute, so ``RUN_DIR/config.yaml`` and ``--resume`` name the same folders. A module in
them that rlbus or an installed package already provides (``rewards.py``: rlbus's ``rewards`` package)
would not import as the user's everywhere: refused here. Where the folders go on the import path:
docs/ARCHITECTURE.md, "Tasks, reward terms and filters".
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from configs.errors import ConfigError


def _shadowed(folder: Path) -> list[tuple[str, str]]:
    """``(module, where it is imported from)`` for each module in ``folder`` that imports from elsewhere."""
    out = []
    for entry in sorted(folder.iterdir()):
        name = entry.stem if entry.suffix == ".py" else entry.name
        is_module = entry.suffix == ".py" or (entry / "__init__.py").is_file()
        if not is_module or not name.isidentifier():
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if spec is not None and (origin is None or not origin.is_relative_to(folder)):
            out.append((name, str(origin or spec.name)))
    return out


def resolve_code_paths(paths: list[str], base: Path) -> list[str]:
    """``paths`` as absolute folders, relative ones from ``base``.

    Raises:
        ConfigError: an entry that is not an existing folder, or holds a module another package provides.
    """
    out = []
    for i, raw in enumerate(paths):
        folder = (base / Path(raw).expanduser()).resolve()
        key = f"task.code_paths[{i}]"
        if not folder.is_dir():
            raise ConfigError(f"{key}: {raw!r} is not a folder (looked at {folder}; relative paths start at {base})")
        clash = _shadowed(folder)
        if clash:
            name, where = clash[0]
            raise ConfigError(
                f"{key}: {folder} holds the module {name!r}, which is imported from {where} instead; rename it"
            )
        out.append(str(folder))
    return out

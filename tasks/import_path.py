"""Resolving an import path ``"package.module:function"`` from the run config to a callable (custom
tasks, reward functions, advantage estimators). It runs the code it names, so paths come only from
the (trusted) run config, never from the bus. Light: reward children import it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any, Callable


def add_import_paths(folders: Iterable[str]) -> None:
    """Append each of ``folders`` (``task.code_paths``, absolute) to ``sys.path`` unless it is there."""
    for folder in folders:
        if folder not in sys.path:
            sys.path.append(folder)


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """The callable at ``path`` (dotted attributes allowed after the colon); ``what`` names it in errors.
    ValueError for a malformed path, a failed import, a missing attribute or a non-callable."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} import path={path!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{what} import path={path!r}: cannot import {module_name!r} ({exc}); check the path and sys.path"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} import path={path!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{what} import path={path!r} names a {type(obj).__name__}, not a function")
    return obj

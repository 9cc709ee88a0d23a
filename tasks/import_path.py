"""Resolving an import path ``"package.module:function"`` from the run config to a callable.

Used for custom tasks (``task.name``), custom reward functions (``task.rewards[].name``) and custom
advantage estimators (``rewards.advantage``). An import path executes the code it names, so paths
come only from the run config (trusted), never from the bus. Light on purpose: reward child
processes import it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """Resolve ``"package.module:function"`` (dotted attributes allowed after the colon) with importlib.

    Args:
        path: the import path from the config.
        what: what it names, for the error message (e.g. ``"reward"``, ``"advantage"``).

    Raises:
        ValueError: the path is malformed, the module does not import, the attribute is missing,
            or the object is not callable; the message names the path.
    """
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

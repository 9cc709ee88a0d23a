"""The tracker process's state file, ``RUN_DIR/trackers/state.json``: its one reader and writer.

Written atomically by the follower after every poll that read something; read by it on start, by ``busctl up``
(the trackers that failed) and by ``busctl report`` (each tracker's run id). Format::

    {"offsets": {"metrics.jsonl": <bytes read>, ...}, "trackers": {"<name>": {<its state>}, ...},
     "failed": {"<name>": "<error>", ...}, "config_logged": ["<name>", ...]}

Imports nothing heavy (busctl imports it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from runfiles.durable import write_json_atomic

log = logging.getLogger(__name__)

__all__ = ["read_tracker_state", "tracker_state_path", "write_tracker_state"]


def tracker_state_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/trackers/state.json``."""
    return Path(run_dir) / "trackers" / "state.json"


def _valid_offset(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_SECTIONS: dict[str, tuple[type, Any]] = {
    # section -> (its JSON type, a test each entry must pass)
    "offsets": (dict, lambda kv: isinstance(kv[0], str) and _valid_offset(kv[1])),
    "trackers": (dict, lambda kv: isinstance(kv[1], dict)),
    "failed": (dict, lambda kv: isinstance(kv[1], str)),
    "config_logged": (list, lambda name: isinstance(name, str)),
}


def read_tracker_state(run_dir: str | Path) -> dict[str, Any]:
    """The tracker state of ``run_dir``: only its well-formed sections and entries (``{}`` when the file is missing,
    unreadable, torn or not an object; a malformed section or entry is dropped with a warning). Never raises."""
    path = tracker_state_path(run_dir)
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:  # ValueError: not UTF-8 or not JSON (a torn or corrupt file)
        log.warning(
            "tracker state %s unreadable (%s); read as empty: the tracker files start from the beginning", path, err
        )
        return {}
    if not isinstance(state, dict):
        log.warning("tracker state %s holds a JSON %s, not an object; read as empty", path, type(state).__name__)
        return {}
    for key, (kind, valid) in _SECTIONS.items():
        if key not in state:
            continue
        section = state[key]
        if not isinstance(section, kind):
            log.warning(
                "tracker state %s: %r is a JSON %s, not %s; left out",
                path,
                key,
                type(section).__name__,
                "an object" if kind is dict else "a list",
            )
            del state[key]
            continue
        entries = list(section.items()) if kind is dict else list(section)
        kept = [e for e in entries if valid(e)]
        if len(kept) != len(entries):
            log.warning("tracker state %s: dropped %d malformed entries of %r", path, len(entries) - len(kept), key)
            state[key] = dict(kept) if kind is dict else kept
    return state


def write_tracker_state(run_dir: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``RUN_DIR/trackers/state.json`` atomically (creating ``trackers/``); OSError when it cannot
    be written, TypeError when ``state`` is not JSON-serializable."""
    path = tracker_state_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, state)

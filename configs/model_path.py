"""Where ``model.path`` (and ``teacher.model_path``) points: a local directory, or a Hugging Face hub id
resolved from the local HF cache only (offline; nothing is ever downloaded).

Every component that loads a model or its tokenizer (the trainer, the producers' vLLM engines,
the teacher, ``busctl up``) goes through :func:`resolve_model_path`, so they all load the same
files: ``busctl up`` resolves once while preparing the run and writes the directory into the run's
``config.yaml``; the loaders resolve again (a no-op for a directory) so direct callers (tests,
benches) get the same rule.

The HF cache layout (``huggingface_hub``'s, read here without it): ``<hub cache>/models--<org>--<name>/``
holds ``refs/<branch>`` (a file with a commit hash) and ``snapshots/<commit>/`` (the files).
The hub cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub`` (huggingface_hub's own order, read at call time so a changed
environment is honoured).

Invariants: an existing directory always wins over a hub id of the same spelling; a resolved path is
absolute and holds ``config.json``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: ``org/name`` with an optional ``@revision`` (a branch, tag or 40-hex commit); the hub's charset.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w.-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache directory (see the module docstring for the order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve_model_path(path: str | Path, *, key: str = "model.path") -> str:
    """The local directory of the model named by ``path``.

    Args:
        path: a directory (absolute, or relative to the working directory), or a hub id
            ``org/name`` / ``org/name@revision`` (default revision ``main``) that is in the local HF
            cache.
        key: the config key ``path`` came from, named in errors.

    Returns:
        The absolute directory (for a hub id: ``<hub cache>/models--org--name/snapshots/<commit>``).

    Raises:
        ValueError: ``path`` is empty.
        FileNotFoundError: ``path`` is neither a directory nor a hub id in the local cache; the
            message names ``key``, ``path`` and every place looked at.
    """
    text = str(path).strip()
    if not text:
        raise ValueError(f"{key} is empty: give a model directory or a hub id such as Qwen/Qwen2.5-0.5B-Instruct")
    local = Path(text).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(
                f"{key}={text!r}: the directory {local.resolve()} has no config.json (not a HF model directory)"
            )
        return str(local.resolve())
    match = _HUB_ID.match(text)
    if match is None or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{key}={text!r}: no such directory ({local.resolve()}), and not a hub id (org/name)")
    repo, revision = match["repo"], match["rev"] or "main"
    cache = hf_hub_cache()
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    looked = [f"directory {local.resolve()}"]
    if _COMMIT.match(revision):
        commit = revision
    else:
        ref = repo_dir / "refs" / revision
        looked.append(f"HF cache ref {ref}")
        commit = ref.read_text().strip() if ref.is_file() else ""
    snapshot = repo_dir / "snapshots" / commit if commit else None
    if snapshot is not None:
        looked.append(f"snapshot {snapshot}")
        if (snapshot / "config.json").is_file():
            return str(snapshot.resolve())
    raise FileNotFoundError(
        f"{key}={text!r} is not available offline: looked at {'; '.join(looked)} (hub cache {cache}: "
        f"$HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub). Download it first (e.g. "
        f"`hf download {repo}`) or point {key} at a local model directory"
    )


def resolve_run_model_paths(cfg) -> None:
    """Resolve ``cfg.model.path`` and ``cfg.teacher.model_path`` of a :class:`configs.schema.RunConfig`
    in place (each left alone when empty: the tiny policy is built later / no teacher), so the run's
    ``config.yaml`` names directories.

    Raises:
        FileNotFoundError: as :func:`resolve_model_path`, naming the key.
        ValueError: the policy's tokenizer has no chat template (:func:`require_chat_template`).
    """
    if cfg.model.path:
        cfg.model.path = resolve_model_path(cfg.model.path)
        require_chat_template(cfg.model.path)
    if cfg.teacher.model_path:
        cfg.teacher.model_path = resolve_model_path(cfg.teacher.model_path, key="teacher.model_path")


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the tokenizer saved in ``model_dir`` carries a chat template: a ``chat_template.jinja``
    file (transformers >= 4.43 saves it so) or a ``chat_template`` entry in ``tokenizer_config.json``
    (or ``chat_template.json``)."""
    root = Path(model_dir)
    if (root / "chat_template.jinja").is_file():
        return True
    for name in ("tokenizer_config.json", "chat_template.json"):
        try:
            data = json.loads((root / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("chat_template"):
            return True
    return False


def require_chat_template(model_dir: str | Path, *, key: str = "model.path") -> None:
    """Refuse a policy whose tokenizer has no chat template: the producers render every prompt with
    it (``apply_chat_template``), so without one every group would fail and be replaced forever.

    Raises:
        ValueError: no chat template in ``model_dir`` (names the key and the files looked at).
    """
    if not has_chat_template(model_dir):
        raise ValueError(
            f"{key}={str(model_dir)!r}: the tokenizer has no chat template (no chat_template.jinja, no 'chat_template' "
            f"in "
            "tokenizer_config.json): rlbus renders every prompt with it; use a chat/instruct checkpoint or add a "
            "template"
        )

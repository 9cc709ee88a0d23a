"""The W&B service process (``wandb-core``) that an in-process W&B run starts lives until ``wandb.teardown()``;
ended after this folder's tests, so no later test in the same pytest process finds it among its children."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True, scope="module")
def _end_wandb_service():
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()

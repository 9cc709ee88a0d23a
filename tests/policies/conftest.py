"""Shared fixtures of the policy-builder tests: one torch thread."""

from tests.torch_threads import one_torch_thread  # noqa: F401 - autouse fixture

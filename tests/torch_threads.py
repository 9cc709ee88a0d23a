"""A pytest fixture shared by the test packages that run tiny models: one torch thread."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny tensors: one thread is fastest, and avoids OpenMP spin-waits on a shared 2-core host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

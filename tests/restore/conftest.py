"""Restoration tests time compute against loads: one torch thread, as the benches use on this machine."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_compute_thread():
    """One torch thread: on a shared 2-core machine a second OpenMP thread stalls at every barrier."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

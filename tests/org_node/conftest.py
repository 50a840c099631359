"""Fixtures shared by the org node's tests."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch


@pytest.fixture
def restore_rng() -> Iterator[None]:
    """A Flower executor seeds the global RNGs; leave them as other tests expect."""
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])

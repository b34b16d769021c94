"""Accelerate keeps one AcceleratorState per process: each test starts from none."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()

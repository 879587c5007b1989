"""Fixtures for the UI tests."""

from __future__ import annotations

import pytest

from .fake_engine import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    """A fake engine that streams replies right away."""
    return FakeEngine()

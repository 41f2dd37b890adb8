"""Fixtures shared by the integration tests that drive real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ..fullstack._stack import Stack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """A relocated cpu-demo deployment (temp root, free ports); everything stopped after."""
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.cleanup()

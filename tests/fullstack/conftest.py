"""Full-stack fixtures: one generated tiny demo model per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpersist.demo.model import generate_model

    return generate_model("tiny", tmp_path_factory.mktemp("models") / "tiny")

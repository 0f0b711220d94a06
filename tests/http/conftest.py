"""Fixtures for the HTTP API tests: the served model, and scripted clusters whose gateway serves HTTP."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gateway"))  # scripted_nodes

from gateway.model import ServedModel


@pytest.fixture(scope="session")
def served_model(smollm2_dir: Path) -> ServedModel:
    return ServedModel.load(smollm2_dir)

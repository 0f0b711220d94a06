"""Fixtures for the gateway tests: the served model (tokenizer + config of the bundled SmolLM2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.model import ServedModel


@pytest.fixture(scope="session")
def served_model(smollm2_dir: Path) -> ServedModel:
    return ServedModel.load(smollm2_dir)

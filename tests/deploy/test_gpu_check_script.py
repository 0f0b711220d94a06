"""scripts/gpu-check.sh on a machine without CUDA: --dry-run lists its steps, a real run exits 77 saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_dry_run_lists_every_step() -> None:
    result = _run("--dry-run", "--out", "/tmp/unused")
    assert result.returncode == 0, result.stderr
    for step in ("detect CUDA", "install", "gpu tests", "measurements", "report"):
        assert step in result.stdout
    assert "/tmp/unused/gpu-check.json" in result.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a CUDA machine runs the check for real")
def test_without_cuda_it_exits_77_saying_so(tmp_path: Path) -> None:
    result = _run("--out", str(tmp_path / "out"), env={**os.environ, "GPU_VENV": str(tmp_path / "venv")})
    assert result.returncode == 77
    assert "no CUDA device" in result.stderr
    assert not (tmp_path / "venv").exists()  # nothing was installed

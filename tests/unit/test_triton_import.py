"""Which processes keep ``import triton`` (tandem_cli/triton_import.py): only those that may run a Triton kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config.settings import ModelSettings
from tandem_cli.triton_import import runs_triton


@pytest.mark.parametrize(("settings", "interpret", "expected"), [
    (ModelSettings(), None, False),  # the default CPU node: torch attention
    (ModelSettings(attention_backend="triton"), None, False),  # no interpreter: no Triton kernel can run on CPU
    (ModelSettings(attention_backend="triton"), "1", True),
    (ModelSettings(quantization_kernel="triton"), "1", True),
    (ModelSettings(), "1", False),
    (ModelSettings(device="cuda"), None, True),
])
def test_runs_triton(monkeypatch: pytest.MonkeyPatch, settings: ModelSettings, interpret: str | None,
                     expected: bool) -> None:
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert runs_triton(settings) is expected


def test_blocked_triton_reads_as_not_installed_to_torch() -> None:
    code = ("from common.config.settings import ModelSettings\n"
            "from tandem_cli.triton_import import block_unused_triton\n"
            "assert block_unused_triton(ModelSettings())\n"
            "import torch.utils._triton as t\n"
            "assert not t.has_triton_package()\n")
    env_free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                              env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert env_free.returncode == 0, env_free.stderr

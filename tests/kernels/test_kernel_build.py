"""A kernel build killed half way must not block the next one (it used to hang every later node forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.kernel_build import build_root, load_kernel_module

SOURCE = """
#include <torch/extension.h>
torch::Tensor twice(torch::Tensor x) { return x * 2; }
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_build_killed_mid_compile_leaves_nothing_that_blocks_the_next(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = build_root() / "tandem_test_twice"
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    # A builder process, killed (as a test or a start-up deadline kills a node) while its compiler runs.
    code = ("from common.kernel_build import load_kernel_module; import sys; "
            "from pathlib import Path; "
            "load_kernel_module('tandem_test_twice', [Path(sys.argv[1])], ['twice'], ['-O0'])")
    builder = subprocess.Popen([sys.executable, "-c", code, str(source)], env={**os.environ},
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not (build_dir / "lock").exists():
        assert builder.poll() is None, "the builder ended before it started compiling"
        assert time.monotonic() < deadline, "the builder never took torch's build lock"
        time.sleep(0.05)
    os.killpg(builder.pid, signal.SIGKILL)  # the compiler too
    builder.wait(10)
    assert (build_dir / "lock").exists()  # what torch's loader alone would wait on forever

    module = load_kernel_module("tandem_test_twice", [source], ["twice"], ["-O0"])
    assert torch.equal(module.twice(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))
    assert not (build_dir / "lock").exists()

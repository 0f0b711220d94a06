from __future__ import annotations

from pathlib import Path

import pytest

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer


@pytest.mark.real_model
@pytest.mark.parametrize("text", [
    "Hello, world! 12345 tokens.",
    "Ünïcödé: 日本語のテキスト and emoji 🚀🔥 mixed",
    "def f(x):\n    return x ** 2  # squared\n",
])
def test_incremental_equals_full_decode(smollm2_dir: Path, text: str) -> None:
    tok = Tokenizer(smollm2_dir)
    prompt = tok.encode("Prompt:")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never emits half a character

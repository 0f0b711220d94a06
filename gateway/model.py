"""What the gateway knows about the served model: its tokenizer, its limits, its shape (no weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.config.model_config import ModelConfig
from common.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedModel:
    """The model as the gateway sees it; loaded once at start-up and shared by every request."""

    name: str
    tokenizer: Tokenizer
    config: ModelConfig
    max_model_len: int  # prompt + generated tokens
    dtype: str
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        # The embedding's size, not the tokenizer's: an id past it would index out of the weights.
        return self.config.vocab_size

    @staticmethod
    def load(model_dir: Path, name: str = "", max_model_len: int = 0, dtype: str = "auto") -> ServedModel:
        """Read tokenizer and config.json from ``model_dir``; ``max_model_len`` 0 = the model's limit."""
        config = ModelConfig.from_pretrained(model_dir)
        tokenizer = Tokenizer(model_dir)
        limit = config.max_position_embeddings
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
        if dtype == "auto":
            raw = json.loads((model_dir / "config.json").read_text())
            dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        eos = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *config.eos_token_ids)))
        return ServedModel(name=name or model_dir.name, tokenizer=tokenizer, config=config,
                           max_model_len=max_model_len or limit, dtype=dtype, eos_token_ids=eos)

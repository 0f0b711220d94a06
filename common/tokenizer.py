"""The model's tokenizer and chat template, without torch or transformers.

Reads ``tokenizer.json`` with Hugging Face ``tokenizers`` and renders the chat template from
``tokenizer_config.json`` with a sandboxed Jinja environment configured as transformers configures
it, so prompts are byte-identical to ``apply_chat_template``. The gateway imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    """Encode, decode and apply the chat template of one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self._config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        gen_path = model_dir / "generation_config.json"
        self._generation: dict[str, Any] = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        template = self._config.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template

    def _special(self, key: str) -> str | None:
        value = self._config.get(key)
        if isinstance(value, dict):  # AddedToken serialised as a dict
            value = value.get("content")
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        return self._special("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special("eos_token")

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: generation_config's eos ids plus the tokenizer's eos."""
        ids: list[int] = []
        gen_eos = self._generation.get("eos_token_id")
        if isinstance(gen_eos, int):
            ids.append(gen_eos)
        elif isinstance(gen_eos, list):
            ids.extend(int(i) for i in gen_eos)
        if self.eos_token is not None:
            eos_id = self._tok.token_to_id(self.eos_token)
            if eos_id is not None and eos_id not in ids:
                ids.append(eos_id)
        return tuple(ids)

    def token_to_id(self, token: str) -> int | None:
        result = self._tok.token_to_id(token)
        return None if result is None else int(result)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in token_ids]

    def apply_chat_template(
        self, messages: list[ChatMessage] | list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render the chat template to text (encode it with ``add_special_tokens=False``)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of messages")
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        return str(
            _compiled_template(self.chat_template).render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        )

    def encode_chat(
        self, messages: list[ChatMessage] | list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """Compile once per template text, in transformers' sandboxed environment."""
    if source not in _TEMPLATES:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]

"""Incremental detokenization for streaming.

Decoding token by token breaks multi-byte characters and merges that depend on neighbours, so we
re-decode a short window: text is emitted only once it is stable (it no longer ends in an incomplete
UTF-8 sequence), as vLLM's ``detokenize_incrementally`` does with prefix/read offsets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.tokenizer import Tokenizer

# How many prompt tokens to keep as context for the first decode (a byte-level BPE needs very few).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed token ids one at a time (or a few), get the new text each time."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])[-_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly stable text (may be empty)."""
        self._ids.extend(token_ids)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            # The window slides: what was "new" becomes the context of the next decode. Ids before
            # it are never re-read, so drop them to keep every decode O(window).
            drop = self._read_offset
            self._ids = self._ids[drop:]
            self._prefix_offset = 0
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

"""The tokenizer side of GGUF conversion: llama.cpp's byte-level BPE vocabulary as Hugging Face files.

``build_tokenizer`` gives tokenizer.json's object; ``special_tokens_map`` and ``tokenizer_config`` the two
JSON files beside it. Only pre-tokenizers whose splitting rules are known to match llama.cpp are accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from common.model.gguf_layout import GGUFMetadata

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _digits_then_bytelevel() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm"/"starcoder" pre-tokenizers split every digit on its own before the GPT-2 regex.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _bytelevel_only() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


# `tokenizer.ggml.pre` -> the equivalent HF pre-tokenizer. Only names whose splitting rules are known
# to match llama.cpp exactly are listed; anything else fails loudly instead of tokenizing differently.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "smollm": _digits_then_bytelevel,
    "starcoder": _digits_then_bytelevel,
    "gpt-2": _bytelevel_only,
}


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF describes, as a Hugging Face ``tokenizers`` object."""
    tokenizer_model = meta.require("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {tokenizer_model!r}; only 'gpt2' (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}")

    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    # Merges are stored as "left right"; byte-level BPE symbols never contain a plain space.
    merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary contains duplicate tokens")

    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>, ...) must match whole and never be split by BPE;
    # they are special so that decode(skip_special_tokens=True) drops them.
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=token_type == _TOKEN_TYPE_CONTROL, normalized=False)
            for i, token_type in enumerate(token_types)
            if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        ]
    )
    return tokenizer


def special_tokens_map(meta: GGUFMetadata) -> dict[str, str]:
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    roles = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding", "unk_token": "unknown"}
    special: dict[str, str] = {}
    for role, key in roles.items():
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            special[role] = tokens[int(token_id)]
    return special


def tokenizer_config(meta: GGUFMetadata, config: dict[str, Any], special_tokens: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        # Byte-level BPE decodes exactly; the legacy clean-up would turn " ." into "." and break round trips.
        "clean_up_tokenization_spaces": False,
        **special_tokens,
    }
    chat_template = meta.get("tokenizer.chat_template")
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out

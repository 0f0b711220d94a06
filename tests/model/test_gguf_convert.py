"""GGUF -> Hugging Face conversion: the real bundled SmolLM2 model, plus tiny synthetic GGUF files.

Tests marked `real_model` convert the bundled SmolLM2-135M-Instruct once per session (a few seconds)
and check the result with `transformers`, which is the independent oracle: if it tokenizes, templates
and generates like the original model, the conversion is right.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from common.model import model_store
from common.model.gguf_convert import convert_gguf_to_hf
from common.model.model_store import (
    DEFAULT_MODEL,
    MARKER_NAME,
    find_bundled_gguf,
    prepare_default_model,
    resolve_model,
)

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

CHATML_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tandem-cache")


@pytest.fixture(scope="session")
def model_dir(cache_dir: Path) -> Path:
    # What a conversion killed mid-way leaves behind; the first prepare must clean it up.
    stale = cache_dir / "models" / f".{DEFAULT_MODEL}.tmp-1234-deadbeef"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    return prepare_default_model(cache_dir, progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# --- real model -------------------------------------------------------------------------------


@pytest.mark.real_model
def test_conversion_writes_a_complete_hf_directory(cache_dir: Path, model_dir: Path) -> None:
    assert model_dir == cache_dir / "models" / DEFAULT_MODEL
    names = {p.name for p in model_dir.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        MARKER_NAME,
    }
    # The atomic write leaves no temp or old directories behind, and stale ones were removed.
    assert [p.name for p in model_dir.parent.iterdir() if p.is_dir()] == [DEFAULT_MODEL]


@pytest.mark.real_model
def test_config_values(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {key: config.get(key) for key in expected} == expected
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == tok_config["pad_token"] == "<|im_end|>"
    assert tok_config["unk_token"] == "<|endoftext|>"
    assert tok_config["add_bos_token"] is False
    assert tok_config["model_max_length"] == 8192


@pytest.mark.real_model
def test_weights_are_float32_with_tied_embeddings(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="numpy") as f:
        keys = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        k_proj = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert len(keys) == 2 + 30 * 9
    assert "lm_head.weight" not in keys
    assert embed.dtype == np.float32 and embed.shape == (49152, 576)
    assert k_proj.shape == (3 * 64, 576)


@pytest.mark.real_model
def test_prepare_is_idempotent(cache_dir: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = model_dir / "model.safetensors"
    mtime_before = weights.stat().st_mtime_ns

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("convert_gguf_to_hf must not run when the cache is up to date")

    monkeypatch.setattr(model_store, "convert_gguf_to_hf", no_conversion)
    start = time.perf_counter()
    assert prepare_default_model(cache_dir, progress=False) == model_dir
    elapsed = time.perf_counter() - start
    assert weights.stat().st_mtime_ns == mtime_before
    assert elapsed < 1.0  # a marker check, not a conversion (which takes seconds)
    for alias in ("default", DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(alias, cache_dir, progress=False) == model_dir


@pytest.mark.real_model
def test_stale_marker_triggers_reconversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out_dir = tmp_path / "models" / DEFAULT_MODEL
    out_dir.mkdir(parents=True)
    (out_dir / MARKER_NAME).write_text(json.dumps({"converter_version": -1}))
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out: Path, progress: bool = True) -> None:
        calls.append(gguf_path)
        assert out == out_dir

    monkeypatch.setattr(model_store, "convert_gguf_to_hf", fake_convert)
    assert prepare_default_model(tmp_path, progress=False) == out_dir
    assert calls == [find_bundled_gguf()]
    # The new marker makes the next call a no-op.
    assert prepare_default_model(tmp_path, progress=False) == out_dir
    assert len(calls) == 1


@pytest.mark.real_model
def test_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 2
    assert tokenizer.unk_token_id == 0
    # Control tokens are matched whole inside text, and no BOS is prepended.
    assert tokenizer("<|im_start|>user\nHi<|im_end|>")["input_ids"] == [1, 4093, 198, 26843, 2]


@pytest.mark.real_model
@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "The year 2024 had 366 days.",
        "  leading,  double  spaces\n\ttab and newline ",
        "héllo wörld, 日本語, emoji 🙂",
        "def square(x: int) -> int:\n    return x ** 2  # ok\n",
    ],
)
def test_tokenizer_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


@pytest.mark.real_model
def test_digits_are_split_individually(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("12345")["input_ids"]
    assert len(ids) == 5
    assert [tokenizer.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


@pytest.mark.real_model
def test_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == CHATML_HI


@pytest.fixture(scope="module")
def causal_lm(model_dir: Path) -> LlamaForCausalLM:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.real_model
def test_greedy_generation_knows_paris(
    causal_lm: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> None:
    import torch

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = causal_lm.generate(**inputs, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in completion


# Loss limits sit between the correct conversion and a wrong q/k row order. Measured (nats/token):
# correct 1.78 / 0.93, q/k left in llama.cpp order 3.75 / 2.86, permuted the wrong way 5.11 / 4.24.
# "Paris" alone does not tell them apart: the model still says it with scrambled rotary pairs.
PROSE = (
    "Paris is the capital and largest city of France. With an estimated population of over two million "
    "residents, it is the centre of the Île-de-France region. The city is known for the Eiffel Tower, "
    "the Louvre museum, and its cafés. The river Seine flows through the middle of the city, dividing it "
    "into the Left Bank and the Right Bank."
)
CODE = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
    "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n"
)


@pytest.mark.real_model
@pytest.mark.parametrize(("text", "max_loss"), [(PROSE, 2.5), (CODE, 1.8)], ids=["prose", "code"])
def test_language_model_loss_is_low(
    causal_lm: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, text: str, max_loss: float
) -> None:
    # The decisive check of the weight layout: with q/k rows in the wrong order RoPE rotates the wrong
    # pairs of features, which shows up as a much worse next-token loss on ordinary text.
    import torch

    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        loss = causal_lm(**inputs, labels=inputs["input_ids"]).loss.item()
    assert loss < max_loss


# --- resolve_model without the real model ------------------------------------------------------


def test_resolve_model_returns_local_directory_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), tmp_path / "cache") == tmp_path


def test_resolve_model_rejects_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'gpt-17'.*SmolLM2-135M-Instruct"):
        resolve_model("gpt-17", tmp_path)
    with pytest.raises(ValueError, match=r"without config\.json"):
        resolve_model(str(tmp_path), tmp_path)


# --- synthetic GGUF files: layout and error handling ---------------------------------------------

# head_dim 8: for head_dim 4 the llama.cpp permutation is its own inverse and would hide a wrong direction.
TINY = {"hidden": 16, "heads": 2, "kv_heads": 1, "inter": 12, "vocab": 4}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, the transform the converter undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tiny_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, inter, v = TINY["hidden"], TINY["inter"], TINY["vocab"]
    kv = TINY["kv_heads"] * h // TINY["heads"]
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (h, h),
        "model.layers.0.self_attn.k_proj.weight": (kv, h),
        "model.layers.0.self_attn.v_proj.weight": (kv, h),
        "model.layers.0.self_attn.o_proj.weight": (h, h),
        "model.layers.0.mlp.gate_proj.weight": (inter, h),
        "model.layers.0.mlp.up_proj.weight": (inter, h),
        "model.layers.0.mlp.down_proj.weight": (h, inter),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _write_tiny_gguf(
    path: Path, hf: dict[str, np.ndarray], arch: str = "llama", embed_dtype: type = np.float32
) -> None:
    """Write `hf` (HF names and layout) as a llama.cpp-style GGUF: llama.cpp names, permuted q/k."""
    gguf_names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
        "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
        "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    }
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["<s>", "a", "b", "ab"])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, w in hf.items():
        if name.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, TINY["kv_heads"])
        if name == "model.embed_tokens.weight":
            w = w.astype(embed_dtype)
        writer.add_tensor(gguf_names[name], w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_round_trips_to_hf_layout(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    hf = _hf_tiny_weights(np.random.default_rng(0))
    _write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    converted = load_file(tmp_path / "out" / "model.safetensors")
    assert converted.keys() == hf.keys()
    for name, w in hf.items():
        np.testing.assert_array_equal(converted[name], w, err_msg=name)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is True
    tokenizer = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
    assert [(t["content"], t["special"]) for t in tokenizer["added_tokens"]] == [("<s>", True)]


def test_conversion_replaces_an_existing_directory(tmp_path: Path) -> None:
    hf = _hf_tiny_weights(np.random.default_rng(1))
    _write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("old")
    convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "stale.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["out", "tiny.gguf"]


def test_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "tiny.gguf", _hf_tiny_weights(np.random.default_rng(2)), arch="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_leaves_no_partial_directory(tmp_path: Path) -> None:
    hf = _hf_tiny_weights(np.random.default_rng(3))
    _write_tiny_gguf(tmp_path / "tiny.gguf", hf, embed_dtype=np.int8)
    with pytest.raises(ValueError, match=f"unsupported GGUF tensor type {GGMLQuantizationType.I8.name}"):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    # Neither the output nor the temporary directory survives a failed conversion.
    assert sorted(os.listdir(tmp_path)) == ["tiny.gguf"]

"""Convert a llama.cpp GGUF checkpoint into a Hugging Face Llama model directory.

The output is what `transformers.AutoModelForCausalLM` / `AutoTokenizer` and Tandem's own loader read:
config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
special_tokens_map.json and generation_config.json. Every value comes from the GGUF metadata; the
only knowledge baked in here is llama.cpp's naming and layout conventions, which are undone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from common.model.gguf_layout import GGUFMetadata, hf_tensor_name, rotary_row_order
from common.model.gguf_tokenizer import build_tokenizer, special_tokens_map, tokenizer_config

# Bump whenever the output of the conversion changes, so cached directories are rebuilt.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES = frozenset({"llama"})

# Types that `gguf.quants.dequantize` turns back into float32 exactly (the dequantized values are the
# model's real weights; float32 holds them without further loss).
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

# Hidden directories beside out_dir: `.{name}.tmp-*` is being built, `.{name}.old-*` is being deleted.
_SIBLING_ROLES = ("tmp", "old")

def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Convert a Llama-family GGUF file into a Hugging Face model directory at `out_dir`.

    Weights are dequantized to float32. The directory is built next to `out_dir` and renamed into
    place, so an interrupted conversion never leaves a partial `out_dir`; an existing `out_dir` is
    replaced. Raises `ValueError` for an unsupported architecture, tensor type, tensor name or tokenizer.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = GGUFMetadata(reader, gguf_path)

    config = _build_config(meta, reader)
    tokenizer = build_tokenizer(meta)
    if tokenizer.get_vocab_size(with_added_tokens=True) != config["vocab_size"]:
        raise ValueError(
            f"{gguf_path}: tokenizer has {tokenizer.get_vocab_size()} tokens "
            f"but the model's vocab_size is {config['vocab_size']}"
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = _make_sibling_dir(out_dir, "tmp")
    try:
        _write_json(tmp_dir / "config.json", config)
        tensors = _convert_tensors(reader, config, progress)
        # safetensors + "format": "pt" is what transformers expects from a PyTorch checkpoint.
        weights_path = tmp_dir / "model.safetensors"
        save_file(tensors, str(weights_path), metadata={"format": "pt"})
        del tensors
        # safetensors creates its file 0600; give it the umask-derived mode the other files got, so a
        # shared cache is readable by every service that can read config.json.
        os.chmod(weights_path, (tmp_dir / "config.json").stat().st_mode & 0o777)
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        _write_json(tmp_dir / "generation_config.json", _generation_config(config))
        special_tokens = special_tokens_map(meta)
        _write_json(tmp_dir / "special_tokens_map.json", special_tokens)
        _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config(meta, config, special_tokens))
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _build_config(meta: GGUFMetadata, reader: GGUFReader) -> dict[str, Any]:
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    rope_scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_scaling != "none":
        raise ValueError(f"unsupported GGUF rope scaling {rope_scaling!r}; only unscaled RoPE is supported")

    hidden_size = int(meta.require(f"{arch}.embedding_length"))
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"unsupported partial RoPE: rope dimension {rope_dim} != head dim {head_dim}")
    num_tokens = len(meta.require("tokenizer.ggml.tokens"))
    vocab_size = int(meta.get(f"{arch}.vocab_size", num_tokens))
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    # GGUF stores epsilon as float32 (1e-5 reads back as 9.99999974e-06); 7 significant digits is
    # exactly what float32 carries, so this recovers the value the model was trained with.
    rms_norm_eps = float(f"{float(meta.require(f'{arch}.attention.layer_norm_rms_epsilon')):.7g}")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "rms_norm_eps": rms_norm_eps,
        # transformers < 5 reads rope_theta at the top level; 5.x reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, as `LlamaForCausalLM` declares it ([out_features, in_features])."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = sorted(t.name for t in SUPPORTED_TENSOR_TYPES)
        raise ValueError(
            f"unsupported GGUF tensor type {tensor.tensor_type.name} for {tensor.name!r}; "
            f"supported: {supported}"
        )
    weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    # GGUF lists dimensions fastest-first (ggml's ne[0] is the row length); numpy is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return weights.reshape(shape)


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    # w: [num_heads * head_dim, hidden], rows in llama.cpp's interleaved RoPE order -> Hugging Face's.
    return np.ascontiguousarray(w[rotary_row_order(w.shape[0], num_heads)])


def _convert_tensors(reader: GGUFReader, config: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    expected = _expected_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name, config["num_hidden_layers"])
        weights = _dequantize(tensor)
        if weights.shape != expected[name]:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has shape {weights.shape}, expected {expected[name]} for {name}"
            )
        if name.endswith("q_proj.weight"):
            weights = _unpermute_rotary(weights, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weights = _unpermute_rotary(weights, config["num_key_value_heads"])
        tensors[name] = weights
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise ValueError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def remove_partial_conversions(out_dir: Path) -> list[Path]:
    """Delete temporary directories that killed conversions into `out_dir` left beside it.

    Only safe while no other conversion into `out_dir` runs (the caller holds a lock). Returns the
    removed paths.
    """
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return []
    stale = [
        p for role in _SIBLING_ROLES for p in out_dir.parent.glob(f".{out_dir.name}.{role}-*") if p.is_dir()
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _make_sibling_dir(path: Path, role: str) -> Path:
    """Create a fresh hidden directory beside `path` (same filesystem, so rename() is atomic)."""
    # Not tempfile.mkdtemp: that forces mode 0700, and the result becomes the cache directory itself.
    while True:
        candidate = path.parent / f".{path.name}.{role}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`; a previous `dst` is moved aside first, then deleted."""
    if not dst.exists():
        os.rename(src, dst)
        return
    # rename() cannot replace a non-empty directory, so swap via a sibling name on the same filesystem.
    old = _make_sibling_dir(dst, "old")
    os.rename(dst, old / dst.name)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)

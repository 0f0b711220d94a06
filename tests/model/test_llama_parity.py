"""Our Llama-family forward over a ragged batch matches transformers' reference implementation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.model_config import ModelConfig
from common.model.loader import load_model

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("mha-untied", "llama", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    ("gqa3-tied", "llama", {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96,
                            "tie_word_embeddings": True, "rope_theta": 500000.0}),
    ("gqa4-untied", "llama", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    ("llama-attention-bias", "llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2-qkv-bias-tied", "qwen2", {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96,
                                      "tie_word_embeddings": True, "rope_theta": 1000000.0}),
    ("mistral-gqa4", "mistral", {"num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": None}),
    ("llama3-rope-scaling", "llama", {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        "rope_theta": 500000.0}),
]


def _hf_logits(model_dir: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


@pytest.mark.parametrize(("name", "model_type", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_ragged_batch_logits_match_transformers(
    tiny_model_factory: Callable[..., Path], name: str, model_type: str, overrides: dict[str, Any]
) -> None:
    model_dir = tiny_model_factory(model_type, **overrides)
    config = ModelConfig.from_pretrained(model_dir)
    assert config.model_type == model_type
    model = load_model(model_dir, dtype="float32")
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 1, 17, 40]  # ragged, one single-token sequence
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    meta = AttentionMetadata.build(lengths, [0] * len(lengths))
    input_ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, meta))

    expected = torch.cat(_hf_logits(model_dir, seqs))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_config_reads_both_rope_layouts() -> None:
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    old = ModelConfig.from_dict({**base, "rope_theta": 100000.0})
    new = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})
    assert old.rope_theta == new.rope_theta == 100000.0
    llama3 = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert llama3.rope_scaling.rope_type == "llama3" and llama3.rope_scaling.factor == 8.0
    assert old.num_kv_heads == 2 and old.head_dim == 4


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("model_type", "gpt2", "model_type"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("rope_scaling", {"rope_type": "proportional", "factor": 2.0}, "rope_type"),
])
def test_config_rejects_unsupported(field: str, value: Any, needle: str) -> None:
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, field: value}
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict(raw)


def test_loader_refuses_incomplete_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    for f in tiny_model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights.*layers.1.mlp.gate_up_proj"):
        load_model(tmp_path, dtype="float32")


def test_sharded_checkpoint_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, str(tmp_path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_model(tmp_path, dtype="float32")
    single = load_model(tiny_model_dir, dtype="float32")
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(tiny_model_dir: Path, dtype: str) -> None:
    ref = load_model(tiny_model_dir, dtype="float32")
    half = load_model(tiny_model_dir, dtype=dtype)
    assert half.embed_tokens.weight.dtype == getattr(torch, dtype)
    ids = torch.arange(3, 30)
    meta = AttentionMetadata.build([len(ids)], [0])
    pos = torch.arange(len(ids))
    with torch.no_grad():
        a = ref.compute_logits(ref(ids, pos, meta))
        b = half.compute_logits(half(ids, pos, meta))
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_weights_are_allocated_once_in_their_final_dtype(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No fp32 copy first: the meta model takes the dtype, then each weight is allocated (issue 37: a model that
    fits a GPU in bf16 need not fit it in fp32)."""
    import common.model.loader as loader

    seen: set[torch.dtype] = set()
    allocate = loader._allocate

    def spy(model: Any, device: torch.device) -> Any:
        seen.update(p.dtype for p in model.parameters())
        return allocate(model, device)

    monkeypatch.setattr(loader, "_allocate", spy)
    model = loader.load_model(tiny_model_dir, dtype="bfloat16")
    assert seen == {torch.bfloat16} and model.dtype == torch.bfloat16

"""The family registry (common/model/families.py): Qwen3 on the one forward, greedy-identical to transformers, each
layer's sliding window read as transformers reads it (tests/model/test_sliding_window_models.py runs them), and
configs Tandem cannot honour refused at load naming the field.

Qwen3 configs are random-weight models saved by transformers in the hub's layout (tests/conftest.py): GQA 4:1,
2:1 and 1:1, ``head_dim`` decoupled from hidden / heads, tied and untied heads, ``attention_bias`` on and off,
with the eager reference ops and the fused C++ ones (TANDEM_FUSED_OPS).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from common.model.families import FAMILIES
from common.model.loader import load_model

if TYPE_CHECKING:
    from common.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]

# name -> overrides of the tiny config (hidden 64, 2 layers, vocab 128)
QWEN3: dict[str, dict[str, Any]] = {
    "gqa4-decoupled-untied": {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32},
    "gqa2-tied": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "mha-decoupled-tied": {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
                           "tie_word_embeddings": True},
    "gqa4-attention-bias": {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24,
                            "attention_bias": True},
}
GREEDY_TOKENS = 16


def _qwen3(factory: Callable[..., Path], name: str) -> Path:
    return factory("qwen3", seed=7, **QWEN3[name])


def _attention(model: LlamaForCausalLM) -> LlamaAttention:
    return cast("LlamaDecoderLayer", model.layers[0]).self_attn


def _hf(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation: the whole sequence through its forward at each step (no cache)."""
    hf, ids = _hf(model_dir), list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _with_tokenizer(model_dir: Path) -> Path:
    """A word-level tokenizer over the model's vocabulary (``t0`` ... ``t127``), so the offline ``LLM`` and
    ``tandem generate`` can run a random-weight model: the text is only a vehicle for the token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config.get("vocab_size") or config["text_config"]["vocab_size"]  # Gemma 3's image-and-text nests it
    if not (model_dir / "tokenizer.json").exists():
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.mark.parametrize("fused", ["on", "off"])
@pytest.mark.parametrize("name", sorted(QWEN3))
def test_qwen3_ragged_batch_logits_match_transformers(tiny_model_factory: Callable[..., Path], name: str, fused: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    model_dir = _qwen3(tiny_model_factory, name)
    model = load_model(model_dir, dtype="float32")
    assert model.config.qk_norm and model.fused_ops.name == ("cpp" if fused == "on" else "eager")
    attn = _attention(model)
    assert attn.q_norm is not None and attn.q_norm.weight.shape == (model.config.head_dim,)
    lengths = [5, 1, 17, 40]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    meta = AttentionMetadata.build(lengths, [0] * len(lengths))
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor([t for s in seqs for t in s]),
                                            torch.cat([torch.arange(n) for n in lengths]), meta))
        hf = _hf(model_dir)
        expected = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused", ["on", "off"])
def test_qwen3_offline_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path], fused: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline ``LLM``: a batch of prompts through the paged KV cache, prefill then decode steps."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    names = ("gqa4-decoupled-untied", "gqa2-tied") if fused == "on" else ("mha-decoupled-tied", "gqa4-attention-bias")
    for name in names:
        model_dir = _with_tokenizer(_qwen3(tiny_model_factory, name))
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 13)]
        with LLM(model_dir, dtype="float32", device="cpu") as llm:
            assert llm.model.decode_step is None  # the one-call C++ step has no q/k norms
            done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
        for prompt, completion in zip(prompts, done, strict=True):
            assert completion.token_ids == _hf_greedy(model_dir, prompt, GREEDY_TOKENS), name


def generate_cli(model_dir: Path, prompt: str, tokens: int, capsys: pytest.CaptureFixture[str],
                 *extra: str) -> tuple[str, str, str]:
    """``tandem generate`` of ``prompt`` (greedy, ``tokens`` tokens, ``extra`` flags): (its stdout, its stderr,
    what transformers' greedy continuation detokenizes to)."""
    from common.detokenizer import IncrementalDetokenizer
    from common.tokenizer import Tokenizer
    from tandem_cli.cli import main

    code = main(["generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", prompt,
                 "--max-tokens", str(tokens), "--ignore-eos", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    tokenizer = Tokenizer(model_dir)
    prompt_ids = tokenizer.encode(prompt)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return out.out, out.err, "".join(detok.add([t]) for t in _hf_greedy(model_dir, prompt_ids, tokens))


def test_qwen3_through_tandem_generate(tiny_model_factory: Callable[..., Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _with_tokenizer(_qwen3(tiny_model_factory, "gqa4-decoupled-untied"))
    prompt = "t17 t3 t99 t42 t8 t120 t64"
    stdout, stderr, expected = generate_cli(model_dir, prompt, GREEDY_TOKENS, capsys)
    assert stdout == prompt + expected + "\n"
    assert f"[{GREEDY_TOKENS} tokens" in stderr


def test_decode_step_is_not_installed_for_q_k_norms(tiny_model_factory: Callable[..., Path]) -> None:
    """The same shapes as a Llama that takes the one-call C++ step: Qwen3 keeps the op-by-op forward."""
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    llama = load_model(tiny_model_factory("llama", seed=7, **shape), dtype="float32")
    if llama.decode_step is None:
        pytest.skip("the one-call decode step does not build or apply on this machine")
    qwen3 = load_model(_qwen3(tiny_model_factory, "gqa2-tied"), dtype="float32")
    assert qwen3.decode_step is None and qwen3.fused_ops.name == "cpp"


def test_qwen3_int8_keeps_the_q_k_norms_float(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = _qwen3(tiny_model_factory, "gqa4-decoupled-untied")
    ref = load_model(model_dir, dtype="float32")
    int8 = load_model(model_dir, dtype="float32", quantization="int8")
    attn, ref_attn = _attention(int8), _attention(ref)
    assert attn.qkv_proj.format == "int8"
    assert attn.q_norm is not None and ref_attn.q_norm is not None
    assert attn.q_norm.weight.dtype == torch.float32 and torch.equal(attn.q_norm.weight, ref_attn.q_norm.weight)
    ids = torch.arange(3, 40)
    meta = AttentionMetadata.build([len(ids)], [0])
    with torch.no_grad():
        a = ref.compute_logits(ref(ids, torch.arange(len(ids)), meta))
        b = int8.compute_logits(int8(ids, torch.arange(len(ids)), meta))
    assert (a - b).abs().max() < 0.1 * a.abs().max()


# --- the registry and what it refuses ---

BASE: dict[str, Any] = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
                        "num_attention_heads": 2}


def test_supported_model_types_come_from_the_registry() -> None:
    assert SUPPORTED_MODEL_TYPES == tuple(FAMILIES) == ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral",
                                                        "qwen3_moe", "gpt_oss", "gemma2", "gemma3_text", "gemma3")
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, "
                                         r"qwen3, phi3, mixtral, qwen3_moe, gpt_oss, gemma2, gemma3_text, gemma3"):
        ModelConfig.from_dict({**BASE, "model_type": "gpt2"})


def test_family_options() -> None:
    llama = ModelConfig.from_dict({**BASE, "model_type": "llama", "attention_bias": True, "mlp_bias": True})
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    assert llama.rms_norm_eps == 1e-6 and llama.head_dim == 4  # transformers' default eps where the file has none
    mistral = ModelConfig.from_dict({**BASE, "model_type": "mistral", "attention_bias": True, "mlp_bias": True})
    assert (mistral.qkv_bias, mistral.o_bias, mistral.mlp_bias) == (False, False, False)  # transformers ignores them
    qwen2 = ModelConfig.from_dict({**BASE, "model_type": "qwen2"})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.rms_norm_eps) == (True, False, False, 1e-6)
    qwen3 = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm, qwen3.head_dim) == (False, False, True, 32)
    assert ModelConfig.from_dict({**BASE, "model_type": "qwen3"}).head_dim == 128  # transformers' default
    biased = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "attention_bias": True})
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, False)


@pytest.mark.parametrize(("model_type", "fields", "windows"), [
    ("mistral", {"sliding_window": 4096}, (4096,) * 4),  # every layer
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, (None, None, 8, 8)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, ()),  # max_window_layers 28: no layer reaches it
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
     (None, 8, None, None)),
    ("qwen3", {"use_sliding_window": False, "sliding_window": 8,  # no window without use_sliding_window
               "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]}, ()),
])
def test_each_layer_window_is_read(model_type: str, fields: dict[str, Any],
                                   windows: tuple[int | None, ...]) -> None:
    config = ModelConfig.from_dict({**BASE, "model_type": model_type, **fields})
    assert config.layer_windows == windows
    assert [config.layer_window(i) for i in range(4)] == list(windows or (None,) * 4)


@pytest.mark.parametrize(("model_type", "fields", "needle"), [
    ("mistral", {"sliding_window": 0}, r"sliding_window must be >= 1"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"] * 3},
     r"layer_types has 3 entries for 4 num_hidden_layers"),
])
def test_a_bad_window_is_refused_naming_the_field(model_type: str, fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict({**BASE, "model_type": model_type, **fields})


@pytest.mark.parametrize(("model_type", "fields"), [
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 2}),  # Qwen2.5's
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}),  # no layer reaches it
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"] * 4}),
    ("qwen3", {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}),  # Qwen3's
])
def test_a_window_no_layer_uses_is_accepted(model_type: str, fields: dict[str, Any]) -> None:
    ModelConfig.from_dict({**BASE, "model_type": model_type, **fields})


@pytest.mark.parametrize(("fields", "needle"), [
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"rope_scaling.rope_type 'longrope'"),
    ({"layer_types": ["chunked_attention"] * 4}, r"layer_types \['chunked_attention'\]"),
])
def test_other_settings_tandem_does_not_implement_are_refused(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict({**BASE, "model_type": "qwen3", **fields})


def test_gelu_checkpoints_are_refused_at_load(tiny_model_factory: Callable[..., Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tandem_cli.cli import main

    gelu = tiny_model_factory("llama", seed=3, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"hidden_act 'gelu'"):
        load_model(gelu, dtype="float32")
    # `tandem generate`: a start-up error naming the field, no traceback
    code = main(["generate", "--model", str(_with_tokenizer(gelu)), "--prompt", "t5", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "hidden_act 'gelu'" in err and "Traceback" not in err


def test_readme_lists_every_family() -> None:
    models_row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| Models"))
    for fam in FAMILIES.values():
        assert fam.architecture.removesuffix("ForCausalLM") in models_row, fam.model_type

"""The quantization benchmark's bookkeeping: bytes streamed per step, and its report from JSON alone."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_quant import report_lines, streamed_bytes
from common.model.loader import load_model


def test_streamed_bytes_count_packed_matrices_and_skip_the_embedding(tiny_model_dir: Path) -> None:
    dense = load_model(tiny_model_dir, dtype="float32")
    packed = load_model(tiny_model_dir, dtype="float32", quantization="int8")
    c = dense.config
    assert streamed_bytes(dense) == dense.weight_bytes - c.vocab_size * c.hidden_size * 4  # untied: no table read
    # int8: a byte per weight plus the scales, against 4 bytes per weight
    assert streamed_bytes(packed) < 0.3 * streamed_bytes(dense) + c.num_layers * c.hidden_size * 8 * 2


def test_report_lines_from_json() -> None:
    mode = {"mode": "none", "dtype": "float32", "weight_bytes": 2e8, "streamed_bytes": 1e8,
            "decode_tokens_per_s": 20.0, "offline_tokens_per_s": 100.0, "perplexity": 24.0, "token_match": None,
            "prefix_tokens": None, "streamed_gb_per_s": 2.0}
    int4 = {**mode, "mode": "int4", "decode_tokens_per_s": 60.0, "perplexity": 24.5, "token_match": 0.9,
            "prefix_tokens": 50.0}
    data = {"threads": 2, "simd_flags": ["avx2", "fma"], "kernels": "avx2", "modes": [mode, int4],
            "llamacpp": {"system": "llama.cpp", "decode_tokens_per_s": 50.0, "offline_tokens_per_s": 45.0,
                         "offline_note": "n"}, "llamacpp_note": ""}
    text = "\n".join(report_lines(data))
    assert "| int4 | float32 | 200 | 100 | **60.0** | 3.00x | 1.20x |" in text
    assert "+2.1%" in text and "90.0%" in text and "| llama.cpp | Q4_1 (GGUF) |" in text


def test_w8a8_is_measured_only_where_the_cpu_multiplies_int8_natively() -> None:
    from benchmarks.bench_quant import default_modes

    assert default_modes({"avx2", "fma", "f16c"}) == "none,int8,int4"
    assert default_modes({"avx2", "avx512f", "avx512_vnni"}) == "none,int8,int4,w8a8"
    assert default_modes({"avx2", "avx_vnni"}) == "none,int8,int4,w8a8"

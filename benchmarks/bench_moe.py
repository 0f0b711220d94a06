"""Routed experts on CPU: one decode step of a Qwen3-MoE-shaped model, Tandem's experts vs transformers' loop.

    python -m benchmarks.bench_moe [--quick] [--batch 32] [--context 64] [--threads N] [--json F]

A random-weight Qwen3-MoE model (64 experts, top-8, 16 layers by default, scaled down from Qwen3-30B-A3B's
128 experts / 48 layers / hidden 2048 to fit this machine) is saved by transformers in the hub's layout and
loaded by Tandem. ``batch`` sequences of ``context`` tokens are prefilled into the paged KV cache; then one
decode step (a token per sequence, the model's forward plus the LM head) is timed on the same weights, fp32:

- Tandem's default, ``PanelExperts`` (common/model/moe.py: the layer's experts in one C++ call on panels);
- Tandem with ``GroupedExperts`` (the same sort in PyTorch: batched matmuls, or one GEMM per expert);
- Tandem with ``LoopExperts`` (transformers' loop over the experts, on Tandem's forward: the same attention,
  norms and KV cache, only the experts differ);
- transformers' own ``Qwen3MoeForCausalLM`` forward of the same decode step (its DynamicCache holding the same
  prefilled context), as a cross-check.

Issue 36's goal: Tandem's step >= 3x faster than the loop. The greedy tokens of the step are compared across all
four (they must agree). The prefill of the contexts (``batch`` x ``context`` tokens in one step) is timed too,
where many rows per expert make the loop's overhead small. The experts' bytes per layer and the machine's read
bandwidth, measured in the same run, give each decode step's floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import cpu_summary

SHAPE: dict[str, Any] = {  # Qwen3-30B-A3B's proportions, scaled: experts 128 -> 64, layers 48 -> 16
    "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 192,
    "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
QUICK: dict[str, Any] = {"num_hidden_layers": 4, "num_experts": 32, "vocab_size": 2048}
BLOCK = 16
LABELS = {"panels": "C++ panels (default)", "grouped": "grouped (PyTorch)", "loop": "transformers' loop",
          "packed-int8": "int8 experts (--quantization int8)", "packed-int4": "int4 experts (--quantization int4)"}
# common/model/moe.py's PanelExperts, GroupedExperts, LoopExperts (fp32), then PackedExperts int8 / int4
FLOAT_WAYS = ("panels", "grouped", "loop")
WAYS = (*FLOAT_WAYS, "packed-int8", "packed-int4")


def save_model(directory: Path, shape: dict[str, Any]) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**shape)).to(torch.float32)
    with torch.no_grad():  # a decisive router (transformers initialises it near zero)
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def time_call(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, best) seconds per call after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def run(shape: dict[str, Any], batch: int, context: int, repeats: int) -> dict[str, Any]:
    import transformers

    from common.attention.metadata import AttentionMetadata
    from common.engine.model_runner import kv_cache_spec
    from common.kv.kv_cache import KVCache
    from common.model.loader import load_model
    from common.model.moe import GroupedExperts, LoopExperts, SparseMoE

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp), shape)
        model = load_model(model_dir, dtype="float32")  # PanelExperts where the C++ kernels build
        with _env("TANDEM_CPU_MOE", "off"):
            float_model = load_model(model_dir, dtype="float32")  # float w13 / w2: grouped, and the loop
        packed = {f"packed-{q}": load_model(model_dir, dtype="float32", quantization=q) for q in ("int8", "int4")}
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = (context + 1 + BLOCK - 1) // BLOCK
    cache = KVCache(kv_cache_spec(model, BLOCK), num_blocks=batch * blocks + 1)
    tables = [[1 + s * blocks + b for b in range(blocks)] for s in range(batch)]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (batch, context), generator=gen)

    def moes(m: Any) -> list[SparseMoE]:
        return [layer.mlp for layer in m.layers if isinstance(layer.mlp, SparseMoE)]

    def use(experts: str) -> Any:
        """The model that runs ``experts`` (panels: the default load; grouped / loop: the float one)."""
        if experts in packed:
            return packed[experts]
        if experts == "panels":
            assert all(m.experts.name == "panels" for m in moes(model)), "the C++ experts did not load here"
            return model
        for m in moes(float_model):
            m.experts = GroupedExperts() if experts == "grouped" else LoopExperts()
        return float_model

    prefill_meta = AttentionMetadata.build([context] * batch, [0] * batch, tables, BLOCK)
    prefill_positions = torch.arange(context).repeat(batch)

    current = model

    def prefill() -> torch.Tensor:
        with torch.inference_mode():
            hidden = current(prompts.reshape(-1), prefill_positions, prefill_meta, cache)
            return current.compute_logits(hidden[context - 1 :: context])

    first = prefill().argmax(-1)  # the first generated token of each sequence: the decode step's input
    decode_meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK)
    decode_positions = torch.full((batch,), context)

    def decode() -> torch.Tensor:
        with torch.inference_mode():
            return current.compute_logits(current(first, decode_positions, decode_meta, cache))

    out: dict[str, Any] = {"shape": shape, "batch": batch, "context": context, "threads": torch.get_num_threads(),
                           "cpu": cpu_summary()}
    tokens: dict[str, list[int]] = {}
    for name in WAYS:
        current = use(name)
        prefill()  # this model's own KV in the cache (the same values up to rounding)
        tokens[name] = decode().argmax(-1).tolist()
        out[f"decode_{name}_s"] = time_call(decode, repeats)
        out[f"prefill_{name}_s"] = time_call(prefill, max(2, repeats // 3))

    # transformers: the same context in its DynamicCache, then the same decode step
    with torch.inference_mode():
        past = hf(prompts, use_cache=True).past_key_values  # the filled cache (its output field keeps this name)
        hf_first = hf(prompts).logits[:, -1].argmax(-1)
    assert hf_first.tolist() == first.tolist(), "transformers' prefill chose other first tokens"
    position = torch.full((batch, 1), context)

    def hf_decode() -> torch.Tensor:
        with torch.inference_mode():
            cache_copy = _copy_cache(past)
            return hf(first[:, None], cache=cache_copy, position_ids=position, use_cache=True).logits[:, -1]

    tokens["transformers"] = hf_decode().argmax(-1).tolist()
    out["decode_transformers_s"] = time_call(hf_decode, max(2, repeats // 2))
    out["tokens_agree"] = all(tokens[name] == tokens["transformers"] for name in FLOAT_WAYS)
    out["packed_tokens_agree"] = {name: sum(a == b for a, b in zip(tokens[name], tokens["transformers"], strict=True))
                                  / batch for name in WAYS if name not in FLOAT_WAYS}
    for name in WAYS:
        out[f"{name}_vs_loop"] = out["decode_loop_s"][0] / out[f"decode_{name}_s"][0]
        out[f"{name}_prefill_vs_loop"] = out["prefill_loop_s"][0] / out[f"prefill_{name}_s"][0]
    out["speedup_vs_loop"] = out["panels_vs_loop"]
    out["expert_bytes_per_layer"] = 4 * shape["num_experts"] * 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
    out["read_gb_per_s"] = read_bandwidth() / 1e9
    out["floor_seconds"] = out["expert_bytes_per_layer"] * shape["num_hidden_layers"] / (out["read_gb_per_s"] * 1e9)
    out["speedup_vs_transformers"] = out["decode_transformers_s"][0] / out["decode_panels_s"][0]
    return out


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second this process reads from memory (a sum over a tensor far larger than any cache)."""
    data = torch.ones(nbytes // 4)
    seconds, _ = time_call(data.sum, 5)
    return nbytes / seconds


def _copy_cache(past: Any) -> Any:
    """A fresh copy of transformers' cache (its decode step appends to the one it is given)."""
    import copy

    return copy.deepcopy(past)


def markdown(result: dict[str, Any]) -> str:
    s = result["shape"]
    ms = {k: v[0] * 1000 for k, v in result.items() if k.endswith("_s") and isinstance(v, list | tuple)}
    lines = [
        f"Qwen3-MoE-shaped random model: {s['num_experts']} experts, top-{s['num_experts_per_tok']}, "
        f"{s['num_hidden_layers']} layers, hidden {s['hidden_size']}, expert width {s['moe_intermediate_size']}, "
        f"fp32, {result['threads']} threads. CPU: {result['cpu']}.",
        "",
        f"The experts' weights: {result['expert_bytes_per_layer'] / 1e6:.1f} MB per routed layer; this machine read "
        f"{result['read_gb_per_s']:.1f} GB/s in the same run, so reading every expert once per step takes at least "
        f"{result['floor_seconds'] * 1e3:.1f} ms over the {s['num_hidden_layers']} layers.",
        "",
        f"Decode step of {result['batch']} sequences ({result['context']} tokens of context each), median ms:",
        "",
        "| experts | decode step (ms) | vs loop | prefill of the contexts (ms) | vs loop |",
        "|---|---:|---:|---:|---:|",
        *(f"| Tandem, {LABELS[name]} | {ms[f'decode_{name}_s']:.1f} | {result[f'{name}_vs_loop']:.2f}x | "
          f"{ms[f'prefill_{name}_s']:.0f} | {result[f'{name}_prefill_vs_loop']:.2f}x |" for name in WAYS),
        f"| transformers' own forward | {ms['decode_transformers_s']:.1f} | "
        f"{ms['decode_loop_s'] / ms['decode_transformers_s']:.2f}x | | |",
        "",
        f"Greedy tokens of the step agree across the fp32 ways and transformers: {result['tokens_agree']}; "
        "the packed experts' tokens equal transformers' for "
        + ", ".join(f"{name} {share:.0%}" for name, share in result["packed_tokens_agree"].items())
        + f" of the sequences. Goal (issue 36): Tandem's "
        f"default (C++ panels) >= 3x "
        f"the loop: {'met' if result['speedup_vs_loop'] >= 3 else 'not met'} ({result['speedup_vs_loop']:.2f}x).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4-layer, 32-expert model (a smoke run)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = {**SHAPE, **(QUICK if args.quick else {})}
    result = run(shape, args.batch, args.context, 3 if args.quick else args.repeats)
    print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

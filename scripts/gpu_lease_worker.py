"""What the GPU lease (scripts/gpu_lease.py) runs in processes of its own, on the lent GPU:

    python scripts/gpu_lease_worker.py warmup
    python scripts/gpu_lease_worker.py e2e --section e2e --config C --tokenizer T --dir D [--prompts N --tokens N]

warmup: benchmarks/gpu_check.py's attention shapes at a tiny size, so FlashInfer's JIT compiles them before
they are timed. e2e: a model folder from the bundle's config and tokenizer plus random bf16 weights made on
the GPU (once, in scratch: an 8B model is 16 GB), then gpu_check's end-to-end tokens/s on it. Each prints its
rows as JSON lines, as gpu_check does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any


def llama_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter name -> shape of a Llama-family checkpoint ([out_features, in_features])."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (hidden,), f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
                   f"{p}.self_attn.k_proj.weight": (kv_dim, hidden), f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
                   f"{p}.self_attn.o_proj.weight": (hidden, q_dim), f"{p}.post_attention_layernorm.weight": (hidden,),
                   f"{p}.mlp.gate_proj.weight": (inter, hidden), f"{p}.mlp.up_proj.weight": (inter, hidden),
                   f"{p}.mlp.down_proj.weight": (hidden, inter)}
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def write_random_weights(model_dir: Path, device: str, shard_bytes: int = 4 << 30) -> int:
    """Random bf16 weights for ``model_dir/config.json`` (norms 1, the rest N(0, 0.02)), sharded safetensors
    with an index, made on ``device``. Returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    generator = torch.Generator(device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(shard, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, shape in llama_shapes(config).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * 0.02).cpu()
        shard[name] = tensor
        total += tensor.numel() * 2
        if sum(t.numel() * 2 for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def prepare_model(config: Path, tokenizer: Path, model_dir: Path, device: str) -> float:
    """``model_dir`` = the bundle's config + tokenizer + random weights (made once). Returns seconds spent."""
    started = time.monotonic()
    if not (model_dir / "model.safetensors.index.json").is_file():
        shutil.rmtree(model_dir, ignore_errors=True)
        model_dir.mkdir(parents=True)
        shutil.copy(config, model_dir / "config.json")
        for path in tokenizer.iterdir():
            shutil.copy(path, model_dir / path.name)
        write_random_weights(model_dir, device)
    return time.monotonic() - started


def e2e_main(args: argparse.Namespace) -> None:
    weights_s = prepare_model(args.config, args.tokenizer, args.dir, "cuda")
    print(f"# random weights for {args.dir.name}: {weights_s:.0f}s", flush=True)
    from benchmarks.gpu_check import end_to_end

    for row in end_to_end(args.section, str(args.dir), "triton", args.prompts, args.tokens):
        print(json.dumps({**row, "weights_s": round(weights_s, 1)}), flush=True)


def warmup_main() -> None:
    """The measured attention shapes at a tiny size: FlashInfer (and Triton) compile them now, not when timed."""
    from benchmarks.gpu_check import attention

    for section, query_lens, context_lens in (("decode", [1] * 4, [256] * 4), ("extend", [16] * 2, [64] * 2),
                                              ("prefill", [64] * 2, [0] * 2)):
        started = time.monotonic()
        for row in attention(section, query_lens, context_lens, None):
            if row["case"] == "flashinfer":
                print(json.dumps({**row, "section": f"warmup-{section}", "compile_s": time.monotonic() - started}),
                      flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("warmup")
    e2e = commands.add_parser("e2e")
    e2e.add_argument("--section", required=True)
    e2e.add_argument("--config", type=Path, required=True)
    e2e.add_argument("--tokenizer", type=Path, required=True)
    e2e.add_argument("--dir", type=Path, required=True)
    e2e.add_argument("--prompts", type=int, default=64)
    e2e.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "warmup":
        warmup_main()
    else:
        e2e_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

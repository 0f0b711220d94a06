"""The GPU check's measurements (scripts/gpu-lease.sh runs it on a lent CUDA machine, a section per step):
one table, JSON + Markdown.

    python -m benchmarks.gpu_check --out DIR [--sections copy,decode,extend,prefill,e2e,e2e-8b,graphs,kv-ipc]

Sections (each one that fails is reported as such; the others still run):
- copy: HBM bandwidth of a 1 GiB device copy (bytes read + written / time): the roof for memory-bound kernels;
- decode: paged decode, batch 64 x 4k context, Llama-3-8B attention shapes (32 q / 8 KV heads, dim 128),
  block 16, bf16: Triton and FlashInfer against the torch reference, KV bytes read / time vs the copy roof;
- extend: 8 sequences x 512 new tokens over 2k cached, same shapes;
- prefill: 8 x 2k fresh tokens without a cache (FlashInfer ragged, Triton backend's SDPA, torch);
- e2e: tokens/s of the bundled model (64 prompts x 128 tokens, greedy), Triton backend;
- e2e-8b: the same with a random-weight Llama-3-8B-shaped model in bf16 (bundled tokenizer's vocabulary);
- graphs: decode steps through the model runner, CUDA graphs (common/engine/cuda_graphs.py) vs eager, batch 1, 8
  and 32 at 512 tokens of context, a random-weight SmolLM2-135M-shaped model in bf16, Triton backend ("speedup");
- kv-ipc: KV transfer between two processes on one GPU over CUDA IPC (benchmarks.bench_kv_transfer).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_moe import time_call
from common.attention.backend import get_backend
from common.attention.metadata import AttentionMetadata
from common.kv.kv_cache import KVCache, KVCacheSpec

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SECTIONS = ("copy", "decode", "extend", "prefill", "e2e", "e2e-8b", "graphs", "kv-ipc")
Row = dict[str, Any]


def _time_cuda(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after 3 warm-ups, timed with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> list[Row]:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src))
    return [{"section": "copy", "case": "device copy 1 GiB", "ms": seconds * 1e3, "gb_s": 2 * 2**30 / seconds / 1e9}]


def _paged_batch(query_lens: list[int], context_lens: list[int]) -> tuple[Any, ...]:
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    cache = KVCache(KVCacheSpec(1, KV_HEADS, HEAD_DIM, BLOCK, "bfloat16"), sum(blocks) + 1, "cuda")
    cache.data.normal_()
    order = torch.randperm(sum(blocks)).tolist()  # shuffled tables, as after churn
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at : at + n])
        at += n
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK, "cuda")
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
    return q, k, v, cache.layer(0), meta, kv_bytes


def attention(section: str, query_lens: list[int], context_lens: list[int], roof: float | None) -> list[Row]:
    q, k, v, kv_cache, meta, kv_bytes = _paged_batch(query_lens, context_lens)
    scale = HEAD_DIM**-0.5
    cached = section != "prefill"
    reference = get_backend("torch").forward(q, k, v, kv_cache if cached else None, meta, scale).float()
    rows: list[Row] = []
    for name in ("torch", "triton", "flashinfer"):
        try:
            backend = get_backend(name)
            out = backend.forward(q, k, v, kv_cache if cached else None, meta, scale)
            error = (out.float() - reference).abs().max().item()
            seconds = _time_cuda(functools.partial(backend.forward, q, k, v, kv_cache if cached else None, meta, scale))
        except Exception as exc:  # a missing package, a kernel that fails: the row says so
            rows.append({"section": section, "case": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        gbps = kv_bytes / seconds / 1e9
        rows.append({"section": section, "case": name, "ms": seconds * 1e3, "gb_s": gbps,
                     "vs_copy": gbps / roof if roof and cached else None, "max_abs_err_vs_torch": error})
    return rows


def end_to_end(section: str, model: str, backend: str, num_prompts: int = 64, tokens: int = 128) -> list[Row]:
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    llm = LLM(model, dtype="bfloat16", device="cuda", attention_backend=backend)
    prompts = [f"Write a short story about the number {i}." for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up: kernels compile
    start = time.perf_counter()
    done = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for c in done)
    return [{"section": section, "case": f"{Path(model).name}, {backend}, {num_prompts} x {tokens}",
             "seconds": seconds, "tokens_per_s": generated / seconds}]


def llama3_8b_shaped(directory: Path, tokenizer_dir: Path) -> Path:
    """A random-weight Llama-3-8B-shaped model (bf16 safetensors) with the bundled model's tokenizer."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
    config: Any = transformers.LlamaConfig(  # type: ignore[call-arg]  # kwargs go through **kwargs at run time
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        vocab_size=tokenizer_config["vocab_size"], bos_token_id=tokenizer_config.get("bos_token_id"),
        eos_token_id=tokenizer_config.get("eos_token_id"), torch_dtype="bfloat16", tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in transformers.LlamaForCausalLM(config).named_parameters()}
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    for name, shape in shapes.items():
        tensor = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
        shard[name] = tensor.cpu()
        if sum(t.numel() for t in shard.values()) * 2 > 4 * 2**30 or name == list(shapes)[-1]:
            file = f"model-{len(set(index.values())):05d}.safetensors"
            save_file(shard, str(directory / file), metadata={"format": "pt"})
            index |= dict.fromkeys(shard, file)
            shard = {}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


# SmolLM2-135M's architecture (its config.json's fields): the graphs section builds it with random weights.
SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def random_model(raw: dict[str, Any], device: str, backend: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A model of ``raw``'s shape with random weights, built on ``device`` and prepared as the loader does."""
    from common.config.model_config import ModelConfig
    from common.model.llama import LlamaForCausalLM
    from common.model.prepare import prepare_model

    with torch.device(device):
        model = LlamaForCausalLM(ModelConfig.from_dict(raw, "random"), get_backend(backend))
    model = model.to(dtype).eval().requires_grad_(False)
    for name, param in model.named_parameters():  # the embedding is allocated, not initialised
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02)
    prepare_model(model, device)
    return model


def graph_decode(batches: tuple[int, ...] = (1, 8, 32), context: int = 512, device: str = "cuda",
                 backend: str = "triton", raw: dict[str, Any] | None = None) -> list[Row]:
    """One decode step through ``ModelRunner.forward`` (host-side batch building included), captured vs eager."""
    from common.engine.cuda_graphs import DecodeGraphSpec
    from common.engine.model_runner import ModelRunner
    from common.engine.request import Request
    from common.engine.scheduler_output import ScheduledChunk, SchedulerOutput
    from common.sampling.params import SamplingParams

    model = random_model(raw or SMOLLM2_135M, device, backend)
    max_len = context + BLOCK
    per_seq = max_len // BLOCK
    num_blocks = max(batches) * per_seq
    eager = ModelRunner(model, BLOCK, num_blocks)
    graphed = ModelRunner(model, BLOCK, num_blocks, decode_graphs=DecodeGraphSpec(max(batches), max_len))
    if graphed.decode_graphs is None:
        return [{"section": "graphs", "case": "-", "error": "the runner declined CUDA graphs (see its log)"}]
    timer = _time_cuda if device == "cuda" else _time_host
    rows: list[Row] = []
    for batch in batches:
        # decode at the context's last position (the K/V before it: whatever the cache holds; timing only)
        chunks = [ScheduledChunk(Request(f"r{i}", [7 + i] * context, SamplingParams()), context - 1, 1,
                                 list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
        step = SchedulerOutput(chunks)
        with torch.inference_mode():
            want = eager.forward(step)[0].float()
            got = graphed.forward(step)[0].float()
            error = (got - want).abs().max().item()
            eager_s = timer(functools.partial(eager.forward, step))
            graph_s = timer(functools.partial(graphed.forward, step))
        shape = "SmolLM2 shape" if raw is None else "given shape"
        rows.append({"section": "graphs", "case": f"batch {batch}, {shape}, {backend}, {context} ctx",
                     "ms": graph_s * 1e3, "eager_ms": eager_s * 1e3, "speedup": eager_s / graph_s,
                     "max_abs_err_vs_eager": error})
    return rows


def _time_host(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of ``fn`` on the host (a CPU run of a section, to check it runs)."""
    return time_call(fn, repeats)[0]


def kv_ipc(out: Path) -> list[Row]:
    path = out / "kv-ipc.json"
    subprocess.run([sys.executable, "-m", "benchmarks.bench_kv_transfer", "--device", "cuda", "--transports", "shm",
                    "--tokens", "1024,4096", "--iters", "5", "--json", str(path)], check=True, timeout=240)
    rows = json.loads(path.read_text())["rows"]
    return [{"section": "kv-ipc", "case": f"{r['tokens']} tok, {r['transport']} {r['case']}", "ms": r["median_ms"],
             "gb_s": r["gb_s"], "vs_copy": r.get("vs_memcpy")} for r in rows]


def run(sections: list[str], out: Path, home: Path) -> list[Row]:
    rows: list[Row] = []
    roof: float | None = None

    def section(name: str, fn: Callable[[], list[Row]]) -> None:
        if name not in sections:
            return
        started = time.perf_counter()
        try:
            produced = fn()
        except Exception as exc:
            produced = [{"section": name, "case": "-", "error": f"{type(exc).__name__}: {exc}"[:300]}]
        for row in produced:
            print(json.dumps(row), flush=True)
        print(f"# {name}: {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
        rows.extend(produced)

    section("copy", copy_bandwidth)
    roof = next((r["gb_s"] for r in rows if r["section"] == "copy" and "gb_s" in r), None)
    section("decode", lambda: attention("decode", [1] * 64, [4096] * 64, roof))
    section("extend", lambda: attention("extend", [512] * 8, [2048] * 8, roof))
    section("prefill", lambda: attention("prefill", [2048] * 8, [0] * 8, roof))
    from common.model.model_store import resolve_model

    bundled = resolve_model("SmolLM2-135M-Instruct", home) if {"e2e", "e2e-8b"} & set(sections) else None
    section("e2e", lambda: end_to_end("e2e", str(bundled), "triton"))
    section("e2e-8b", lambda: end_to_end(
        "e2e-8b", str(llama3_8b_shaped(out / "llama3-8b-shaped", Path(str(bundled)))), "triton", 32, 64))
    section("graphs", graph_decode)
    section("kv-ipc", lambda: kv_ipc(out))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}", "",
             "| section | case | ms | GB/s | vs copy | tokens/s | note |", "|---|---|---:|---:|---:|---:|---|"]

    def fmt(value: Any, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in rows:
        note = r.get("error") or (f"max err {r['max_abs_err_vs_torch']:.2e}" if "max_abs_err_vs_torch" in r else "")
        if "speedup" in r:
            note = f"{r['speedup']:.2f}x eager ({r['eager_ms']:.3f} ms), max err {r['max_abs_err_vs_eager']:.2e}"
        lines.append(f"| {r['section']} | {r['case']} | {fmt(r.get('ms'), '.3f')} | {fmt(r.get('gb_s'), '.1f')} | "
                     f"{fmt(r.get('vs_copy'), '.0%')} | {fmt(r.get('tokens_per_s'), '.0f')} | {note} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "tandem")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        sys.exit(77)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run(args.sections.split(","), args.out, args.home)
    (args.out / "gpu-check.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "rows": rows},
                                                        indent=2))
    table = markdown(rows)
    (args.out / "gpu-check.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()

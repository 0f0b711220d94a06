"""What a prefill or decode node does at start-up before serving: threads, model, engine configs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig

if TYPE_CHECKING:
    from common.config.settings import ModelSettings, NodeSettings
    from common.engine.async_engine import AsyncEngine
    from common.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    model_dir: Path
    name: str


def load_node_model(settings: ModelSettings) -> LoadedModel:
    """Set torch's thread count (one per pinned core), resolve and load the model."""
    import torch

    from common.model.loader import load_model
    from common.model.model_store import resolve_model

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    model_dir = resolve_model(settings.model, settings.home, progress=False)
    model = load_model(model_dir, settings.dtype, settings.device, settings.attention_backend,
                       settings.quantization, settings.quantization_group_size, settings.quantization_kernel)
    log.info("loaded %s (%s, %s, quantization %s, %.0f MB of weights, %d threads)", model_dir.name, model.dtype,
             settings.device, settings.quantization, model.weight_bytes / 1e6, torch.get_num_threads())
    return LoadedModel(model, model_dir, model_dir.name)


async def prepare_decode_attention(settings: ModelSettings, engine: AsyncEngine) -> None:
    """Build (first start on a machine, ~20 s) or load the CPU decode kernel on the engine thread, where it
    runs, before the node serves: not inside the first request's decode step."""
    import torch

    if settings.attention_backend != "torch" or torch.device(settings.device).type != "cpu":
        return
    from common.engine.commands import PrepareKernels

    compiled = await engine.call(PrepareKernels())
    log.info("CPU decode attention: %s", "compiled kernel" if compiled else "PyTorch path")


def engine_configs(node: NodeSettings) -> tuple[CacheConfig, SchedulerConfig]:
    cache = CacheConfig(block_size=node.block_size, num_blocks=node.num_blocks or None,
                        kv_cache_memory_gb=node.kv_cache_memory_gb, enable_prefix_caching=node.enable_prefix_caching)
    scheduler = SchedulerConfig(max_num_seqs=node.max_num_seqs, max_num_batched_tokens=node.max_num_batched_tokens,
                                max_prefill_chunk=node.max_prefill_chunk, max_waiting=node.max_waiting,
                                # a decode servicer waits at most queue_timeout_s for the first chunk, then
                                # kv_timeout_s: past both (and a minute's slack) a reservation has leaked
                                kv_lease_s=node.queue_timeout_s + node.kv_timeout_s + 60.0)
    return cache, scheduler


def speculative_config(method: str, num_tokens: int, draft_layers: int) -> SpeculativeConfig:
    from common.config.engine_config import SpeculativeMethod

    try:
        chosen = SpeculativeMethod(method)
    except ValueError:
        names = ", ".join(m.value for m in SpeculativeMethod)
        raise ValueError(f"speculative method {method!r} is unknown; choose one of {names}") from None
    return SpeculativeConfig(method=chosen, num_speculative_tokens=num_tokens, draft_layers=draft_layers)

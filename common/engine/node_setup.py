"""What a prefill or decode node does at start-up before serving: threads, model, engine configs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from common.config.settings import ModelSettings, NodeSettings
    from common.engine.async_engine import AsyncEngine
    from common.model.llama import LlamaForCausalLM
    from common.parallel.executor import ParallelLaunch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM  # a weightless skeleton when ``parallel`` is set: the ranks hold the weights
    model_dir: Path
    name: str
    parallel: ParallelLaunch | None = None


def parallel_launch(settings: ModelSettings, model_dir: Path, dtype: torch.dtype) -> ParallelLaunch:
    """What the ranks of a T x P node load; the layout is checked against the model here, at start-up."""
    from common.config.model_config import ModelConfig
    from common.parallel.executor import ParallelLaunch
    from common.parallel.layout import ParallelLayout

    if settings.device != "cpu":
        raise ValueError(f"--tensor-parallel-size / --pipeline-parallel-size > 1 runs on CPU ranks so far; "
                         f"--device {settings.device} is not supported with them yet")
    ParallelLayout(settings.tensor_parallel_size, settings.pipeline_parallel_size,
                   settings.expert_parallel).validate(ModelConfig.from_pretrained(model_dir))
    return ParallelLaunch(model_dir, str(dtype).removeprefix("torch."), settings.tensor_parallel_size,
                          settings.pipeline_parallel_size, settings.attention_backend, settings.quantization,
                          settings.quantization_group_size, settings.quantization_kernel,
                          settings.parallel_collective, expert_parallel=settings.expert_parallel)


def load_node_model(settings: ModelSettings) -> LoadedModel:
    """Set torch's thread count (one per pinned core), resolve and load the model (a T x P node: its
    skeleton; the ranks load their shards when the engine starts them)."""
    import torch

    from common.model.loader import load_model, load_skeleton
    from common.model.model_store import resolve_model

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    model_dir = resolve_model(settings.model, settings.home, progress=False)
    if settings.parallel:
        skeleton = load_skeleton(model_dir, settings.dtype)
        launch = parallel_launch(settings, model_dir, skeleton.dtype)
        return LoadedModel(skeleton, model_dir, model_dir.name, launch)
    model = load_model(model_dir, settings.dtype, settings.device, settings.attention_backend,
                       settings.quantization, settings.quantization_group_size, settings.quantization_kernel)
    log.info("loaded %s (%s, %s, quantization %s, %.0f MB of weights, %d threads)", model_dir.name, model.dtype,
             settings.device, settings.quantization, model.weight_bytes / 1e6, torch.get_num_threads())
    return LoadedModel(model, model_dir, model_dir.name)


async def prepare_kernels(settings: ModelSettings, engine: AsyncEngine, decode: bool = True) -> None:
    """Before the node serves, on the engine thread: oneDNN's bf16 GEMM for every row bucket a step can reach
    (a first step at a new bucket cost 15-20 ms more in session 33; a prefill node's steps reach them all), and
    on a node that decodes the CPU decode kernel, built (first start on a machine; the time it took:
    benchmarks/results/figures-from-code.md) or loaded: not inside the first request's step."""
    import torch

    if settings.attention_backend != "torch" or torch.device(settings.device).type != "cpu":
        return
    from common.engine.commands import PrepareKernels

    compiled = await engine.call(PrepareKernels(decode=decode))
    if decode:
        log.info("CPU decode attention: %s", "compiled kernel" if compiled else "PyTorch path")


def engine_configs(node: NodeSettings, device: str) -> tuple[CacheConfig, SchedulerConfig]:
    """A node's engine configs on ``device``: ``NodeSettings.configs`` (the step budget's default by device is
    resolved in ``common.config.engine_config.scheduler_config``)."""
    return node.configs(device)


def load_draft_model(spec: SpeculativeConfig | None, settings: ModelSettings,
                     target_dir: Path) -> LlamaForCausalLM | None:
    """The draft model of ``--speculative draft_model`` (None for other methods), loaded like the target
    (dtype, device, attention backend) with its own quantization; refused unless it has the target's tokenizer."""
    from common.config.engine_config import SpeculativeMethod

    if spec is None or spec.method is not SpeculativeMethod.DRAFT_MODEL:
        return None
    from common.model.loader import load_model
    from common.model.model_store import resolve_model

    try:
        draft_dir = resolve_model(spec.draft_model, settings.home, progress=False)
    except ValueError as exc:  # a missing directory, an unknown name: say which flag
        raise ValueError(f"--draft-model: {exc}") from exc
    check_same_tokenizer(draft_dir, target_dir)
    draft = load_model(draft_dir, settings.dtype, settings.device, settings.attention_backend,
                       spec.draft_quantization, settings.quantization_group_size, settings.quantization_kernel)
    log.info("draft model %s (quantization %s, %.0f MB of weights)", draft_dir.name, spec.draft_quantization,
             draft.weight_bytes / 1e6)
    return draft


def check_same_tokenizer(draft_dir: Path, target_dir: Path) -> None:
    """A draft proposes token ids: its vocabulary must be the target's, id for id."""
    from tokenizers import Tokenizer

    if draft_dir.resolve() == target_dir.resolve():
        return
    for d in (draft_dir, target_dir):
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"--draft-model: {d} has no tokenizer.json to check the draft's vocabulary against")
    draft, target = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (draft_dir, target_dir))
    if draft.get_vocab(with_added_tokens=True) != target.get_vocab(with_added_tokens=True):
        raise ValueError(f"--draft-model {draft_dir}: its tokenizer differs from the target's ({target_dir}); "
                         "a draft model must share the target's vocabulary")

"""Build a model from a Hugging Face directory: config, safetensors weights, dtype, device.

Weights come from ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Hugging Face's
separate q/k/v and gate/up projections are copied into our fused matrices as they stream in (the family's
``fused_weights``, common/model/families.py), so peak memory stays at one copy of the model; every other
name is the model's own (``model.layers.3.self_attn.q_norm.weight`` -> ``layers.3.self_attn.q_norm.weight``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from common.attention.backend import get_backend
from common.config.model_config import ModelConfig
from common.model.families import ExpertLayout, family
from common.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from collections.abc import Iterator

    from common.quant.config import QuantConfig
    from common.quant.gguf_blocks import GGUFBlocks

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\."
                      r"(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")


def resolve_dtype(name: str, device: torch.device | str = "cpu", config: ModelConfig | None = None,
                  home: Path | None = None) -> torch.dtype:
    """``auto`` is bf16 on CUDA; on CPU it is measured (``common.model.dtype_choice``: the faster decode
    GEMV of fp32 and bf16 at the model's sizes, unless its prefill GEMM is pathologically slow), once
    per machine, torch version and thread count, and cached in ``home`` (default: TANDEM_HOME)."""
    if name == "auto":
        dev = torch.device(device)
        if dev.type == "cuda":
            return torch.bfloat16
        from common.model.dtype_choice import DEFAULT_SHAPE, auto_cpu_dtype

        if home is None:
            from common.config.settings import ModelSettings, load_settings

            home = load_settings(ModelSettings).home
        shape = DEFAULT_SHAPE if config is None else (config.hidden_size, config.intermediate_size)
        return DTYPES[auto_cpu_dtype(home, shape)]
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; choose auto, {', '.join(DTYPES)}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory: the shards named by the index, or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"model directory {model_dir} has no model.safetensors(.index.json)")


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
    quantization: str | QuantConfig = "none",
    quantization_group_size: int = 32,
    quantization_kernel: str = "auto",
    cpu_panels: bool = True,
    prepare: bool = True,
) -> LlamaForCausalLM:
    """Load a model of one of the families (common/model/families.py) ready for inference (eval mode, no grad).

    ``quantization`` (``common.quant.config``): the layers the after-load pass (common/model/prepare.py)
    gives packed methods; what this device or model cannot run is refused before any weight is read.
    ``cpu_panels``: float layers may take 16-row panels on CPU (common/model/gemv.py). ``prepare=False``:
    the float model as loaded, for a caller that slices it first and then runs ``prepare_model`` itself
    (a parallel rank, common/parallel/worker.py).
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, device, config) if isinstance(dtype, str) else dtype
    if config.attention_sinks and attention_backend != "torch":  # before building a backend this device may lack
        raise ValueError(f"attention sinks ({config.model_type}) run on the torch attention backend only; "
                         f"--attention-backend {attention_backend} has no sinks")
    backend = get_backend(attention_backend)
    quant = None
    if quantization != "none":
        from common.quant.config import QuantConfig
        from common.quant.quantizer import check_quantization

        quant = QuantConfig.parse(quantization, quantization_group_size)
        check_quantization(quant, config, device)
    # Build on the meta device (no random init of ~all parameters), then allocate for real.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    # The dtype is set on the meta model, so each weight is allocated once, in its final dtype (a model that fits
    # a GPU in bf16 may not fit it in fp32 first); the checkpoint's tensors are rounded into it as they stream in.
    model = _allocate(model.to(torch_dtype), torch.device(device))
    load_weights(model, iter_weights(model_dir))
    model.eval()
    model.requires_grad_(False)
    if prepare:
        from common.model.prepare import prepare_model

        gguf = _gguf_blocks(model, model_dir) if quant is not None and quant.enabled else None
        prepare_model(model, device, quant, gguf, quantization_kernel, panels=cpu_panels)
    return model


def _allocate(model: LlamaForCausalLM, device: torch.device) -> LlamaForCausalLM:
    """``model.to_empty(device)`` without its meta-tensor ``empty_like``, which runs through torch._refs and
    imports sympy and torch.fx's symbolic shapes (a noticeable part of every node's start-up, measured:
    benchmarks/results/figures-from-code.md): uninitialised tensors of each parameter's and buffer's shape
    and dtype, filled by the loader next."""
    made: dict[int, nn.Parameter] = {}  # one tensor for a Parameter two modules share (a tied LM head)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                               requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
    return model


def load_skeleton(model_dir: str | Path, dtype: str | torch.dtype = "auto") -> LlamaForCausalLM:
    """The model without weights (on the meta device): its config and activation dtype, for a node whose
    ranks hold the weights (common/parallel/executor.py)."""
    config = ModelConfig.from_pretrained(Path(model_dir))
    torch_dtype = resolve_dtype(dtype, "cpu", config) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(config, get_backend("torch"))
    return model.to(torch_dtype).eval().requires_grad_(False)


def _gguf_blocks(model: LlamaForCausalLM, model_dir: Path) -> GGUFBlocks | None:
    """The GGUF file the directory was converted from, as packed blocks (None: not from GGUF)."""
    from common.model.model_store import gguf_source
    from common.quant.gguf_blocks import GGUFBlocks

    source = gguf_source(model_dir)
    c = model.config
    return None if source is None else GGUFBlocks(source, c.num_layers, c.num_heads, c.num_kv_heads)


def load_weights(model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into the model, fusing q/k/v and gate/up; check completeness."""
    config = model.config
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    # The row blocks of our fused matrices, in order; the family says which checkpoint projection is which block.
    blocks = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (inter, inter)}
    # HF suffix -> (our suffix, row offset into the fused matrix)
    fam = family(config.model_type)
    fused = {theirs: (ours, sum(blocks[ours][:part])) for theirs, (ours, part) in fam.fused_weights.items()}
    experts = _ExpertNames(fam.experts, config.moe.intermediate_size) if fam.experts and config.moe else None
    for stored_name, tensor in weights:
        name = fam.weight_name(stored_name)  # an image-and-text checkpoint's language model (Gemma 3)
        if name is None or name.endswith("rotary_emb.inv_freq"):
            continue  # another part of the checkpoint (a vision tower), or recomputed from the config
        hf_name = name
        whole = experts.whole(hf_name, tensor) if experts is not None else None
        if whole is not None:  # a layer's experts stacked already (gpt-oss)
            target, stacked_tensor = whole
            if target not in params or params[target].shape != stacked_tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, which does not fit "
                                 f"{target} {tuple(params[target].shape) if target in params else '(absent)'}")
            params[target].data.copy_(stacked_tensor)
            filled[target] += stacked_tensor.numel()
            continue
        expert = experts.map(hf_name) if experts is not None else None
        if expert is not None:  # one expert's projection: its rows of the layer's stacked tensor
            stacked_name, index, row = expert
            if stacked_name not in params:
                raise ValueError(f"weight {hf_name!r} has no place in a {config.model_type} model")
            stacked = params[stacked_name].data
            if index >= stacked.shape[0]:
                raise ValueError(f"weight {hf_name!r}: expert {index} is beyond the config's {stacked.shape[0]}")
            rows_of = stacked[index, row : row + tensor.shape[0]]
            if rows_of.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows_of.shape)}")
            rows_of.copy_(tensor)
            filled[stacked_name] += tensor.numel()
            continue
        target, offset = _map_name(experts.router(hf_name) if experts is not None else hf_name, fused)
        if target == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy of the embedding
        if target not in params:
            raise ValueError(f"weight {hf_name!r} has no place in a {config.model_type} model")
        param = params[target]
        rows = tensor.shape[0]
        dest = param.data if offset is None else param.data[offset : offset + rows]
        if dest.shape != tensor.shape:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        filled[target] += tensor.numel()
    missing = [name for name, n in filled.items() if n != params[name].numel()]
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")


class _ExpertNames:
    """A mixture of experts' checkpoint names (the family's ``ExpertLayout``) -> (the layer's stacked tensor,
    the expert's index, the row offset of this projection in it): ``model.layers.3.block_sparse_moe.experts.5.w3
    .weight`` -> (``layers.3.mlp.w13``, 5, inter); ``router`` renames the router ``...<prefix>.gate.weight`` to
    the model's ``...mlp.gate.weight``."""

    def __init__(self, layout: ExpertLayout, inter: int) -> None:
        self.layout = layout
        self.offsets = {name: (ours, part * inter) for name, (ours, part) in layout.names.items()}
        self.pattern = re.compile(rf"^model\.layers\.(\d+)\.{re.escape(layout.prefix)}\.experts\.(\d+)\.(\w+)\.weight$")

    def router(self, hf_name: str) -> str:
        prefix, router = self.layout.prefix, self.layout.router
        if (prefix, router) == ("mlp", "gate"):
            return hf_name
        return hf_name.replace(f".{prefix}.{router}.", ".mlp.gate.")

    def whole(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """A stacked layout's tensor (gpt-oss) as the model holds it: (target, tensor), or None."""
        if not self.layout.stacked:
            return None
        match = _STACKED.match(hf_name)
        if match is None:
            return None
        layer, name = match.groups()
        if name == "gate_up_proj":  # [E, hidden, 2I], gate / up interleaved -> [E, 2I, hidden], gate rows first
            return f"layers.{layer}.mlp.w13", torch.cat([tensor[..., 0::2], tensor[..., 1::2]], -1).transpose(1, 2)
        if name == "gate_up_proj_bias":
            return f"layers.{layer}.mlp.b13", torch.cat([tensor[..., 0::2], tensor[..., 1::2]], -1)
        if name == "down_proj":  # [E, inter, hidden] -> [E, hidden, inter]
            return f"layers.{layer}.mlp.w2", tensor.transpose(1, 2)
        return f"layers.{layer}.mlp.b2", tensor

    def map(self, hf_name: str) -> tuple[str, int, int] | None:
        match = self.pattern.match(hf_name)
        if match is None or match.group(3) not in self.offsets:
            return None
        layer, index, name = match.groups()
        ours, offset = self.offsets[name]
        return f"layers.{layer}.mlp.{ours}", int(index), offset


def _map_name(hf_name: str, fused: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.weight":
        return "lm_head.weight", None
    match = _LAYER.match(hf_name)
    if match is None:
        return hf_name, None
    layer, rest = match.groups()
    module, _, kind = rest.rpartition(".")  # kind: weight | bias
    if module in fused:
        ours, offset = fused[module]
        return f"layers.{layer}.{ours}.{kind}", offset
    return f"layers.{layer}.{rest}", None

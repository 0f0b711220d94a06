"""One rank's shard of a Llama-family model under tensor (T) and pipeline (P) parallelism, and how it runs.

``shard_model`` turns a fully loaded float model into rank ``placement.rank``'s shard in place:

- its stage's layers only (``model.layers`` holds ``[l0, l1)``; each attention keeps its global
  ``layer_idx``, which is what indexes the KV cache), the others freed;
- with T > 1, in each layer: this rank's query heads, KV heads and MLP columns (column-parallel
  ``qkv_proj`` and ``gate_up_proj``), and row-parallel ``o_proj`` and ``down_proj`` that all-reduce over
  ``tp_comm`` (``common/parallel/tp_layers.py``); a mixture of experts' routed layer keeps its router whole and
  holds this rank's experts (expert parallel) or its columns of every expert, its output all-reduced. The
  attention's head counts become this rank's, so
  ``LlamaAttention`` (reference and fused paths alike) runs unchanged on its heads. Per-head q/k norms
  (Qwen3: one ``[head_dim]`` weight each, shared by all heads) stay whole on every rank;
- the embedding on the first stage only (vocab-parallel with T > 1), the LM head on the last stage only
  (this rank's vocabulary rows; tied to the embedding's rows when the model ties them and one stage holds
  both). A stage without them holds empty (0-row) modules. The final norm stays on every stage: it is one
  vector, and ``model.dtype`` reads it.

``stage_forward`` runs a stage; ``shard_logits`` gives this rank's logit columns and ``gather_logits`` the
full vocabulary. Vocabulary padding: rank r holds real ids ``placement.vocab``; the padded columns exist only
inside ``gather_logits`` (filled with -inf, and cut off before it returns), so no padded id can be sampled.

``shard_model`` takes the float model as loaded (``load_model(..., prepare=False)``); ``prepare_shard`` then
runs the after-load pass on the shard: every layer's method, packed ones quantized from the shard's float
weights (per-output-channel int8 of a column-parallel slice is exactly the slice of the unsharded
quantization; a row-parallel layer's scales are computed over this rank's columns only, so its rounding
differs slightly), the fused ops.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from common.model.linear import Linear
from common.model.moe import SparseMoE
from common.parallel.tp_layers import RowParallelLinear, VocabParallelEmbedding, column_parallel

if TYPE_CHECKING:
    from common.attention.metadata import AttentionMetadata
    from common.config.model_config import ModelConfig
    from common.kv.kv_cache import KVCache
    from common.model.layers import SwiGLUMLP
    from common.model.llama import LayerKV, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
    from common.parallel.comm import Communicator
    from common.parallel.layout import RankPlacement
    from common.quant.config import QuantConfig



class KVCacheShard:
    """The part of the node's whole KV cache one rank reads and writes: its KV heads, its stage's layers.

    ``layer(i)`` returns strided views ``[num_blocks, block_size, head_stop - head_start, head_dim]`` of
    ``cache.data`` (``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``); the attention
    backends take any block, token and head stride with a unit stride over head_dim, so nothing is copied.
    Ranks that share a replicated KV head write bit-identical values (the same hidden states through the same
    weight rows) into the same slots; the race is benign and the result deterministic.
    """

    def __init__(self, cache: KVCache, head_start: int, head_stop: int, layers: tuple[int, int] | None = None) -> None:
        assert 0 <= head_start < head_stop <= cache.spec.num_kv_heads
        self.cache = cache  # views are taken per call: ``KVCache.share_memory`` may rebind ``cache.data``
        self.head_start, self.head_stop = head_start, head_stop
        self.layers = layers if layers is not None else (0, cache.spec.num_layers)

    @classmethod
    def for_rank(cls, cache: KVCache, placement: RankPlacement) -> KVCacheShard:
        return cls(cache, *placement.kv_heads, layers=placement.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.head_stop - self.head_start

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of this rank's heads in ``layer_idx`` (a global layer index)."""
        assert self.layers[0] <= layer_idx < self.layers[1], f"layer {layer_idx} is not in stage {self.layers}"
        kv = self.cache.data[:, layer_idx, :, :, self.head_start : self.head_stop]
        return kv[:, 0], kv[:, 1]


def shard_model(model: LlamaForCausalLM, placement: RankPlacement, tp_comm: Communicator) -> LlamaForCausalLM:
    """Keep only what ``placement`` holds of a fully loaded float ``model`` (in place); returns ``model``."""
    config = model.config
    assert tp_comm.world_size == placement.tp_size and tp_comm.rank == placement.tp_rank, "tp_comm is not this group"
    assert len(model.layers) == config.num_layers, "shard_model takes the whole model, once"
    l0, l1 = placement.layers
    layers = list(model.layers)[l0:l1]
    if placement.tp_size > 1:
        for layer in layers:
            _shard_layer(layer, config, placement, tp_comm)
    model.layers = nn.ModuleList(layers)
    _shard_vocab(model, placement, tp_comm)
    return model


def _shard_layer(layer: nn.Module, config: ModelConfig, placement: RankPlacement, comm: Communicator) -> None:
    d, q, kv, inter = config.head_dim, config.q_size, config.kv_size, config.intermediate_size
    (q0, q1), (k0, k1), (i0, i1) = placement.q_heads, placement.kv_heads, placement.intermediate
    routed = isinstance(layer.get_submodule("mlp"), SparseMoE)
    dense = () if routed else ("mlp.down_proj", "mlp.gate_up_proj")
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", *dense):
        linear = layer.get_submodule(name)
        if not isinstance(linear, Linear) or linear.prepared:
            raise TypeError(f"shard_model needs float weights as loaded ({name} is prepared): load with "
                            f"prepare=False and prepare the shard after sharding (prepare_shard)")
    attn = cast("LlamaAttention", layer.get_submodule("self_attn"))
    mlp = cast("SwiGLUMLP", layer.get_submodule("mlp"))
    # qkv rows: this rank's q heads, then its k heads, then its v heads (the fused matrix's order).
    qkv_rows = [(q0 * d, q1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d)]
    layer.set_submodule("self_attn.qkv_proj", column_parallel(attn.qkv_proj, qkv_rows))
    layer.set_submodule("self_attn.o_proj", RowParallelLinear.from_linear(attn.o_proj, (q0 * d, q1 * d), comm))
    attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
    if attn.sinks is not None:  # gpt-oss: one logit per query head, this rank's heads
        attn.sinks = nn.Parameter(attn.sinks.detach()[q0:q1].clone(), requires_grad=False)
    attn.q_size, attn.kv_size = (q1 - q0) * d, (k1 - k0) * d
    if routed:
        _shard_experts(cast("SparseMoE", layer.get_submodule("mlp")), placement, comm)
        return
    # gate_up rows: this rank's gate columns, then the same up columns, so silu_mul pairs them locally.
    layer.set_submodule("mlp.gate_up_proj", column_parallel(mlp.gate_up_proj, [(i0, i1), (inter + i0, inter + i1)]))
    layer.set_submodule("mlp.down_proj", RowParallelLinear.from_linear(mlp.down_proj, (i0, i1), comm))
    mlp.intermediate_size = i1 - i0


def _shard_experts(moe: SparseMoE, placement: RankPlacement, comm: Communicator) -> None:
    """This rank's experts (expert parallel) or this rank's columns of every expert: copies, so the whole
    stacked tensors can be freed; the router stays whole; the output is a partial sum the all-reduce completes."""
    (e0, e1), (i0, i1) = placement.experts, placement.expert_intermediate
    inter = moe.intermediate_size
    w13 = moe.w13.detach()[e0:e1]
    w13 = torch.cat([w13[:, i0:i1], w13[:, inter + i0 : inter + i1]], dim=1)  # gate columns, then the same up
    moe.w13 = nn.Parameter(w13.contiguous(), requires_grad=False)
    moe.w2 = nn.Parameter(moe.w2.detach()[e0:e1, :, i0:i1].contiguous(), requires_grad=False)
    if moe.b13 is not None and moe.b2 is not None:  # gpt-oss's expert biases, split as their weights
        b13 = moe.b13.detach()[e0:e1]
        moe.b13 = nn.Parameter(torch.cat([b13[:, i0:i1], b13[:, inter + i0 : inter + i1]], 1).contiguous(),
                               requires_grad=False)
        b2 = moe.b2.detach()[e0:e1].clone()
        if (e0, e1) == (0, moe.num_experts) and placement.tp_rank:  # columns split: the all-reduce adds it once
            b2.zero_()
        moe.b2 = nn.Parameter(b2, requires_grad=False)
    moe.expert_start, moe.intermediate_size = e0, i1 - i0
    moe.reduce = comm


def _shard_vocab(model: LlamaForCausalLM, placement: RankPlacement, comm: Communicator) -> None:
    hidden = model.config.hidden_size
    like = model.norm.weight
    embed, head = model.embed_tokens, model.lm_head  # tied: the head holds the embedding's Parameter
    tied = model.config.tie_word_embeddings
    if not isinstance(embed, nn.Embedding) or head.prepared:
        raise TypeError("shard_model needs a float embedding and LM head as loaded: prepare the shard after "
                        "sharding (prepare_shard)")
    if placement.tp_size == 1:
        if not placement.is_last_stage:
            model.lm_head = Linear.of(like.new_empty(0, hidden))
        if not placement.is_first_stage:
            model.embed_tokens = _no_embedding(like, hidden)  # a tied head keeps the matrix alone
        return
    v0, v1 = placement.vocab
    rows = embed.weight.detach()[v0:v1].clone()
    if placement.is_first_stage:
        model.embed_tokens = VocabParallelEmbedding(rows, v0, comm)
    else:
        model.embed_tokens = _no_embedding(like, hidden)
    if not placement.is_last_stage:
        model.lm_head = Linear.of(like.new_empty(0, hidden))
    elif tied:  # one stage holding both shares one parameter
        model.lm_head = Linear.of(model.embed_tokens.weight if placement.is_first_stage else rows)
    else:
        model.lm_head = Linear.of(head.weight.detach()[v0:v1].clone())


def _no_embedding(like: torch.Tensor, hidden: int) -> nn.Embedding:
    # A stage past the first holds no token table: a 0-row one (any lookup fails) costs nothing.
    return nn.Embedding(0, hidden, _weight=like.new_empty(0, hidden), _freeze=True)


def _stage_ends(model: LlamaForCausalLM) -> tuple[bool, bool]:
    """(holds the first layer, holds the last layer): whether this stage embeds, and whether it norms."""
    layers = cast("list[LlamaDecoderLayer]", list(model.layers))
    return layers[0].self_attn.layer_idx == 0, layers[-1].self_attn.layer_idx == model.config.num_layers - 1


def stage_forward(model: LlamaForCausalLM, inputs: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  kv_cache: LayerKV | None, residual: torch.Tensor | None = None, num_layers: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run this rank's stage over a ragged batch: the model's own layer loop (``run_layers``) between the
    embedding (first stage) and the final norm (last stage).

    inputs: token ids [num_tokens] on the first stage, else the previous stage's hidden [num_tokens, hidden];
    residual: the residual stream the previous stage returned beside it (None on the first stage);
    num_layers: a pass through the model's first layers only (a draft pass, ``--speculative draft_layers``):
    this stage runs its layers below it, and the stage holding layer ``num_layers - 1`` final-norms. It must
    hold at least one of them.
    Returns (hidden, residual): on the stage that ends the pass the final-normed hidden [num_tokens, hidden]
    and None; elsewhere the last layer's MLP output and the residual stream (which the fused ops update in
    place: pass a tensor the stage may own). Every rank of a stage returns the same tensors.
    """
    layers = cast("list[LlamaDecoderLayer]", list(model.layers))
    l0, l1 = layers[0].self_attn.layer_idx, layers[-1].self_attn.layer_idx + 1
    end = model.config.num_layers if num_layers is None else num_layers
    assert l0 < end, f"the pass's {end} layers end before this stage's [{l0}, {l1})"
    if l0 == 0:
        assert not inputs.is_floating_point(), "the first stage takes token ids"
        x = model.embed(inputs)
    else:
        x = inputs
    x, residual = model.run_layers(positions, x, residual, meta, kv_cache, end - l0 if end < l1 else None)
    return (model.final_norm(x, residual), None) if l1 >= end else (x, residual)


def shard_logits(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [n, hidden] -> this rank's logit columns [n, v1 - v0] fp32 (``placement.vocab``); last stage only."""
    if not _stage_ends(model)[1]:
        raise ValueError("only the last pipeline stage holds the LM head")
    return model.compute_logits(hidden)


def gather_logits(model: LlamaForCausalLM, hidden: torch.Tensor, tp_comm: Communicator) -> torch.Tensor:
    """The full vocabulary's logits [n, vocab_size] fp32 on every rank of the last stage (a TP all-gather)."""
    part = shard_logits(model, hidden)
    t = tp_comm.world_size
    if t == 1:
        return part
    vocab = model.config.vocab_size
    width = -(-vocab // t)  # placement.padded_vocab_per_rank: all_gather takes equal shapes
    if part.shape[1] < width:  # the padded ids' columns: -inf, and cut off below
        part = nn.functional.pad(part, (0, width - part.shape[1]), value=float("-inf"))
    return tp_comm.all_gather(part.contiguous(), dim=-1)[:, :vocab]


def prepare_shard(model: LlamaForCausalLM, quant: QuantConfig | None = None, kernel: str = "auto") -> None:
    """The after-load pass (``common.model.prepare.prepare_model``) for a shard: each layer's method from its
    sliced float weights (GGUF blocks as published do not apply), row-major float layers (no panels).

    Raises ``QuantizationError`` when a rank's slice does not fit the packed format (e.g. o_proj's
    ``num_heads * head_dim / T`` input columns not a multiple of 32).
    """
    from common.model.prepare import prepare_model
    from common.quant.config import QuantizationError
    from common.quant.quantizer import check_quantization

    device = model.norm.weight.device
    if quant is not None and quant.enabled:
        first = cast("LlamaDecoderLayer", model.layers[0])
        attn, mlp = first.self_attn, first.mlp
        per_rank = dataclasses.replace(model.config, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                                       intermediate_size=mlp.intermediate_size)
        try:
            check_quantization(quant, per_rank, device)
        except QuantizationError as exc:
            raise QuantizationError(f"{exc} (one tensor-parallel rank's slice)") from exc
    prepare_model(model, device, quant, None, kernel, panels=False)

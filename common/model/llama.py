"""The one decoder of every family (common/model/families.py: Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral,
Qwen3-MoE, Gemma 2 / 3) over a flat, ragged batch of tokens; a family's options (biases, q/k norms, sliding
windows, routed experts in place of the dense MLP: common/model/moe.py, Gemma's sandwich norms, GELU, scalings and
soft-caps) are switches of these layers.

``forward(input_ids [num_tokens], positions [num_tokens], meta, kv_cache)`` returns hidden states
``[num_tokens, hidden]``; ``compute_logits`` turns selected rows into ``[n, vocab]`` fp32 logits. The
model never pads: sequences are described by ``AttentionMetadata`` and attention goes through the
chosen ``AttentionBackend``, the only place that knows about the paged KV cache.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from common.model.fused_ops import EagerOps
from common.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from common.model.linear import Linear
from common.model.moe import SparseMoE

if TYPE_CHECKING:
    from common.attention.backend import AttentionBackend
    from common.attention.metadata import AttentionMetadata
    from common.attention.torch_backend import TorchAttentionBackend
    from common.config.model_config import ModelConfig
    from common.model.decode_step import DecodeStep
    from common.model.fused_ops import FusedOps


class LayerKV(Protocol):
    """What attention reads the paged cache through: a node's ``KVCache``, or one parallel rank's part of it
    (``common.parallel.tp_model.KVCacheShard``: its KV heads, as strided views)."""

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerThreads(Protocol):
    """How many threads each decoder layer runs on (common/engine/core_lending.py's ``CoreBorrower``)."""

    def before_layer(self) -> None: ...

    def after_layers(self) -> None: ...

    def handing_over(self) -> None:
        """The forward that just ran completed a prompt (the engine samples its first token)."""

    def borrowing(self) -> AbstractContextManager[None]:
        """The body runs at the thread count of the lent layers (the start-up warm-up of the kernels)."""
        ...


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale  # head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
        self.window = config.layer_window(layer_idx)  # sliding window (Mistral, Qwen2/3, Gemma local layers) or None
        # Gemma 2: scores -> cap * tanh(scores / cap) before the mask; a backend without it is refused here, at
        # start, rather than run without the cap.
        self.softcap = config.attn_logit_softcapping
        if self.softcap is not None and not backend.supports_softcap:
            raise ValueError(f"attn_logit_softcapping ({self.softcap}) is not supported by the {backend.name!r} "
                             f"attention backend: use the torch or triton backend")
        self.backend = backend
        # q, k and v fused into one matmul: one pass over the activations instead of three.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # Gemma 3's sliding layers have a rotary base of their own (ModelConfig.layer_rope).
        theta, scaling = config.layer_rope(layer_idx)
        self.rotary = RotaryEmbedding(config.head_dim, theta, config.max_position_embeddings, scaling)
        # Qwen3 / Gemma 3: RMSNorm over head_dim of every q and k head before rotary, one [head_dim] weight each,
        # shared by all heads (so a tensor-parallel rank keeps them whole). Float under every quantization.
        offset = config.unit_offset_norms
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None
        # gpt-oss: one learned logit per query head in the softmax's denominator (the torch backend's path).
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:
            if backend.name != "torch":  # TorchAttentionBackend.forward_with_sinks
                raise ValueError(f"attention sinks ({config.model_type}) run on the torch attention backend only; "
                                 f"--attention-backend {backend.name} has no sinks")
            self.sinks = nn.Parameter(torch.empty(config.num_heads), requires_grad=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                kv_cache: LayerKV | None, ops: FusedOps) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]. Rotary is applied in place on the qkv projection's
        output (no split copies; on the q/k norms' outputs where the model has them) and, with a paged cache, in
        one pass with writing the new K/V into it."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # q, k: new [num_tokens, heads, head_dim] tensors
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps, self.q_norm.unit_offset)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps, self.k_norm.unit_offset)
        table = self.rotary.table(qkv.device, qkv.dtype, meta.max_seq_len)
        layer_cache = kv_cache.layer(self.layer_idx) if kv_cache is not None else None
        if self.sinks is not None:
            ops.rotary_(q, k, table, positions)
            backend = cast("TorchAttentionBackend", self.backend)
            out = backend.forward_with_sinks(q, k, v, layer_cache, meta, self.scale, self.window, self.sinks)
        elif layer_cache is not None and meta.slot_mapping is not None:
            # rotary and the K/V write in one pass; the backend then only reads (slot_mapping None)
            ops.rotary_write_kv_(q, k, v, table, positions, layer_cache, meta.slot_mapping)
            out = self.backend.forward(q, k, v, layer_cache, meta.kv_written, self.scale, self.window, self.softcap)
        else:
            ops.rotary_(q, k, table, positions)
            out = self.backend.forward(q, k, v, layer_cache, meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """Llama's layer: ``input_layernorm`` -> attention -> ``post_attention_layernorm`` -> MLP, each half added to
    the residual stream. With ``sandwich_norms`` (Gemma 2 / 3) each half's output is normed before its add
    (``post_attention_layernorm`` on attention's, ``post_feedforward_layernorm`` on the MLP's) and
    ``pre_feedforward_layernorm`` norms the MLP's input; transformers' Gemma names, so checkpoints load as they
    are."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.unit_offset_norms
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.self_attn = LlamaAttention(config, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset) if config.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset) if config.sandwich_norms else None
        # The dense MLP (SiLU, or Gemma's GELU-tanh), or (a mixture of experts' routed layers) the experts: the
        # same forward(h, ops).
        self.mlp: SwiGLUMLP | SparseMoE = (
            SparseMoE(config.hidden_size, config.moe) if config.moe is not None and config.is_moe_layer(layer_idx)
            else SwiGLUMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.activation))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, kv_cache: LayerKV | None,
                ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with the residual stream carried beside the output: (x, residual) -> (this layer's MLP
        output, the stream before it), so each add rides in the next norm's pass (residual None: x is the
        stream, the first layer's embedding)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm1.weight, norm1.eps, norm1.unit_offset)
        x = self.self_attn(positions, h, meta, kv_cache, ops)
        pre, post = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre is not None and post is not None:  # sandwich: attention's output normed, then added and normed
            x = ops.rms_norm(x, norm2.weight, norm2.eps, norm2.unit_offset)
            h, residual = ops.add_rms_norm(x, residual, pre.weight, pre.eps, pre.unit_offset)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm2.weight, norm2.eps, norm2.unit_offset)
        out = self.mlp(h, ops)
        if post is not None:
            out = ops.rms_norm(out, post.weight, post.eps, post.unit_offset)
        return out, residual


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head (tied to the embedding when the config says so)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        # [n] -> [n, hidden]; a tied model may replace it with a lookup of the LM head's rows (TiedEmbedding).
        # Its weight given, not initialised: loaders build on the meta device, where nn.Embedding's random
        # init runs through torch._refs and imports torch._dynamo (seconds of every node's start-up, measured:
        # benchmarks/results/figures-from-code.md).
        embed = nn.Embedding(config.vocab_size, config.hidden_size,
                             _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_tokens: nn.Module = embed
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.unit_offset_norms)
        # [n, hidden] -> [n, vocab]; tied: one Parameter with the embedding (its method may re-lay it out,
        # and the lookup then reads the head's rows).
        self.lm_head = (Linear.of(embed.weight) if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, bias=False))
        # The elementwise ops of the layers: the eager reference until the after-load pass picks the fused
        # C++ ones on CPU (common/model/fused_ops.py, TANDEM_FUSED_OPS).
        self.fused_ops: FusedOps = EagerOps()
        # None: op by op. The after-load pass sets the one-call decode step (common/model/decode_step.py) on CPU.
        self.decode_step: DecodeStep | None = None
        # Called around the decoder layers on the engine thread: a prefill node borrowing an idle decode node's
        # cores (common/engine/core_lending.py) sets each layer's threads. None: nothing.
        self.layer_threads: LayerThreads | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype, which is also the KV cache's (packed weights have their own dtypes)."""
        return self.norm.weight.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds, packed ones included (they are buffers)."""
        return sum(t.nbytes for t in self.parameters()) + sum(t.nbytes for t in self.buffers())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: LayerKV | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden].

        ``num_layers`` runs only the first layers (then the final norm): the target's early layers as its
        own draft model.
        """
        x = self.embed(input_ids)
        num_layers = len(self.layers) if num_layers is None else num_layers
        step = self.decode_step
        if step is not None and kv_cache is not None and step.applies(x, meta, kv_cache):
            return step.run(x, positions, meta, kv_cache, num_layers)  # the same layers in one C++ call
        x, residual = self.run_layers(positions, x, None, meta, kv_cache, num_layers)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [n] -> the first layer's input [n, hidden]: the token rows, times ``embed_scale`` where the
        family scales them (Gemma: sqrt(hidden_size), rounded to the activation dtype first, as transformers'
        Gemma*TextScaledWordEmbedding does)."""
        x = self.embed_tokens(input_ids)
        scale = self.config.embed_scale
        if scale is None:
            return x
        return x * torch.tensor(scale, dtype=torch.float32, device=x.device).to(x.dtype)

    def run_layers(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                   meta: AttentionMetadata, kv_cache: LayerKV | None, num_layers: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers this model holds (the first ``num_layers``), with the residual stream carried
        beside the hidden state: what ``forward`` and a pipeline stage (common/parallel/tp_model.py) run."""
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        threads = self.layer_threads
        try:
            for layer in cast("list[LlamaDecoderLayer]", layers):
                if threads is not None:
                    threads.before_layer()
                x, residual = layer(positions, x, residual, meta, kv_cache, self.fused_ops)
        finally:
            if threads is not None:
                threads.after_layers()
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's output added to the stream, normed: hidden [num_tokens, hidden]."""
        norm = self.norm
        return self.fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps, norm.unit_offset)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] -> logits: [n, vocab] in fp32 (sampling wants full precision); Gemma's final
        # soft-cap, cap * tanh(logits / cap), elementwise (so a tensor-parallel rank caps its own columns).
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

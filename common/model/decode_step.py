"""A decode step's decoder layers in one C++ call on CPU (``cpu_step.cpp``), for a batch of decode rows.

At batch 1 the op-by-op forward spends as long in Python, dispatch and thread wake-ups as a 4-bit model
spends streaming its weights: ~400 calls a step for 30 layers. ``DecodeStep`` hands the layers' weights
and K/V caches to ``cpu_step.cpp`` once (a plan) and then runs each decode step's layers in one call, the
threads meeting at barriers inside one OpenMP region. The module is compiled from the very kernel files
the op-by-op path calls (``common/quant``'s panels, ``cpu_decode.cpp``'s attention, ``cpu_fused.cpp``'s
norms, rotary and SiLU), each wrapped in its own namespace, so its hidden states and K/V are bit-identical
to that path's (tests/model/test_decode_step.py).

It runs when every projection's method gives it a plan (``LinearMethod.step_weights``: ``tandem_a8`` int8 / int4
panels, float panels of the activations' dtype: fp32 or bf16, or row-major fp32 weights where panels do not pay:
``GemvMethod``), each multiplied as its op-by-op kernel does on this CPU (bf16: AMX tiles from the kernel's row
threshold, ``vdpbf16ps`` or the int8-rounded rows below it), the KV cache has the activations' dtype, attention is
the compiled CPU decode kernel, and the batch is up to ``max_rows`` tokens (the fewest rows up to which every
projection's op-by-op kernel is the loop the step runs; at most ``MAX_ROWS``) that attention reads as decode rows:
a decode step, or short chunks over a cached prefix (speculative verification, a draft model's catch-up); anything
else (prefill, long chunks, other kernels, parallel ranks, a model with q/k norms or a sliding window, Gemma's
layer) takes the op-by-op path.
``TANDEM_DECODE_STEP=auto|on|off`` (auto: where it builds and applies; on: a start-up error if it cannot
build; off: never).
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from common.config.settings import kernel_setting
from common.kernels.cpu import NO_AMX, cpu_kernels
from common.model.families import Activation

if TYPE_CHECKING:
    from common.attention.metadata import AttentionMetadata
    from common.model.linear import Linear, StepWeights

# The model is common.model.llama's LlamaForCausalLM and the cache a KVCache (``layer(i)`` -> (K, V) views,
# ``data``): typed loosely here, as llama.py imports this module.
Model = Any
Cache = Any


MAX_ROWS = 256  # cpu_step.cpp's MAX_ROWS: a bound on its buffers
MIN_ROWS = 16  # a model whose projections cannot take this many rows in the step keeps the op-by-op path
_DTYPES = (torch.float32, torch.bfloat16)  # activations (and the KV cache) the step runs in


def step_mode() -> str:
    return str(kernel_setting("decode_step"))  # TANDEM_DECODE_STEP



def _step_weights(linear: Linear, dtype: torch.dtype) -> StepWeights | None:
    """A projection's part of the plan, from its method's public ``step_weights`` (None: not here)."""
    if linear.bias is not None:
        return None
    return linear.method.step_weights(linear, dtype)


def _projections(layer: Any) -> tuple[Linear, Linear, Linear, Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


class DecodeStep:
    """A model's decoder layers as one call per decode step (see the module docstring)."""

    def __init__(self, module: ModuleType, model: Model, max_rows: int = MIN_ROWS) -> None:
        self._m = module
        self._model = model
        self.max_rows = max_rows  # tokens a batch may have to run here
        self._handle: int | None = None
        self._cache_data: torch.Tensor | None = None  # the KV tensor the plan's views are of
        self._profile = False

    @staticmethod
    def for_model(model: Model, mode: str | None = None) -> DecodeStep | None:
        """The step for this model, or None where it does not apply (then the op-by-op path serves)."""
        from common.attention.torch_backend import TorchAttentionBackend

        mode = step_mode() if mode is None else mode
        from common.model.fused_ops import CppOps

        # bit-identical to the op-by-op path with the C++ fused ops (the kernels it is compiled from)
        if mode == "off" or not isinstance(model.fused_ops, CppOps) or model.dtype not in _DTYPES:
            return None
        # cpu_step.cpp runs the Llama layer as it is: it has no q/k norms (Qwen3), so such a model keeps the
        # op-by-op path rather than a step that would skip them.
        if model.config.qk_norm:
            return None
        # Nor a sliding window: cpu_step.cpp's attention (decode_rows) reads whole sequences, so a windowed
        # model (Mistral, Qwen2/Qwen3 sliding layers) keeps the op-by-op path, whose decode kernel reads the window.
        if model.config.layer_windows:
            return None
        # Nor routed experts: cpu_step.cpp's MLP is the dense SwiGLU (a mixture of experts keeps the op-by-op
        # path and its grouped experts, common/model/moe.py).
        if model.config.moe is not None or model.config.attention_sinks:  # nor sinks (gpt-oss)
            return None
        # Nor Gemma's layer: sandwich norms scaling by (1 + weight), GELU-tanh, query_pre_attn_scalar, attention
        # soft-caps; cpu_step.cpp has none of them, so a Gemma model decodes op by op.
        config = model.config
        if (config.sandwich_norms or config.unit_offset_norms or config.activation is not Activation.SILU
                or config.query_pre_attn_scalar is not None or config.attn_logit_softcapping is not None):
            return None
        layers = list(model.layers)  # decoder layers: norms, self_attn (qkv, o, rotary, backend), mlp
        if not layers:
            return None
        backend = layers[0].self_attn.backend
        if not (isinstance(backend, TorchAttentionBackend) and backend.compiled_decode):
            return None
        from common.kernels.cpu import paged_decode_kernel

        if paged_decode_kernel() is None:
            return None
        q, kv, hidden, inter = config.q_size, config.kv_size, config.hidden_size, config.intermediate_size
        shapes = ((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter))  # whole, not sharded
        max_rows = MAX_ROWS
        for layer in layers:
            for lin, shape in zip(_projections(layer), shapes, strict=True):
                weights = _step_weights(lin, model.dtype)
                if weights is None or (lin.out_features, lin.in_features) != shape:
                    return None
                max_rows = min(max_rows, weights.max_rows)
        if max_rows < MIN_ROWS:
            return None
        module = cpu_kernels()
        if module is None:
            if mode == "on":
                raise RuntimeError("TANDEM_DECODE_STEP=on but the one-call decode step could not be built "
                                   "(see the log)")
            return None
        return DecodeStep(module, model, max_rows)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: Cache | None) -> bool:
        """The plan can run this batch: up to ``max_rows`` tokens, each read as a decode row. That is a plain
        decode step, or short chunks over a cached prefix (speculative verification, a draft's catch-up),
        which the attention backend also runs as decode rows (``EXTEND_AS_DECODE_ROWS``)."""
        from common.attention.torch_backend import EXTEND_AS_DECODE_ROWS

        data = getattr(kv_cache, "data", None)
        dtype = self._model.dtype
        return (data is not None and x.dtype == dtype and data.dtype == dtype
                and meta.slot_mapping is not None and meta.block_tables is not None
                and 1 <= meta.num_tokens <= self.max_rows and not meta.is_prefill_only
                and meta.max_query_len <= EXTEND_AS_DECODE_ROWS)

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: Cache,
            num_layers: int) -> torch.Tensor:
        """The final norm of the hidden states after the first ``num_layers`` layers (``x``: embedded tokens)."""
        handle = self._plan(kv_cache)
        assert meta.slot_mapping is not None and meta.block_tables is not None
        rotary = self._model.layers[0].self_attn.rotary
        table = rotary.table(x.device, x.dtype, meta.max_seq_len)
        pos = positions if positions.dtype == torch.int64 else positions.long()
        tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.int()
        lens = meta.seq_lens
        if meta.num_tokens != meta.num_seqs:  # chunks: row j of a chunk attends to its prefix and itself
            counts = torch.tensor(meta.query_lens_cpu)
            tables = tables[torch.repeat_interleave(torch.arange(meta.num_seqs), counts)]
            lens = torch.tensor([total - q + 1 + j for q, total in zip(meta.query_lens_cpu, meta.seq_lens_cpu,
                                                                         strict=True) for j in range(q)])
        return self._m.decode_step_run(handle, x.contiguous(), pos.contiguous(), table, meta.slot_mapping, tables,
                                       lens, num_layers)

    def _plan(self, kv_cache: Cache) -> int:
        data = getattr(kv_cache, "data", None)
        if self._handle is not None and data is self._cache_data:
            return self._handle
        self.close()
        model, config = self._model, self._model.config
        tensors: list[torch.Tensor] = []
        kinds: list[int] = []
        caches: list[torch.Tensor] = []
        amx_quant_rows = NO_AMX  # rows from which the int8 / int4 panels multiply bf16 rows in AMX tiles
        for i, layer in enumerate(model.layers):
            tensors += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            for lin in _projections(layer):
                weights = _step_weights(lin, model.dtype)
                assert weights is not None  # checked by for_model
                tensors += weights.tensors
                kinds += [weights.kind, weights.group]
                if weights.kind in (4, 8):
                    amx_quant_rows = min(amx_quant_rows, weights.amx_min_rows)
            caches += list(kv_cache.layer(i))
        from common.kernels.cpu import paged_decode_kernel
        from common.model.gemv import amx_min_rows

        attention = paged_decode_kernel()  # its own compiled attention (flags of its own): rows equal its rows
        assert attention is not None  # checked by for_model
        dtype = str(model.dtype).removeprefix("torch.")
        self._handle = int(self._m.decode_step_plan(
            tensors, kinds, caches, model.norm.weight.detach(), float(model.norm.eps), config.head_dim**-0.5,
            config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size, dtype,
            amx_min_rows(), amx_quant_rows, attention.decode_rows_address(dtype),
            attention.decode_splits_heads(config.head_dim)))
        self._cache_data = data
        if self._profile:
            self._m.decode_step_profile(self._handle, True)
        return self._handle

    def profile(self, on: bool = True) -> None:
        """Time the parts of every run from now on (``times``): what benchmarks.step_timer reports."""
        self._profile = on
        if self._handle is not None:
            self._m.decode_step_profile(self._handle, on)

    def times(self) -> tuple[float, float, float]:
        """Seconds in (projections, attention, the rest) of the layers since the last call, as thread 0 of
        the step saw them (a part ends at the barrier after it); zeros without ``profile``."""
        if self._handle is None:
            return 0.0, 0.0, 0.0
        matmul, attention, rest = self._m.decode_step_times(self._handle)
        return matmul, attention, rest

    def close(self) -> None:
        """Frees the plan (its references to the weights and the cache)."""
        if self._handle is not None:
            self._m.decode_step_free(self._handle)
            self._handle, self._cache_data = None, None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the module may be gone
            self.close()

"""The fused elementwise ops of a decoder layer, behind one small interface: eager (the reference) or C++.

A decode step of a small model is dominated, after the matmuls, by ~10 small eager ops per layer
(RMSNorm alone is six: cast, square, mean, rsqrt, multiply, cast back), each a Python call, a dispatch
and a temporary. ``FusedOps`` does each group in one pass:

- ``add_rms_norm(x, residual, weight, eps)``: ``residual += x`` then RMSNorm of it (the residual stream
  is carried beside the hidden state, as vLLM's layers do, so the add costs no extra pass);
- ``rms_norm(x, weight, eps)``: RMSNorm over the last dimension of any ``[..., d]`` tensor or view, into a new
  contiguous tensor (Qwen3's q/k norms over each head of the qkv projection's views);
  both with ``unit_offset`` (Gemma): the scale is ``1 + weight``, multiplied in fp32 before the cast back;
- ``silu_mul(gate_up)``: ``silu(gate) * up`` over the fused gate/up projection's output;
- ``gelu_tanh_mul(gate_up)``: ``gelu_tanh(gate) * up``, Gemma's MLP (eager in both: no C++ kernel has it);
- ``rotary_(q, k, cos_sin, positions)``: rotary embedding in place on the qkv projection's views;
- ``rotary_write_kv_(q, k, v, cos_sin, positions, kv, slot_mapping)``: the same, then the new tokens' K/V
  into their paged-cache slots (``common.kv.kv_cache.write_kv``), so attention finds them written;
- ``argmax_rows(logits)``: each row's first maximum (greedy sampling), ``torch.max(dim=-1).indices``;
- ``sample_rows(logits, temps, uniforms)``: each row's token drawn at a temperature by inverting its CDF at its
  uniform (``common.sampling.sampler``'s ``target_probs`` + ``sample_from`` without top-k/top-p/min-p),
  temperature 0 the first maximum;

``EagerOps`` is the reference (the same torch ops ``layers.py`` runs) and every kernel is tested against
it. ``CppOps`` is ``cpu_fused.cpp``, built per instruction set into the CPU kernel module
(``tandem_cpu_avx512`` / ``_avx2`` / ``_generic``, common/kernels/cpu/__init__.py). ``torch.compile`` of the
same functions was measured too and is slower at decode sizes on CPU (docs/cpu-kernels.md): its per-call guard
and launch overhead is as large as the ops it replaces.

``TANDEM_FUSED_OPS=auto|on|off`` (auto: the C++ ops on CPU where they build, else eager; on: the C++
ops or a start-up error; off: eager, the reference). The model has one forward (common/model/llama.py);
these ops are its only elementwise code.
"""

from __future__ import annotations

from types import ModuleType

import torch

from common.config.settings import kernel_setting
from common.kernels.cpu import cpu_kernels
from common.kv.kv_cache import write_kv


class EagerOps:
    """The reference: plain torch ops, rounding to the activation dtype where ``layers.py`` does."""

    name = "eager"

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [n, hidden] -> (weight * norm(x + residual), x + residual)
        res = x if residual is None else x + residual
        r32 = res.float()
        r32 = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)
        if unit_offset:  # Gemma: (norm * (1 + weight)) in fp32, then the cast
            return (r32 * (1.0 + weight.float())).to(res.dtype), res
        return weight * r32.to(res.dtype), res

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        # x: [..., d] (any strides) -> weight * norm(x): a new contiguous [..., d]; weight: [d]
        return self.add_rms_norm(x, None, weight, eps, unit_offset)[0]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [n, 2 * inter] -> [n, inter]
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [n, 2 * inter] -> [n, inter]; transformers' GELUTanh (gelu_pytorch_tanh)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        # max's indices: the first maximum, as argmax's, in less time on CPU (benchmarks/results/figures-from-code.md)
        return logits.max(dim=-1).indices

    def sample_rows(self, logits: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        # logits [n, V] fp32, temps [n] fp32 (0: greedy), uniforms [n] fp64 in [0, 1) -> [n] int64
        greedy = temps <= 0
        probs = torch.softmax(logits / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)
        return torch.where(greedy, self.argmax_rows(logits), inverse_cdf(probs, uniforms))

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
        # q: [n, H, D], k: [n, Hkv, D], in place; cos_sin: [P, D] = cat(cos, sin)
        cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))

    def rotary_write_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                         positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                         slot_mapping: torch.Tensor) -> None:
        # rotary_ in place, then k (rotated) and v: [n, Hkv, D] into kv's caches [blocks, block_size, Hkv, D]
        self.rotary_(q, k, cos_sin, positions)
        write_kv(kv[0], kv[1], k, v, slot_mapping)


class CppOps:
    """``cpu_fused.cpp``: one pass per group, fp32 accumulation; CPU tensors only."""

    name = "cpp"

    def __init__(self, module: ModuleType) -> None:
        self._m = module

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if unit_offset:
            if x.dtype != torch.float32:
                # The kernel rounds the norm to the activation dtype before scaling; Gemma scales in fp32 and
                # rounds once: the reference's math, not the kernel's.
                return EagerOps().add_rms_norm(x, residual, weight, eps, unit_offset)
            weight = 1.0 + weight.float()  # fp32 throughout: the kernel's product is Gemma's
        if residual is None:  # the first layer: the embedding is the residual stream (copied, as x + 0 would)
            residual = x.contiguous().clone()
            return self._m.add_rms_norm(residual, residual, weight, eps, False), residual
        # residual is the stream this model owns (made above), so updating it in place is safe.
        return self._m.add_rms_norm(x.contiguous(), residual, weight, eps, True), residual

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        if unit_offset:
            if x.dtype != torch.float32:  # as in add_rms_norm: Gemma's single rounding is the reference's
                return EagerOps().rms_norm(x, weight, eps, unit_offset)
            weight = 1.0 + weight.float()
        # The kernel takes contiguous rows: a [n, heads, d] view of the qkv output is gathered into [n * heads, d]
        # (add=False only reads its residual argument, so the rows may be a view of x).
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return self._m.add_rms_norm(rows, rows, weight, eps, False).view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._m.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return EagerOps().gelu_tanh_mul(gate_up)  # no C++ kernel: the reference

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] == 0:
            return EagerOps().argmax_rows(logits)
        return self._m.argmax_rows(logits)

    def sample_rows(self, logits: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] == 0:
            return EagerOps().sample_rows(logits, temps, uniforms)
        return self._m.sample_rows(logits, temps.float().contiguous(), uniforms.double().contiguous())

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
        self._m.rotary_(q, k, cos_sin, positions)

    def rotary_write_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                         positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                         slot_mapping: torch.Tensor) -> None:
        if kv[0].dtype != k.dtype:  # a cache of another dtype: the reference casts as it writes
            EagerOps().rotary_write_kv_(q, k, v, cos_sin, positions, kv, slot_mapping)
            return
        self._m.rotary_write_kv_(q, k, v, cos_sin, positions, kv[0], kv[1], slot_mapping)


FusedOps = EagerOps | CppOps


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (``[batch, vocab]``, non-negative, each row with positive mass, not
    necessarily normalised): the first entry whose fp64 CDF exceeds ``uniform * total`` (``uniform``: ``[batch]``
    in [0, 1)). ``common.sampling.sampler.sample_from`` is this."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [batch, vocab]
    target = (uniform.to(torch.float64) * cdf[:, -1]).unsqueeze(1)  # [batch, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def fused_mode() -> str:
    return str(kernel_setting("fused_ops"))  # TANDEM_FUSED_OPS


def fused_ops_for(device: torch.device, mode: str | None = None) -> FusedOps:
    """The ops the layer forward uses on ``device``: the C++ ones on CPU where they build, else eager."""
    mode = fused_mode() if mode is None else mode
    if mode == "off" or device.type != "cpu":
        return EagerOps()  # CUDA: eager (CUDA graphs are the lever there, not this)
    module = cpu_kernels()
    if module is None:
        if mode == "on":
            raise RuntimeError("TANDEM_FUSED_OPS=on but the fused CPU kernels could not be built (see the log)")
        return EagerOps()
    return CppOps(module)


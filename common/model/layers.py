"""Building blocks of a Llama-family layer: RMSNorm, rotary embedding, gated MLP.

Every tensor here is flat over tokens: ``[num_tokens, ...]``, never ``[batch, seq, ...]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.config.model_config import RopeScaling
from common.model.families import Activation
from common.model.linear import Linear

if TYPE_CHECKING:
    from common.model.fused_ops import FusedOps


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, exactly as the Hugging Face reference does.

    ``unit_offset`` (Gemma): the scale is ``1 + weight`` (a checkpoint stores the offset from 1), applied in fp32
    before the cast back, as Gemma's RMSNorm does; otherwise ``weight`` times the cast-back norm (Llama's)."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, half-split ("rotate_half") layout as in Hugging Face Llama.

    The cos/sin table is built lazily for the device and dtype it is first used with, and grown if a
    position beyond it appears, so the module holds no state that weight loading has to know about.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        self.scaling = scaling
        self._cos_sin: torch.Tensor | None = None  # [max_positions, head_dim] = cat(cos, sin) halves

    def _table(self, device: torch.device, dtype: torch.dtype, needed: int) -> torch.Tensor:
        table = self._cos_sin
        if table is None or table.device != device or table.dtype != dtype or table.shape[0] < needed:
            served = self.scaling.served_positions
            if served is not None and needed > served:
                # longrope's long factors / dynamic NTK's raised base take over past it: not implemented (RopeScaling)
                raise ValueError(f"position {needed - 1} is past the {served} positions Tandem serves with "
                                 f"rope_scaling.rope_type {self.scaling.rope_type!r}")
            n = max(self.max_positions, needed)
            inv_freq = [self.theta ** (-2 * i / self.head_dim) for i in range(self.head_dim // 2)]
            inv = torch.tensor(self.scaling.scale_inv_freq(inv_freq, self.theta), dtype=torch.float32, device=device)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv)
            # cos/sin are computed in fp32 (yarn: times its attention factor), then cast to the activation dtype
            # (as the reference does).
            factor = self.scaling.cos_sin_factor
            cos, sin = freqs.cos(), freqs.sin()
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            table = torch.cat([cos, sin], dim=-1).to(dtype)
            self._cos_sin = table
        return table

    def table(self, device: torch.device, dtype: torch.dtype, needed: int) -> torch.Tensor:
        """The cos/sin table, [>= needed, head_dim] = cat(cos, sin) halves, in ``dtype`` on ``device``."""
        return self._table(device, dtype, needed)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
        needed = (max_position if max_position is not None else int(positions.max())) + 1
        cos, sin = self._table(q.device, q.dtype, needed)[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SwiGLUMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul: SiLU (SwiGLU), or Gemma's GELU-tanh
    (``ModelConfig.activation``), each through the fused ops."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 activation: Activation = Activation.SILU) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gelu = activation is Activation.GELU_TANH

    def forward(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]; act(gate) * up in one pass (ops.silu_mul / gelu_tanh_mul)
        gate_up = self.gate_up_proj(x)
        return self.down_proj(ops.gelu_tanh_mul(gate_up) if self.gelu else ops.silu_mul(gate_up))

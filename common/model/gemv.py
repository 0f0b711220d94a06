"""Float linear layers on CPU at decode sizes: Tandem's GEMV kernels, the library's matmul above them.

A decode step multiplies each weight matrix by a handful of rows, so it is bound by streaming the weights
from DRAM. Measured on a 2-core AVX-512 EPYC (30 matrices of each SmolLM2 shape, out of cache, 2 threads):
oneDNN's bf16 GEMV streams 11-14 GB/s and MKL's fp32 one 12 GB/s.

- ``PanelLinear`` (the default where out_features is a multiple of 16): the weight held in 16-row panels
  (``pack_panels``), multiplied by ``dense_matmul_panel`` (``common/quant/cpu_gemv.cpp``): each thread
  streams whole panels, ``vdpbf16ps`` on AVX512-BF16. bf16, 2 threads, AMD EPYC: batch 1 31 GB/s (9.8 ->
  6.8 ms for 30 layers), 8 rows 21 -> 8 ms, 64 rows 41.5 ms against oneDNN's 48.7. Without AMX, above
  ``PANEL_MAX_ROWS`` rows (prefill) oneDNN's GEMM is faster (0.72x at 512 rows for the panel kernel), so
  tiles are unpacked for it. Where the CPU grants AMX (Intel Sapphire Rapids on), from ``AMX_MIN_ROWS``
  rows the panels go straight into AMX tiles (``common/quant/cpu_amx.cpp``: the bf16 panel layout is the
  tile unit's B layout) at every row count; measured on a 2-core Xeon with AMX, 30 layers: 4 rows 18.4
  (``vdpbf16ps``) -> 13.0 ms, 64 rows oneDNN 44 -> 28-36 ms, 256 rows 121 -> 100-110 ms, 512 rows about
  even. ``TANDEM_CPU_AMX=auto|on|off``. A tied LM head becomes a ``PanelLinear`` too and the token lookup
  reads its rows (``PanelEmbedding``): one copy of the matrix. ``TANDEM_CPU_PANELS=off`` keeps row-major
  weights.
- ``GemvLinear`` (other shapes): ``dense_matmul``, row-major tiles with software prefetch (bf16 17-22 GB/s,
  fp32 24-25 GB/s) up to ``GEMV_MAX_ROWS``, ``F.linear`` above it (row-bucketed for 16-bit activations,
  common/model/row_buckets.py); an untied-shape head points ``head_matmul`` at ``linear``.

``gemv_linears(model)`` swaps the model's plain ``nn.Linear`` layers in place. ``TANDEM_CPU_GEMV=auto|on|off``
(auto: on CPU where the kernels build; on: or a start-up error; off: the library's matmuls only). Within
a path each row's result does not depend on the rows beside it. Where AMX runs from 2 rows, a 1-row
decode (``vdpbf16ps``) and a multi-row call (AMX tiles) sum in a different order, so in bf16 a
speculative verification row can differ from the plain decode row in the last bit (fp32 panels have one
path: rows equal).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch
from torch import nn

from common.model.row_buckets import bucket_rows, linear_bucketed
from common.quant.cpu_kernels import NO_AMX, amx_enabled
from common.quant.cpu_linear import GEMV_MAX_ROWS, TILE_ELEMENTS  # one limit for float and packed weights
from common.quant.panels import PANEL_ROWS

log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16)
_state: dict[str, ModuleType | None] = {}
_limits: dict[str, int] = {}


def gemv_mode() -> str:
    mode = os.environ.get("TANDEM_CPU_GEMV", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"TANDEM_CPU_GEMV={mode!r}; choose one of auto, on, off")
    return mode


def gemv_kernels() -> ModuleType | None:
    """The compiled kernels (``dense_matmul``), or None where they cannot be built (decided once)."""
    if "ops" not in _state:
        from common.quant.cpu_kernels import quant_kernels

        try:
            _state["ops"] = quant_kernels()
        except RuntimeError as exc:
            log.warning("CPU GEMV kernel unavailable (%s); linear layers use torch's matmul", exc)
            _state["ops"] = None
    return _state["ops"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           bucketed: bool = False) -> torch.Tensor:
    """``F.linear``, through ``dense_matmul`` for up to ``GEMV_MAX_ROWS`` rows of fp32/bf16 on CPU."""
    ops = _state.get("ops")
    if (ops is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.dtype in _FLOATS
            and weight.dtype in _FLOATS and x.device.type == "cpu" and weight.is_contiguous()):
        y = ops.dense_matmul(x if x.is_contiguous() else x.contiguous(), weight)
        return y if bias is None else y + bias
    return linear_bucketed(x, weight, bias) if bucketed else nn.functional.linear(x, weight, bias)


class GemvLinear(nn.Linear):
    """``nn.Linear`` through ``linear`` (the GEMV at decode sizes); ``bucketed``: row buckets above it."""

    bucketed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.bucketed)


class GemvBucketedLinear(GemvLinear):
    bucketed = True


PANEL_MAX_ROWS = 256  # up to here the panel kernel; above, oneDNN / MKL on unpacked tiles (measured faster)


AMX_MIN_ROWS = 2  # from 2 rows AMX tiles (where the CPU has them) beat vdpbf16ps: 30 layers, 4 rows 13.0 vs 18.4 ms


def _amx_min_rows(ops: ModuleType) -> int:
    """Rows from which ``dense_matmul_panel`` runs AMX tiles (``TANDEM_CPU_AMX``; never: ``NO_AMX``)."""
    if "amx_min_rows" not in _limits:
        _limits["amx_min_rows"] = AMX_MIN_ROWS if amx_enabled(ops) else NO_AMX
    return _limits["amx_min_rows"]


def amx_min_rows() -> int:
    """Rows from which bf16 panels multiply in AMX tiles in this process (``NO_AMX``: never; the one-call
    decode step, common/model/decode_step.py, follows the same threshold)."""
    ops = gemv_kernels()
    return NO_AMX if ops is None else _amx_min_rows(ops)


def panel_max_rows() -> int:
    """Rows up to which ``PanelLinear`` multiplies its panels as they lie in this process (0: no kernels);
    the one-call decode step (common/model/decode_step.py) follows the same limit."""
    ops = gemv_kernels()
    return 0 if ops is None else _panel_max_rows(ops)


def _panel_max_rows(ops: ModuleType) -> int:
    """Rows up to which panels multiply as they lie: any count with AMX, else ``PANEL_MAX_ROWS``."""
    return NO_AMX if _amx_min_rows(ops) < NO_AMX else PANEL_MAX_ROWS


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 ``[N/16, K/2, 16, 2]`` or fp32 ``[N/16, K, 16]`` (``dense_matmul_panel``'s layout)."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.reshape(n // PANEL_ROWS, PANEL_ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.reshape(n // PANEL_ROWS, PANEL_ROWS, k).permute(0, 2, 1).contiguous()


def unpack_panels(panels: torch.Tensor, p0: int = 0, p1: int | None = None) -> torch.Tensor:
    """Panels ``p0 .. p1`` back to row-major ``[(p1 - p0) * 16, K]``."""
    part = panels[p0:p1]
    if part.dim() == 4:
        return part.permute(0, 2, 1, 3).reshape(part.shape[0] * PANEL_ROWS, part.shape[1] * 2)
    return part.permute(0, 2, 1).reshape(part.shape[0] * PANEL_ROWS, part.shape[1])


class PanelLinear(nn.Linear):
    """A float linear layer whose weight is held in 16-row panels (``dense_matmul_panel``): one contiguous
    stream per panel at decode sizes, ``vdpbf16ps`` where the CPU has AVX512-BF16, AMX tiles from
    ``AMX_MIN_ROWS`` rows at every size where it grants them. Without AMX, above ``PANEL_MAX_ROWS`` rows
    (prefill) cache-sized tiles are unpacked to row-major and multiplied by torch's GEMM. ``weight``
    returns a row-major copy, so code that reads an ``nn.Linear``'s weight (quantizing or sharding a
    loaded model) still can; the layer holds only the panels. ``float_out``: fp32 outputs whatever the
    input dtype (an LM head: the logits go to sampling in fp32, with no bf16 rounding on the way)."""

    panels: torch.Tensor
    float_out = False

    def __init__(self, linear: nn.Linear, bucketed: bool) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: no weight parameter
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.bucketed = bucketed  # tiles see bucketed row counts (common/model/row_buckets.py)
        self.register_buffer("panels", pack_panels(linear.weight.detach()), persistent=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return unpack_panels(self.panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _state.get("ops")
        if x.dim() == 2:  # the model's [tokens, features] (no reshapes: a decode step makes ~120 calls)
            if ops is not None and x.dtype in _FLOATS and x.shape[0] <= _panel_max_rows(ops):
                y = ops.dense_matmul_panel(x if x.is_contiguous() else x.contiguous(), self.panels,
                                           _amx_min_rows(ops), self.float_out)
            else:
                y = self._tiled(x)
            return y if self.bias is None else y + self.bias
        return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        rows = bucket_rows(m) if self.bucketed else m
        xs = x.to(self.panels.dtype)
        if rows != m:
            xs = torch.cat([xs, xs.new_zeros(rows - m, xs.shape[1])])
        step = max(1, TILE_ELEMENTS // (self.in_features * PANEL_ROWS))  # panels per tile
        out = torch.empty(rows, self.out_features, dtype=xs.dtype)
        for p0 in range(0, self.panels.shape[0], step):
            p1 = min(self.panels.shape[0], p0 + step)
            torch.mm(xs, unpack_panels(self.panels, p0, p1).T, out=out[:, p0 * PANEL_ROWS : p1 * PANEL_ROWS])
        return (out[:m] if rows != m else out).to(torch.float32 if self.float_out else x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panels of {PANEL_ROWS} rows"


class PanelEmbedding(nn.Embedding):
    """A tied model's token lookup reading the rows of its ``PanelLinear`` LM head: one copy of the largest
    matrix serves both ends (as ``common/quant/embedding.py`` does for packed int8 heads). ``weight``: a
    row-major copy, as ``PanelLinear``'s."""

    def __init__(self, head: PanelLinear) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: no weight parameter
        self._head = (head,)  # shared, not a submodule (the head is the model's ``lm_head``)
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx, self.max_norm, self.sparse = None, None, False

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self._head[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        panels = self._head[0].panels
        rows = panels[ids // PANEL_ROWS, :, ids % PANEL_ROWS]  # [n, K/2, 2] or [n, K]
        return rows.reshape(ids.shape[0], self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the LM head's panels"


def _panel_tied_head(model: nn.Module, bucketed: bool) -> bool:
    """A tied model's embedding as the panels of an LM head (``lm_head`` set, the lookup reading it)."""
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", True) is not None or type(embed) is not nn.Embedding:
        return False
    weight = embed.weight
    if weight.dtype not in _FLOATS or weight.shape[0] % PANEL_ROWS or weight.shape[1] % 2:
        return False
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight.detach(), requires_grad=False)
    model.lm_head = PanelLinear(head, bucketed)
    model.lm_head.float_out = True
    model.embed_tokens = PanelEmbedding(model.lm_head)
    return True


def gemv_linears(model: nn.Module, bucketed: bool, panels: bool = True) -> int:
    """Swap ``model``'s plain (and row-bucketed) ``nn.Linear`` layers for GEMV ones in place; how many.

    The model's tied LM head (``compute_logits`` over the embedding) is pointed at ``linear`` as well."""
    from common.model.row_buckets import BucketedLinear

    cls = GemvBucketedLinear if bucketed else GemvLinear
    count = 0
    panels = panels and panel_mode()
    for name, module in list(model.named_modules()):
        if type(module) not in (nn.Linear, BucketedLinear):
            continue
        if panels and _fits_panels(module):
            parent_name, _, child = name.rpartition(".")
            panel = PanelLinear(module, bucketed)
            panel.float_out = name == "lm_head"  # an untied head: its logits in fp32 as well
            model.get_submodule(parent_name).set_submodule(child, panel)
        else:
            module.__class__ = cls
        count += 1
    if panels and _panel_tied_head(model, bucketed):
        return count + 1
    if hasattr(model, "head_matmul"):
        object.__setattr__(model, "head_matmul", linear)  # a plain attribute (nn.Module's typing says Module)
    return count


def panel_mode() -> bool:
    """``TANDEM_CPU_PANELS=auto|on|off`` (auto = on): float weights in 16-row panels where they fit."""
    mode = os.environ.get("TANDEM_CPU_PANELS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"TANDEM_CPU_PANELS={mode!r}; choose one of auto, on, off")
    return mode != "off"


def _fits_panels(module: nn.Linear) -> bool:
    w = module.weight
    return (w.dtype in _FLOATS and w.device.type == "cpu" and module.out_features % PANEL_ROWS == 0
            and module.in_features % 2 == 0)


def wanted(device: torch.device) -> bool:
    """Whether the loader should use the GEMV layers on ``device`` (``TANDEM_CPU_GEMV``)."""
    mode = gemv_mode()
    if mode == "off" or device.type != "cpu":
        return False
    if gemv_kernels() is None:
        if mode == "on":
            raise RuntimeError("TANDEM_CPU_GEMV=on but the CPU kernels could not be built (see the log)")
        return False
    return True

"""The interleaved "panel" layouts of ``int8_matmul_panel`` / ``int4_matmul_panel`` (cpu_quant_panel.cpp).

A panel is 16 output rows. Its weights are stored k-step by k-step, each step holding a few consecutive
weights of all 16 rows in 64 bytes, so one vector load feeds an integer dot-product instruction
(``vpdpbusd``: 4 bytes of each of 16 rows against 4 broadcast activation bytes) and no horizontal sums are
needed. oneDNN and llama.cpp's repacked CPU kernels store weights the same way. ``Int8Weight`` and
``Int4Weight`` (formats.py) stay the row-major formats everything else reads; these are the kernels' copies,
made once at load (the layer then holds only these).

- int8: q int8 ``[N/16, K/4, 16, 4]`` (4 consecutive weights per row and step); scales fp32 ``[N]`` with one
  per row, or ``[N/16, K/G, 16]`` with groups.
- int4: q uint8 ``[N/16, K/8, 16, 4]``: byte ``j`` of a row's 4 holds weight ``j`` of the step's 8 in its low
  nibble and weight ``j + 4`` in its high nibble (so a mask gives 4 weights of 16 rows, a shift and a mask
  the next 4); scales and zeros fp16 ``[N/16, K/G, 16]``.
"""

from __future__ import annotations

import torch

from common.quant.formats import Int4Weight, Int8Weight

PANEL_ROWS = 16  # output rows per panel


def panels_fit(n: int, k: int) -> bool:
    """Whether an ``[n, k]`` matrix has a panel layout (k is a multiple of 32 for every packed format)."""
    return n % PANEL_ROWS == 0 and k % 8 == 0


def _check(n: int, k: int) -> None:
    if not panels_fit(n, k):
        raise ValueError(f"panels need out_features % {PANEL_ROWS} == 0 and in_features % 8 == 0, not {n} x {k}")


def _group_major(t: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    # [N, K/G] -> [N/16, K/G, 16]
    return t.reshape(n // PANEL_ROWS, PANEL_ROWS, groups).permute(0, 2, 1).contiguous()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    # [N/16, K/G, 16] -> [N, K/G]
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])


def pack_int8_panels(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of ``weight`` in the int8 panel layout."""
    n, k = weight.shape
    _check(n, k)
    q = weight.q.reshape(n // PANEL_ROWS, PANEL_ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    groups = k // weight.group_size
    scales = weight.scales.float().reshape(n, groups)
    return q, (scales.reshape(n).contiguous() if groups == 1 else _group_major(scales, n, groups))


def unpack_int8_panels(q: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[n, K]`` (all rows when ``rows`` is None) of an int8 panel matrix, as int8."""
    panels, k4 = q.shape[0], q.shape[1]
    if rows is None:
        return q.permute(0, 2, 1, 3).reshape(panels * PANEL_ROWS, k4 * 4)
    return q[rows // PANEL_ROWS, :, rows % PANEL_ROWS, :].reshape(rows.shape[0], k4 * 4)


def panel_groups_by_row(scales: torch.Tensor, n: int) -> torch.Tensor:
    """Panel scales (or zeros) back to ``[N, K/G]`` (int8 with one scale per row: ``[N, 1]``)."""
    return scales.reshape(n, 1) if scales.dim() == 1 else _row_major(scales)


def pack_int4_panels(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scales, zeros) of ``weight`` in the int4 panel layout."""
    n, k = weight.shape
    _check(n, k)
    codes = weight.unpack().reshape(n // PANEL_ROWS, PANEL_ROWS, k // 8, 2, 4)
    q = (codes[..., 0, :] | (codes[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
    groups = k // weight.group_size
    return q, _group_major(weight.scales, n, groups), _group_major(weight.zeros, n, groups)


def unpack_int4_panels(q: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The 4-bit codes ``[n, K]`` (uint8 0..15) of rows of an int4 panel matrix (all when ``rows`` is None)."""
    panels, k8 = q.shape[0], q.shape[1]
    steps = q.permute(0, 2, 1, 3).reshape(panels * PANEL_ROWS, k8, 4) if rows is None \
        else q[rows // PANEL_ROWS, :, rows % PANEL_ROWS, :]
    return torch.cat([steps & 0x0F, steps >> 4], dim=-1).reshape(steps.shape[0], k8 * 8)


def int4_panel_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Weight:
    """The row-major ``Int4Weight`` a panel matrix holds (tests, and dequantizing without the kernel)."""
    from common.quant.formats import pack_int4

    return Int4Weight(pack_int4(unpack_int4_panels(q)), _row_major(scales).contiguous(),
                      _row_major(zeros).contiguous(), group_size)

"""Routed experts (Mixtral, Qwen3-MoE): the router, the experts' stacked weights, and how routed tokens meet them.

``SparseMoE`` replaces a layer's dense MLP. Per token: the router's logits over all experts, a softmax in fp32,
the ``k`` most probable experts (their probabilities renormalised to sum to 1 where the family says so), and
the sum over those experts of ``weight * down(silu(gate(x)) * up(x))`` — transformers' ``*SparseMoeBlock``.

The experts' weights are stacked as transformers 5 and vLLM hold them: ``w13`` ``[experts, 2 * inter, hidden]``
(each expert's gate rows, then its up rows) and ``w2`` ``[experts, hidden, inter]``. A module may hold only some
experts (expert parallelism: ``expert_start`` is the global id of its first) or only some intermediate columns
of every expert (tensor parallelism); either way its output is a partial sum that ``reduce`` (the rank group's
all-reduce, common/parallel/tp_model.py) completes.

How the routed tokens are multiplied is the module's ``experts`` strategy (vLLM's ``FusedMoEMethodBase``):

- ``PanelExperts`` (CPU, the default where the C++ kernels build; ``TANDEM_CPU_MOE``): each expert's weights
  in the 16-row float panels of common/model/gemv.py and the whole layer's experts in one C++ call
  (``moe_experts``, common/kernels/cpu/cpu_moe.cpp): the pairs sorted by expert, every hit expert's panels read
  once and multiplied by all its rows, the threads split by (expert, panel), no Python per expert; at prefill
  sizes (more rows per expert than the panel kernel wins at) each expert's panels are unpacked in turn for
  torch's GEMM, as ``PanelMethod`` does.
- ``LoopExperts``: transformers' loop — for each expert that any token chose, gather its tokens, two matmuls,
  scatter back. The reference, and what the benchmark (benchmarks/moe_step.py) measures against.
- ``GroupedExperts``: the (token, expert) pairs sorted by expert once per step; then, at decode sizes (few rows
  per expert, every expert's weights read once whatever the rows), all experts' GEMMs as two batched matmuls
  over the rows padded to the busiest expert; at prefill sizes (many rows per expert, where padding would be
  wasted arithmetic) one GEMM per expert over its contiguous slice of the sorted rows; where few experts are
  hit (batch-1 decode), one GEMM per hit expert. Each expert's weights are read once per step either way.
- ``PackedExperts`` (``--quantization int8 | int4`` on CPU): the same one call over int8 / int4 panels; gpt-oss's
  biased experts (the one call runs silu(gate) * up only) one packed GEMM per hit expert and projection, the
  biases and the clamped SwiGLU in PyTorch between them.
- On CUDA, ``TritonExperts`` (common/kernels/triton/moe.py): the sorted pairs aligned to row blocks of one
  expert each, one grouped-GEMM launch per projection (vLLM's fused-MoE layout).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from common.model.linear import Linear

if TYPE_CHECKING:
    from common.model.families import MoEOptions
    from common.model.fused_ops import FusedOps
    from common.parallel.comm import Communicator

# GroupedExperts' choice between its ways (see the module docstring), by the shape of the step's routing:
# batched matmuls over padded rows while the busiest expert has at most this many rows (a decode step: the
# weights' bytes dominate, padding costs no memory traffic) ...
PADDED_MAX_ROWS = 64
# ... or while padding adds at most this factor of arithmetic; and one GEMM per hit expert where at most this
# fraction of the experts is hit (padding would read every expert's weights for a few tokens).
PADDED_MAX_WASTE = 1.5
FEW_EXPERTS_FRACTION = 0.25


def route(logits: torch.Tensor, top_k: int, renormalize: bool, topk_first: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[T, experts]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64), as transformers'
    routers compute them: softmax over every expert in fp32, top-k, optionally renormalised; ``topk_first``
    (gpt-oss): the top-k logits, then a softmax over those k."""
    if topk_first:
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=torch.float32), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


class RoutedExperts(Protocol):
    """How a ``SparseMoE`` multiplies the routed tokens by its experts (chosen once, by ``experts_for``)."""

    name: str

    def process_weights_after_loading(self, moe: SparseMoE) -> None:
        """Turn the loaded (and, on a parallel rank, sliced) ``w13`` / ``w2`` into this way's layout."""
        ...

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        """x ``[T, hidden]``, ids / weights ``[T, k]`` (global expert ids) -> ``[T, hidden]``: the sum over each
        token's experts held by ``moe`` of weight * expert(x); zeros for tokens none of whose experts it holds."""
        ...


class LoopExperts:
    """transformers' loop over the experts that any token chose (the reference)."""

    name = "loop"

    def process_weights_after_loading(self, moe: SparseMoE) -> None:
        pass

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        out = torch.zeros_like(x)
        local = ids - moe.expert_start
        for e in torch.unique(local).tolist():
            if not 0 <= e < moe.num_local_experts:
                continue
            token, slot = torch.where(local == e)
            h = moe.activate(nn.functional.linear(x[token], moe.w13[e], moe.bias13(e)), ops)
            y = nn.functional.linear(h, moe.w2[e], moe.bias2(e)) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out


class GroupedExperts:
    """The pairs sorted by expert once, then each expert's GEMM once (see the module docstring)."""

    name = "grouped"

    def process_weights_after_loading(self, moe: SparseMoE) -> None:
        pass

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        out = torch.zeros_like(x)
        expert, token, weight = sort_pairs(moe, ids, weights)
        n = expert.numel()
        if n == 0:
            return out
        num_experts = moe.num_local_experts
        counts = torch.bincount(expert, minlength=num_experts)  # [experts] rows per expert
        max_rows = int(counts.max())
        hit = int((counts > 0).sum())
        if hit > FEW_EXPERTS_FRACTION * num_experts and (
                max_rows <= PADDED_MAX_ROWS or max_rows * num_experts <= PADDED_MAX_WASTE * n):
            y = _padded(moe, x, expert, token, counts, max_rows, ops)
        else:
            y = _slices(moe, x[token], counts.tolist(), ops)
        out.index_add_(0, token, y * weight[:, None].to(x.dtype))
        return out


def sort_pairs(moe: SparseMoE, ids: torch.Tensor, weights: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of experts ``moe`` holds, sorted by (local) expert, stable (so each expert's rows
    keep token order): (expert [n], token [n], weight [n])."""
    num_tokens, k = ids.shape
    expert = ids.reshape(-1) - moe.expert_start
    weight = weights.reshape(-1)
    token = torch.arange(num_tokens, device=ids.device).repeat_interleave(k)
    if moe.num_local_experts != moe.num_experts:  # expert parallel: only this rank's experts
        mine = (expert >= 0) & (expert < moe.num_local_experts)
        expert, weight, token = expert[mine], weight[mine], token[mine]
    order = torch.argsort(expert, stable=True)
    return expert[order], token[order], weight[order]


def _padded(moe: SparseMoE, x: torch.Tensor, expert: torch.Tensor, token: torch.Tensor, counts: torch.Tensor,
            max_rows: int, ops: FusedOps) -> torch.Tensor:
    """Every expert's rows padded to ``max_rows``: two batched matmuls. -> [n, hidden] in the pairs' order."""
    num_experts, hidden = moe.num_local_experts, x.shape[1]
    starts = counts.cumsum(0) - counts
    row = torch.arange(expert.numel(), device=x.device) - starts[expert]  # each pair's row within its expert
    xp = x.new_zeros(num_experts, max_rows, hidden)
    xp[expert, row] = x[token]
    h = torch.bmm(xp, moe.w13.transpose(1, 2))  # [experts, max_rows, 2 * inter]
    if moe.b13 is not None:
        h += moe.b13[:, None, :]
    act = moe.activate(h.view(num_experts * max_rows, -1), ops).view(num_experts, max_rows, -1)
    y = torch.bmm(act, moe.w2.transpose(1, 2))[expert, row]  # [n, hidden]
    return y if moe.b2 is None else y + moe.b2[expert]


Projection = Callable[[torch.Tensor, int, int], torch.Tensor]
"""(rows, expert e, 0: gate/up | 1: down) -> the rows through expert e's projection, its bias added."""


def _float_projection(moe: SparseMoE) -> Projection:
    def project(x: torch.Tensor, e: int, which: int) -> torch.Tensor:
        if which == 0:
            return nn.functional.linear(x, moe.w13[e], moe.bias13(e))
        return nn.functional.linear(x, moe.w2[e], moe.bias2(e))

    return project


def _slices(moe: SparseMoE, xs: torch.Tensor, counts: list[int], ops: FusedOps,
            project: Projection | None = None) -> torch.Tensor:
    """One GEMM per hit expert and projection over its contiguous rows of ``xs`` (the pairs' tokens, sorted by
    expert), the activation between them. ``project``: how an expert's projection runs (default: ``F.linear``
    over the stacked float weights)."""
    project = _float_projection(moe) if project is None else project
    pieces = []
    start = 0
    for e, rows in enumerate(counts):
        if rows:
            h = moe.activate(project(xs[start : start + rows], e, 0), ops)
            pieces.append(project(h, e, 1))
            start += rows
    return torch.cat(pieces)


class PanelExperts:
    """Every expert's weights in 16-row float panels, the layer's experts in one C++ call (module docstring)."""

    name = "panels"

    def __init__(self, ops: ModuleType) -> None:
        from common.model.gemv import PANEL_MAX_ROWS

        self._ops = ops
        self.max_rows = PANEL_MAX_ROWS  # rows per expert up to which the panel kernel beats torch's GEMM

    @staticmethod
    def fits(moe: SparseMoE) -> bool:
        """The panel layout's shape rules: 16-row panels of 2 * inter and hidden rows, bf16 pairs."""
        inter, hidden = moe.intermediate_size, moe.w13.shape[2]
        return (moe.plain and moe.w13.device.type == "cpu" and moe.w13.dtype in (torch.float32, torch.bfloat16)
                and (2 * inter) % 16 == 0 and hidden % 16 == 0 and inter % 2 == 0)

    def process_weights_after_loading(self, moe: SparseMoE) -> None:
        from common.model.gemv import pack_panels

        w13 = torch.stack([pack_panels(w) for w in moe.w13.detach()])  # [E, 2I/16, H, 16] (bf16: [.., H/2, 16, 2])
        w2 = torch.stack([pack_panels(w) for w in moe.w2.detach()])  # [E, H/16, I, 16]
        moe.drop_float_weights()
        moe.register_buffer("w13_panels", w13, persistent=False)
        moe.register_buffer("w2_panels", w2, persistent=False)

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        expert, token, weight = sort_pairs(moe, ids, weights)
        counts = torch.bincount(expert, minlength=moe.num_local_experts)
        w13, w2 = moe.get_buffer("w13_panels"), moe.get_buffer("w2_panels")
        if expert.numel() and int(counts.max()) > self.max_rows:  # prefill sizes: torch's GEMM per expert
            from common.model.gemv import unpack_panels

            panels = (w13, w2)  # plain experts: no biases
            y = _slices(moe, x[token], counts.tolist(), ops,
                        lambda rows, e, which: nn.functional.linear(rows, unpack_panels(panels[which][e])))
            out = torch.zeros_like(x)
            out.index_add_(0, token, y * weight[:, None].to(x.dtype))
            return out
        offsets = torch.zeros(moe.num_local_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        return self._ops.moe_experts(x.contiguous(), token, weight.float().contiguous(), offsets, w13, w2)


class TritonExperts:
    """CUDA: the pairs aligned to row blocks of one expert each, one grouped-GEMM launch per projection
    (common/kernels/triton/moe.py)."""

    name = "triton"

    def process_weights_after_loading(self, moe: SparseMoE) -> None:
        pass

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        from common.kernels.triton.moe import align, block_m_for, grouped_matmul

        out = torch.zeros_like(x)
        expert, token, weight = sort_pairs(moe, ids, weights)
        if expert.numel() == 0:
            return out
        block_m = block_m_for(expert.numel(), moe.num_local_experts)
        row_src, block_expert, slot = align(expert, token, moe.num_local_experts, block_m)
        h = grouped_matmul(x, moe.w13, row_src, block_expert, block_m)  # [padded rows, 2 * inter]
        # padding rows of h are never written; silu_mul passes them through, the second GEMM skips them
        act = ops.silu_mul(h)
        rows = torch.where(row_src >= 0, torch.arange(row_src.numel(), device=x.device), -1)
        y = grouped_matmul(act, moe.w2, rows, block_expert, block_m)
        out.index_add_(0, token, y[slot] * weight[:, None].to(x.dtype))
        return out


class PackedExperts:
    """int8 or int4 experts (``--quantization``) in the packed panel layouts of common/quant/panels.py, the layer's
    experts in one C++ call (``moe_experts_packed``): activations rounded to int8 in blocks of 32, integer dot
    products, as a packed ``Linear``'s ``tandem_a8`` method. Each expert is quantized as a ``Linear`` of the same
    format is (int8: one scale per output row; int4: asymmetric groups of ``group_size``); the router stays float.

    gpt-oss's experts (biases, the clamped SwiGLU: not ``moe.plain``) run the same panels through the packed
    ``Linear``'s kernels (``int8_matmul_panel`` / ``int4_matmul_panel``, the same a8 rounding) one hit expert at a
    time, with the float path's bias adds and ``moe.activate`` between the two GEMMs."""

    def __init__(self, ops: ModuleType, int4: bool, group_size: int) -> None:
        self._ops = ops
        self.int4, self.group_size = int4, group_size
        self.name = "int4 panels" if int4 else "int8 panels"
        self._panel = ops.int4_matmul_panel if int4 else ops.int8_matmul_panel  # gpt-oss: one expert at a time

    @staticmethod
    def fits(moe: SparseMoE, int4: bool, group_size: int) -> str | None:
        """Why these experts cannot be packed (None: they can): panels of 16 rows over inputs in 32-blocks."""
        inter, hidden = moe.intermediate_size, moe.w13.shape[2]
        if moe.w13.device.type != "cpu":
            return f"packed experts run on CPU; the experts are on {moe.w13.device}"
        if hidden % 32 or inter % 32 or (2 * inter) % 16 or hidden % 16:
            return (f"hidden_size ({hidden}) and the experts' intermediate size ({inter}) must be multiples of 32 "
                    f"(the packed kernels' block)")
        if int4 and (hidden % group_size or inter % group_size):
            return f"the int4 group size {group_size} must divide hidden_size ({hidden}) and the experts' ({inter})"
        return None

    def process_weights_after_loading(self, moe: SparseMoE) -> None:
        from common.quant.formats import quantize_int4, quantize_int8
        from common.quant.panels import pack_int4_panels, pack_int8_panels

        def pack(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
            parts: list[tuple[torch.Tensor, ...]] = []
            group = self.group_size if self.int4 else stacked.shape[2]
            for w in stacked.detach().float():
                parts.append(pack_int4_panels(quantize_int4(w, group)) if self.int4
                             else (*pack_int8_panels(quantize_int8(w)), torch.empty(0)))
            q, s, z = (torch.stack([p[i] for p in parts]) for i in range(3))
            return q, s, z, group

        q13, s13, z13, g13 = pack(moe.w13)
        q2, s2, z2, g2 = pack(moe.w2)
        moe.drop_float_weights()
        for name, t in (("q13", q13), ("s13", s13), ("z13", z13), ("q2", q2), ("s2", s2), ("z2", z2)):
            moe.register_buffer(name, t, persistent=False)
        self._groups = (g13, g2)

    def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              ops: FusedOps) -> torch.Tensor:
        expert, token, weight = sort_pairs(moe, ids, weights)
        counts = torch.bincount(expert, minlength=moe.num_local_experts)
        offsets = torch.zeros(moe.num_local_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        b = moe.get_buffer
        g13, g2 = self._groups
        xf = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        if not moe.plain:
            return self._biased(moe, xf, expert, token, weight, counts.tolist(), ops).to(x.dtype)
        out = self._ops.moe_experts_packed(xf.contiguous(), token, weight.float().contiguous(), offsets,
                                           b("q13"), b("s13"), b("z13"), g13, b("q2"), b("s2"), b("z2"), g2)
        return out.to(x.dtype)

    def _biased(self, moe: SparseMoE, x: torch.Tensor, expert: torch.Tensor, token: torch.Tensor,
                weight: torch.Tensor, counts: list[int], ops: FusedOps) -> torch.Tensor:
        """gpt-oss: the float path's ``_slices`` (per hit expert: + b13, clamped SwiGLU, + b2) over the packed
        GEMMs; x ``[T, hidden]`` fp32 or bf16 -> ``[T, hidden]``."""
        out = torch.zeros_like(x)
        if expert.numel() == 0:
            return out
        assert moe.b13 is not None and moe.b2 is not None
        b = moe.get_buffer
        g13, g2 = self._groups
        packed = ((b("q13"), b("s13"), b("z13"), g13, moe.b13), (b("q2"), b("s2"), b("z2"), g2, moe.b2))

        def project(rows: torch.Tensor, e: int, which: int) -> torch.Tensor:
            q, scales, zeros, group, bias = packed[which]
            return self._matmul(rows.contiguous(), (q, scales, zeros), e, group) + bias[e]

        y = _slices(moe, x[token], counts, ops, project)
        out.index_add_(0, token, y * weight[:, None].to(x.dtype))
        return out

    def _matmul(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor], e: int,
                group: int) -> torch.Tensor:
        """x ``[rows, K]`` times expert e of one stacked projection's (q, scales, zeros) -> ``[rows, N]``."""
        q, s, z = packed
        if self.int4:
            return self._panel(x, q[e], s[e], z[e], group)
        return self._panel(x, q[e], s[e], group)


def packed_experts_for(moe: SparseMoE, method: str, group_size: int) -> PackedExperts:
    """``--quantization int8 | int4`` for ``moe``'s experts on CPU, or ``QuantizationError`` naming the flag."""
    from common.kernels.cpu import quant_kernels
    from common.quant.config import FLAG, QuantizationError

    if method not in ("int8", "int4"):
        raise QuantizationError(f"{FLAG} {method}: a mixture of experts' routed experts are packed as int8 or int4 "
                                f"only (on CPU)")
    why = PackedExperts.fits(moe, method == "int4", group_size)
    if why is not None:
        raise QuantizationError(f"{FLAG} {method}: {why}")
    try:
        ops = quant_kernels()
    except RuntimeError as exc:
        raise QuantizationError(f"{FLAG} {method}: {exc}") from exc
    return PackedExperts(ops, method == "int4", group_size)


def experts_for(moe: SparseMoE, device: torch.device) -> RoutedExperts:
    """The way ``moe`` runs on ``device``: on CUDA ``TritonExperts`` (where triton is installed); on CPU
    ``PanelExperts`` where the C++ kernels build and its shapes fit (``TANDEM_CPU_MOE``: auto, on = that or an
    error, off = never); else ``GroupedExperts``."""
    import importlib.util

    from common.config.settings import kernel_setting

    if device.type == "cuda":
        triton = importlib.util.find_spec("triton") is not None
        return TritonExperts() if triton and moe.plain else GroupedExperts()
    mode = str(kernel_setting("cpu_moe"))  # TANDEM_CPU_MOE
    if device.type != "cpu" or mode == "off":
        return GroupedExperts()
    from common.model.gemv import gemv_kernels

    ops = gemv_kernels()
    if ops is not None and PanelExperts.fits(moe):
        return PanelExperts(ops)
    if mode == "on":
        raise RuntimeError("TANDEM_CPU_MOE=on but the CPU kernels could not be built or the experts' shapes do not "
                           "fit 16-row panels (2 * moe_intermediate_size and hidden_size multiples of 16)")
    return GroupedExperts()


class SparseMoE(nn.Module):
    """A layer's routed experts: ``forward(x [T, hidden], ops) -> [T, hidden]``."""

    def __init__(self, hidden_size: int, options: MoEOptions) -> None:
        super().__init__()
        self.num_experts = options.num_experts  # the router's: every expert, wherever it is held
        self.top_k = options.experts_per_token
        self.renormalize = options.norm_topk_prob
        self.intermediate_size = options.intermediate_size  # held here (a tensor-parallel rank: its columns)
        self.topk_first = options.topk_before_softmax
        self.swiglu_limit, self.swiglu_alpha = options.swiglu_limit, options.swiglu_alpha
        # The router: replicated on every rank, and float under every quantization (routing must not move).
        self.gate = Linear(hidden_size, options.num_experts, bias=options.router_bias)
        inter, e = options.intermediate_size, options.num_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, inter), requires_grad=False)
        # gpt-oss: each expert's biases (gate rows then up rows, as w13; down)
        self.b13 = nn.Parameter(torch.empty(e, 2 * inter), requires_grad=False) if options.expert_bias else None
        self.b2 = nn.Parameter(torch.empty(e, hidden_size), requires_grad=False) if options.expert_bias else None
        self.expert_start = 0  # global id of w13[0] (expert parallelism holds a range)
        self.reduce: Communicator | None = None  # completes a rank's partial sums (tensor or expert parallel)
        self.experts: RoutedExperts = GroupedExperts()  # the after-load pass sets this device's (experts_for)

    def set_experts(self, experts: RoutedExperts) -> None:
        """Process the loaded weights for ``experts`` and run through it from now on (once)."""
        experts.process_weights_after_loading(self)
        self.experts = experts

    @property
    def plain(self) -> bool:
        """silu(gate) * up with no biases: what the compiled and Triton strategies run (``PackedExperts`` runs the
        other kind one expert at a time)."""
        return self.b13 is None and self.swiglu_limit is None

    def bias13(self, e: int) -> torch.Tensor | None:
        return None if self.b13 is None else self.b13[e]

    def bias2(self, e: int) -> torch.Tensor | None:
        return None if self.b2 is None else self.b2[e]

    def activate(self, h: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        """h ``[n, 2 * inter]`` (gate columns, then up) -> ``[n, inter]``: silu(gate) * up, or gpt-oss's clamped
        SwiGLU (transformers' ``GptOssExperts._apply_gate``)."""
        if self.swiglu_limit is None:
            return ops.silu_mul(h)
        gate, up = h.split(self.intermediate_size, dim=-1)
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def drop_float_weights(self) -> None:
        """For strategies: ``w13`` / ``w2`` as loaded are no longer held (their own buffers replace them)."""
        del self._parameters["w13"], self._parameters["w2"]

    @property
    def num_local_experts(self) -> int:
        held = self._parameters.get("w13")
        if held is not None:
            return int(held.shape[0])
        return int(self.get_buffer("w13_panels" if "w13_panels" in self._buffers else "q13").shape[0])

    def forward(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.topk_first)
        out = self.experts.apply(self, x, ids, weights, ops)
        return out if self.reduce is None else self.reduce.all_reduce_(out)

    def extra_repr(self) -> str:
        held = (f"experts [{self.expert_start}, {self.expert_start + self.num_local_experts}) of {self.num_experts}"
                if self.num_local_experts != self.num_experts else f"{self.num_experts} experts")
        return f"{held}, top_k={self.top_k}, inter={self.intermediate_size}, {self.experts.name}"

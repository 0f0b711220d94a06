"""``Linear``: every projection of a model, holding a per-layer ``LinearMethod`` (vLLM's ``LinearMethodBase``).

A layer is built and loaded in floats (``weight`` ``[out_features, in_features]``, optional ``bias``); the
tensor-parallel split (common/parallel/tp_model.py) slices those floats. Then, once, the loader's after-load
pass (common/model/prepare.py) asks the registry (``select_method``) for the method that runs this layer's
weight format on this device and CPU, and the method's ``process_weights_after_loading`` replaces the float
weight with what its kernel reads (16-row panels, packed int4 / int8, tinygemm's layout, ...) as buffers on
the layer, so ``model.buffers()`` counts the real bytes. From then on ``forward`` is ``method.apply``.

The class of a layer never changes and no other module reads a method's private state: the one-call CPU
decode step (common/model/decode_step.py) asks each method for its public ``step_weights``, and a tied
token lookup (``TiedEmbedding``) for its ``rows``.

Methods (``name``: where):
- float: ``torch`` (``F.linear``; row-bucketed for 16-bit activations on CPU): here; ``gemv`` (Tandem's GEMV
  at decode sizes, then ``F.linear``), ``panels`` (16-row panels): common/model/gemv.py.
- packed: ``tandem_a8``, ``tandem_cpu``, ``torch`` (CPU ops): common/quant/cpu_linear.py; ``int_mm``
  (W8A8): common/quant/w8a8_linear.py; ``triton``, ``torch`` (tinygemm), ``scaled_mm``:
  common/quant/gpu_linear.py; ``reference`` (any format, any device): common/quant/linear.py.
Adding one is a class there and a line in ``common/quant/registry.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from common.model.row_buckets import linear_bucketed

if TYPE_CHECKING:
    from common.quant.formats import QuantizedWeight


@dataclass(frozen=True)
class StepWeights:
    """What the one-call CPU decode step (``cpu_step.cpp``) reads of a projection: three tensors (weights,
    scales, zeros; empty where unused), the kernel kind (32: fp32 panels, 33: row-major fp32, 16: bf16 panels,
    8: int8 panels, 4: int4 panels) and its group (the input width for float weights), the most rows for which
    the layer's own ``forward`` runs the same loop (beyond it, other sums), and the rows from which it multiplies
    bf16 rows in AMX tiles (``NO_AMX``: never)."""

    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    kind: int
    group: int
    max_rows: int
    amx_min_rows: int


class LinearMethod(ABC):
    """How one layer holds its weight and multiplies by it. One instance per layer (it may keep per-layer
    kernel choices); the tensors themselves are the layer's buffers or parameters."""

    name: ClassVar[str]
    format = "float"  # float | int8 | int4 | fp8: the weight format it runs (packed methods: set at processing)

    def process_weights_after_loading(self, layer: Linear, packed: QuantizedWeight | None) -> None:  # noqa: B027
        """Turn the loaded layer into this method's layout. ``packed``: the quantized weight for packed
        methods (from GGUF blocks as published, or quantized at load); None for float methods, which
        start from ``layer.weight``."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x: ``[M, in_features]`` -> ``[M, out_features]`` in x's dtype (fp32 with ``layer.float_out``),
        the layer's bias added."""

    def refresh(self, layer: Linear) -> None:  # noqa: B027 - most methods cache nothing
        """The layer's tensors were moved or replaced (``model.to``): rebuild any cached references."""

    def step_weights(self, layer: Linear, dtype: torch.dtype) -> StepWeights | None:
        """This layer in the one-call CPU decode step with ``dtype`` activations, or None (it cannot run there)."""
        return None

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` of the weight, ``[n, in_features]`` exactly as stored (a tied token lookup reading
        the head's matrix), or None where this method cannot give them as they are."""
        return None

    @property
    def group_size(self) -> int | None:
        """Input weights per scale (packed formats); None for floats."""
        return None

    def describe(self) -> str:
        return self.name


class TorchMethod(LinearMethod):
    """Float weights through ``F.linear`` (any device). ``bucketed``: the rows padded to a few buckets
    (common/model/row_buckets.py: oneDNN's per-shape kernels for 16-bit activations on CPU)."""

    name = "torch"

    def __init__(self, bucketed: bool = False) -> None:
        self.bucketed = bucketed

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.bucketed:
            return linear_bucketed(x, layer.weight, layer.bias)
        return nn.functional.linear(x, layer.weight, layer.bias)

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor | None:
        return layer.weight[ids]

    def describe(self) -> str:
        return f"{self.name}, row buckets" if self.bucketed else self.name


class Linear(nn.Module):
    """``y = x W^T + b`` through the layer's method. ``float_out``: fp32 outputs whatever x's dtype (an LM
    head: logits go to sampling in fp32 with no rounding to 16 bits on the way, where the method can)."""

    weight: nn.Parameter  # the float weight until a method replaces it with its own buffers

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None)
        self.float_out = False
        self.method: LinearMethod = TorchMethod()  # as loaded: F.linear
        self.prepared = False  # set_method ran: the weight may no longer be the float one as loaded

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A layer over ``weight`` [out, in] and ``bias`` [out] as they are (no copy: a Parameter passed in is
        shared, e.g. a tied embedding's)."""
        layer = cls(1, 1, bias=False, device="meta")  # placeholder shapes, then the real tensors
        layer.out_features, layer.in_features = weight.shape
        layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        return layer

    def set_method(self, method: LinearMethod, packed: QuantizedWeight | None = None) -> None:
        """Process the loaded weight for ``method`` and run through it from now on (once per layer)."""
        method.process_weights_after_loading(self, packed)
        self.method = method
        self.prepared = True

    def drop_weight(self) -> None:
        """For methods: the float weight is no longer held (their own buffers replace it)."""
        del self._parameters["weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's flat [tokens, features]: no reshapes (a decode step makes ~120 calls)
            return self.method.apply(self, x)
        y = self.method.apply(self, x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> Linear:  # type: ignore[override]
        super()._apply(fn, recurse)
        self.method.refresh(self)
        return self

    @property
    def format(self) -> str:
        return self.method.format

    @property
    def group_size(self) -> int | None:
        return self.method.group_size

    @property
    def weight_bytes(self) -> int:
        """Bytes this layer holds: its parameters and buffers (packed weights are buffers)."""
        return (sum(p.nbytes for p in self.parameters(recurse=False))
                + sum(b.nbytes for b in self.buffers(recurse=False)))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.describe()}")


class TiedEmbedding(nn.Module):
    """A tied model's token lookup reading its LM head's rows through the head's method (16-row float
    panels, or GGUF Q8_0 rows as published): one copy of the largest matrix serves both ends.

    ``forward(ids [n]) -> [n, hidden]`` in ``dtype``. The head is shared, not a submodule (it is the model's
    ``lm_head``; registering it twice would rename it in ``named_modules``)."""

    def __init__(self, head: Linear, dtype: torch.dtype) -> None:
        super().__init__()
        if head.method.rows(head, torch.zeros(1, dtype=torch.long, device=_device(head))) is None:
            raise ValueError(f"the LM head's method ({head.method.describe()}) cannot give its rows to a lookup")
        self._head = (head,)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        rows = head.method.rows(head, ids)
        assert rows is not None  # checked at construction
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the LM head ({self._head[0].method.describe()})"


def _device(layer: nn.Module) -> torch.device:
    for t in (*layer.parameters(recurse=False), *layer.buffers(recurse=False)):
        return t.device
    return torch.device("cpu")

"""The bf16 GEMM race of common/model/gemv.py (panels in AMX tiles vs oneDNN on a prepacked copy) four times in
one process, its timings printed (session 33).

    python race.py CHECKOUT
"""

import sys

sys.path.insert(0, sys.argv[1])
import torch

from common.kernels.cpu import cpu_kernels
from common.model import gemv

found = cpu_kernels()
assert found is not None
ops = found
amx_rows = gemv._amx_min_rows(ops)


def panels(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = ops.dense_matmul_panel(x, p, amx_rows, False)
    return out


def race(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
    timed = getattr(gemv, "_race", None) or gemv.start_races.race  # session 33's checkout, or a later one
    return timed(torch.bfloat16, probes, gemv.pack_panels, panels, versus=(gemv.onednn_pack, gemv.onednn_linear))


for i in range(4):
    t = race(gemv.AMX_ONEDNN_PROBES)
    print(i, " ".join(f"{m}:{a * 1e3:.2f}/{b * 1e3:.2f}" for m, (a, b) in sorted(t.items())), flush=True)

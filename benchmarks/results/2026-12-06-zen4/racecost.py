"""How long a fresh process's panel-limit races take (fp32, bf16) and what they read, one thread (session 34).

    python racecost.py CHECKOUT
"""

import sys
import time

sys.path.insert(0, sys.argv[1])
import torch

from common.kernels.cpu import cpu_kernels
from common.model import gemv

torch.set_num_threads(1)
found = cpu_kernels()
assert found is not None
for dtype in (torch.float32, torch.bfloat16):
    gemv._limits.clear()
    start = time.perf_counter()
    limit = gemv._panel_max_rows(found, dtype)
    print(dtype, "limit", limit if limit < gemv.NO_AMX else "any", f"{time.perf_counter() - start:.2f} s")

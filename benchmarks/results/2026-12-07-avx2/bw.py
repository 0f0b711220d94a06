"""Sequential read bandwidth on two threads (session 36): torch's sum over 1 GiB of fp32, median and best of 7.

    taskset -c 0,1 python bw.py
"""

import time

import torch

torch.set_num_threads(2)
x = torch.randn(256 * 1024 * 1024)  # 1 GiB
times = []
for _ in range(7):
    start = time.perf_counter()
    x.sum()
    times.append(time.perf_counter() - start)
times.sort()
print(f"sequential read, 2 threads: median {x.numel() * 4 / times[3] / 1e9:.1f} GB/s, "
      f"best {x.numel() * 4 / times[0] / 1e9:.1f}")

"""glibc's malloc set for a CPU engine's steps: freed activation buffers stay in the heap for the next step.

A prefill step allocates and frees tens of megabytes of activations per layer (a 2,048-row step's gate/up output
alone is 12 MB in bf16). glibc serves blocks above its mmap threshold (dynamic, at most 32 MB) with fresh
``mmap`` calls and returns freed heap top above its trim threshold (twice that) to the kernel, so every step
faulted its buffers in again, page by page: measured (session 30, 2 Xeon cores, SmolLM2 bf16, 48 x 384-token
prompts) 620,000-810,000 minor page faults and ~1 s of system time a run of 3.3-3.5 s; with the thresholds
raised, 0-1,200 faults, no system time, 2.7-2.8 s. vLLM's CPU images preload tcmalloc for the same reason.

``TANDEM_CPU_MALLOC`` (auto: where glibc's ``mallopt`` exists; on: that, or a start-up error; off: glibc's
defaults). The cost: the heap keeps the largest step's buffers (the process's peak stays resident).

``huge_pages``: a large buffer every step reads all over (the KV cache) asked to be backed by transparent huge
pages (``madvise(MADV_HUGEPAGE)``, for kernels whose THP mode is ``madvise``, as Debian's and Ubuntu's are):
a decode step reads each sequence's blocks, scattered over the cache, and with 4 KB pages nearly every block
costs a TLB miss. 48 sequences x 484 tokens of SmolLM2's KV (535 MB), decode attention over 30 layers, 2 Xeon
threads: 29.1-29.9 -> 27.7-27.9 ms (session 31).
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

from common.config.settings import kernel_setting

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 << 20

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap (the KV cache and weights above it keep mmap)
TRIM_THRESHOLD = 1 << 30  # free heap top kept before it is returned to the kernel

_applied: bool | None = None


def keep_step_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds once per process (see the module docstring); True when set."""
    global _applied
    mode = kernel_setting("cpu_malloc")
    if mode == "off":
        return False
    if _applied is None:
        try:
            mallopt = ctypes.CDLL(None).mallopt
            _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                       TRIM_THRESHOLD))
        except (OSError, AttributeError):
            _applied = False
        if not _applied:
            log.info("malloc thresholds left as they are: this C library has no glibc mallopt")
    if mode == "on" and not _applied:
        raise RuntimeError("TANDEM_CPU_MALLOC=on, but this C library has no glibc mallopt to keep step buffers")
    return _applied


def huge_pages(tensor: torch.Tensor) -> int:
    """Ask Linux to back ``tensor``'s memory (its whole 2 MB pages) with transparent huge pages; call it before
    the memory is first written (later, only khugepaged would merge the pages). Returns the bytes advised: 0
    where the tensor is smaller than a huge page, not in host memory, or the call is refused (no THP, not
    Linux). Only advice: the contents and the tensor stay as they are."""
    if tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(first, last - first, MADV_HUGEPAGE) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return last - first

"""glibc malloc kept from faulting a CPU step's activations in again (common/kernels/host_malloc.py). Each probe runs
in a fresh interpreter: the thresholds are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A step's 40 MB buffer (a larger model's gate/up output; above glibc's largest dynamic mmap threshold, 32 MB):
# where glibc put it (mallinfo2's mmapped bytes while it lives) and what the heap kept after it was freed.
PROBE = """
import ctypes, json, sys, torch
sys.path.insert(0, {repo!r})
from common.kernels.host_malloc import keep_step_buffers
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
applied = keep_step_buffers()
base = libc.mallinfo2().hblkhd
buf = torch.ones(2048, 10240, dtype=torch.bfloat16)
mmapped = libc.mallinfo2().hblkhd - base
del buf
print(json.dumps({{"applied": applied, "mmapped": mmapped, "heap_kept": libc.mallinfo2().fordblks}}))
"""
BUFFER = 2048 * 10240 * 2


def _probe(mode: str) -> dict[str, int]:
    env = {**os.environ, "TANDEM_CPU_MALLOC": mode}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO))], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    result: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="glibc's mallopt and mallinfo2")
def test_a_steps_buffer_comes_from_the_heap_and_stays_there_only_when_set() -> None:
    kept = _probe("auto")
    assert kept["applied"]
    assert kept["mmapped"] < BUFFER  # from the heap, not a fresh mapping faulted in page by page
    assert kept["heap_kept"] >= BUFFER  # freed, and kept for the next step rather than trimmed
    default = _probe("off")
    assert not default["applied"]
    assert default["mmapped"] >= BUFFER  # glibc's defaults: mapped for this step, unmapped when freed


def test_a_mode_that_is_not_a_choice_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.kernels.host_malloc import keep_step_buffers

    monkeypatch.setenv("TANDEM_CPU_MALLOC", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_MALLOC"):
        keep_step_buffers()


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "none"


def _advised_bytes(start: int, size: int) -> int:
    """Bytes of [start, start + size) in this process's mappings marked for huge pages (VmFlags ``hg``). Whether
    the kernel then backs them with huge pages depends on its free contiguous memory at the fault (under load or
    fragmentation it falls back to 4 KB pages), so the advice is what a test can hold to."""
    total, span = 0, (0, 0)
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and len(parts) > 4:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            span = (max(lo, start), min(hi, start + size))
        elif parts[0] == "VmFlags:" and "hg" in parts[1:] and span[1] > span[0]:
            total += span[1] - span[0]
    return total


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages off on this kernel")
def test_a_cpu_kv_cache_is_advised_onto_huge_pages_and_starts_zeroed() -> None:
    import torch

    from common.kernels.host_malloc import HUGE_PAGE, huge_pages
    from common.kv.kv_cache import KVCache, KVCacheSpec

    cache = KVCache(KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype_name="float32"), 512)
    size = cache.data.numel() * cache.data.element_size()  # 32 MiB
    assert _advised_bytes(cache.data.data_ptr(), size) >= size - 2 * HUGE_PAGE
    assert not cache.data.any()
    assert huge_pages(torch.empty(1000)) == 0  # below one huge page: nothing to advise

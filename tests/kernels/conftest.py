"""Kernel tests: Triton runs under its CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when ``triton.jit`` decorates a kernel, i.e. when
``common.kernels.triton.attention`` is first imported, so it is set here, before any test module
of this directory is imported. On a CUDA machine the kernels are compiled for real instead.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

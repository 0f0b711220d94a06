"""Quantized weights beside the model (docs/quantization.md): formats and their reference math, GGUF blocks,
the packed ``LinearMethod`` implementations per device, the method registry, and which weights a
quantization packs (``quantizer``)."""

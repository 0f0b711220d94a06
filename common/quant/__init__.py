"""Quantized weights beside the model (docs/quantization.md): formats and their reference math, GGUF blocks,
``QuantizedLinear`` implementations per device, the kernel registry, and the loader's module swap."""

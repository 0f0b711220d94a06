"""Benchmarks: python -m benchmarks.<name>; numbers are measured, never asserted in tests."""

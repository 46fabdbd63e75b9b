"""Benchmarks: models, emulated links, and the measurements users compare with."""

"""Benchmarks (GPU): ``python -m reference_impl.bench.compute --out FILE.json``."""

"""Benchmarks: every op registers its spec shapes in :mod:`benchmarks.registry`; run with ``python -m benchmarks.run``."""

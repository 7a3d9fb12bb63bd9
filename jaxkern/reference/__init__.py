"""Plain ``jnp`` references, one per op: readable, and the source of truth in tests."""

from jaxkern.reference import engram, gemm, ieee, mhc, moe, quant, transpose

__all__ = ["engram", "gemm", "ieee", "mhc", "moe", "quant", "transpose"]

"""Plain ``jnp`` references, one per op: readable, and the source of truth in tests."""

from jaxkern.reference import engram, ieee, mhc, moe, quant, transpose

__all__ = ["engram", "ieee", "mhc", "moe", "quant", "transpose"]

"""Plain ``jnp`` references, one per op: readable, and the source of truth in tests."""

from jaxkern.reference import ieee, moe, quant, transpose

__all__ = ["ieee", "moe", "quant", "transpose"]

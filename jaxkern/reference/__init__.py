"""Plain ``jnp`` references, one per op: readable, and the source of truth in tests."""

from jaxkern.reference import quant, transpose

__all__ = ["quant", "transpose"]

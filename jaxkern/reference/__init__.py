"""Plain ``jnp`` references, one per op: readable, and the source of truth in tests."""

from jaxkern.reference import moe, transpose

__all__ = ["moe", "transpose"]

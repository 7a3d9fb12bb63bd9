"""Plain ``jnp`` references, one per op: readable, and the source of truth in tests."""

from jaxkern.reference import moe, moe_routing, quant, transpose

__all__ = ["moe", "moe_routing", "quant", "transpose"]

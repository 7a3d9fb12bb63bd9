"""Plain ``jnp`` references, one per op: readable, and the source of truth in tests."""

from jaxkern.reference import ieee, moe, moe_routing, quant, transpose

__all__ = ["ieee", "moe", "moe_routing", "quant", "transpose"]

"""Engram (docs/engram.md): the n-gram hash and the fused RMSNorm sigmoid gate, forward and backward.

The trainable gate is :func:`jaxkern.modeling.engram_gate` (a ``jax.custom_vjp`` over these ops).
"""

from jaxkern.engram._gate import engram_gate_bwd, engram_gate_fwd
from jaxkern.engram._hash import engram_hash, make_offsets, split_multipliers
from jaxkern.engram._weights import fused_weight, grad_w_reduce

__all__ = [
    "engram_gate_bwd",
    "engram_gate_fwd",
    "engram_hash",
    "fused_weight",
    "grad_w_reduce",
    "make_offsets",
    "split_multipliers",
]

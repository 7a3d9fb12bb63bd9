"""Correctly rounded float32 division for the ``jnp`` references, on every backend.

XLA's float32 ``/`` is approximate on GPU, and XLA rewrites a division by a constant or a
broadcast divisor into a reciprocal multiply on every backend, so the references divide in
float64 and round with a midpoint test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def div(a, b):
  """IEEE ``a / b`` in float32 (round to nearest even) for float32 operands; broadcasts."""
  with jax.enable_x64(True):
    a, b = (jnp.asarray(v, jnp.float32).astype(jnp.float64) for v in (a, b))
    return round_quotient(a / b, a, b)


def round_quotient(q, a, b):
  """float32 ``RN(a / b)`` from a float64 quotient ``q`` of widened float32 ``a``, ``b``.

  ``q`` may be off by a few float64 ulps: its float32 rounding ``q32`` can then only be wrong
  when the true quotient lies beyond the midpoint ``m`` between ``q32`` and its neighbour on
  ``q``'s side; the sign of ``a - m*b`` (exact: ``m*b`` has at most 49 significant bits)
  decides, and an exact tie goes to the even neighbour. Call under ``jax.enable_x64``.
  """
  q32 = q.astype(jnp.float32)
  up = q >= q32.astype(jnp.float64)
  other = jnp.nextafter(q32, jnp.where(up, jnp.float32(jnp.inf), jnp.float32(-jnp.inf)))
  mid = (q32.astype(jnp.float64) + other.astype(jnp.float64)) / 2
  rem = a - mid * b
  beyond = jnp.where(up, rem * b > 0, rem * b < 0)
  odd = (lax.bitcast_convert_type(q32, jnp.int32) & 1) == 1
  take_other = (beyond | ((rem == 0) & odd)) & jnp.isfinite(mid) & (q32 != other)
  return jnp.where(take_other, other, q32)

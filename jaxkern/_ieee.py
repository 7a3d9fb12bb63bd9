"""Correctly rounded float32 division and square root from integer arithmetic.

XLA's float32 ``/`` and ``sqrt`` are not correctly rounded on GPU, and XLA rewrites a
division by a broadcast or constant divisor into a reciprocal multiply on every
backend (spec moe_transpose.md §8). These helpers take the backend's approximate
result ``q`` and correct it: ``q`` is moved to a neighbour while the exact value lies
beyond the midpoint between them. The midpoint test compares ``a`` with
``midpoint * b`` (or ``x`` with ``midpoint ** 2``) exactly, using 12-bit limb products
in int32, so the result is IEEE round-to-nearest-even on every backend. Two
correction rounds fix any seed within two ulps. Operands: ``a >= 0``, ``b > 0``,
``x >= 0`` (the gating ops' domain); ``b = inf`` gives 0. Subnormal operands and results
are outside the exact domain: XLA flushes them to zero on CPU and GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Non-negative finite float32 -> (significand, exponent) with ``x = sig * 2**exp``."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  e = (bits >> 23) & 0xFF
  m = bits & 0x7FFFFF
  return jnp.where(e > 0, m | 0x800000, m), jnp.maximum(e, 1) - 150


def _mul(m: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``m * b = hi * 2**24 + lo`` exactly, for ``0 <= m, b < 2**25``."""
  m1, m0 = m >> 12, m & 0xFFF
  b1, b0 = b >> 12, b & 0xFFF
  cross = m1 * b0 + m0 * b1
  lo = m0 * b0 + ((cross & 0xFFF) << 12)
  return m1 * b1 + (cross >> 12) + (lo >> 24), lo & 0xFFFFFF


def _compare(a: jax.Array, s: jax.Array, hi: jax.Array, lo: jax.Array) -> jax.Array:
  """Sign of ``a * 2**s - (hi * 2**24 + lo)`` for ``2**23 <= a < 2**24`` and a right side < 2**51."""
  sp = jnp.clip(s, 0, 27)
  a_hi = jnp.where(sp >= 24, a << jnp.maximum(sp - 24, 0), a >> jnp.maximum(24 - sp, 0))
  a_lo = jnp.where(sp >= 24, 0, (a << sp) & 0xFFFFFF)
  pos = jnp.where(a_hi != hi, jnp.sign(a_hi - hi), jnp.sign(a_lo - lo))
  sn = jnp.clip(-s, 0, 24)
  a_int = a >> sn
  frac = (a & ((1 << sn) - 1)) != 0
  neg = jnp.where(hi > 0, -1, jnp.where(a_int != lo, jnp.sign(a_int - lo), frac.astype(jnp.int32)))
  return jnp.where(s >= 28, 1, jnp.where(s < -24, -1, jnp.where(s >= 0, pos, neg)))


def _round(q: jax.Array, above_midpoint) -> jax.Array:
  """Moves ``q >= 0`` to its correctly rounded neighbour; ``above_midpoint(lo)`` is the sign of
  (exact value - midpoint of ``lo`` and its successor)."""
  for _ in range(2):
    bits = lax.bitcast_convert_type(q, jnp.int32)
    c = above_midpoint(q)
    up = lax.bitcast_convert_type(bits + 1, jnp.float32)
    q = jnp.where((c > 0) | (c == 0) & ((bits & 1) == 1), up, q)
    bits = lax.bitcast_convert_type(q, jnp.int32)
    down = lax.bitcast_convert_type(jnp.maximum(bits - 1, 0), jnp.float32)
    c = above_midpoint(down)
    q = jnp.where((bits > 0) & ((c < 0) | (c == 0) & ((bits & 1) == 1)), down, q)
  return q


def _midpoint(lo: jax.Array) -> tuple[jax.Array, jax.Array]:
  sig, exp = _split(lo)
  return 2 * sig + 1, exp - 1


def div(a: jax.Array, b: jax.Array) -> jax.Array:
  """IEEE float32 ``a / b`` (round to nearest even) for ``a >= 0``, ``b > 0``."""
  a, b = jnp.broadcast_arrays(a, b)
  q = lax.optimization_barrier(a) / lax.optimization_barrier(b)
  q = jnp.where(jnp.isfinite(q), q, 0.0)
  sa, ea = _split(a)
  sb, eb = _split(jnp.where(jnp.isinf(b), 1.0, b))

  def above(lo):
    m, em = _midpoint(lo)
    hi, lo_ = _mul(m, sb)
    return _compare(sa, ea - em - eb, hi, lo_)

  return jnp.where((a == 0) | jnp.isinf(b), 0.0, _round(q, above))


def sqrt(x: jax.Array) -> jax.Array:
  """IEEE float32 ``sqrt(x)`` for finite ``x >= 0``."""
  q = jnp.sqrt(lax.optimization_barrier(x))
  sx, ex = _split(x)

  def above(lo):
    m, em = _midpoint(lo)
    hi, lo_ = _mul(m, m)
    return _compare(sx, ex - 2 * em, hi, lo_)

  return jnp.where(x == 0, 0.0, _round(q, above))

"""Correctly rounded float32 division and square root for the ``jnp`` references, on every backend.

XLA's float32 ``/`` and ``sqrt`` are approximate on GPU, and XLA rewrites a division by a constant or
a broadcast divisor into a reciprocal multiply on every backend, so the references compute in
float64 and round to float32 with an exact midpoint test. Independent of the kernels' helpers
(:mod:`jaxkern._ieee`), which this module serves as the oracle for.

Also the single-rounding fused multiply-add :func:`fma` (XLA never contracts ``a*b + c`` on GPU and always
does on CPU, so the references spell the FMA out where the ops' definitions ask for one).

All are differentiable (``jax.custom_jvp``) with the derivatives of ``a / b``, ``sqrt(x)`` and ``a*b + c``:
the rounding steps in between would otherwise give a zero derivative whenever they pick a neighbour.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


@jax.custom_jvp
def div(a: jax.Array, b: jax.Array):
  """IEEE ``a / b`` in float32 (round to nearest even) for float32 operands; broadcasts."""
  with jax.enable_x64(True):
    a, b = (jnp.asarray(v, jnp.float32).astype(jnp.float64) for v in (a, b))
    return round_quotient(a / b, a, b)


@div.defjvp
def _div_jvp(primals, tangents):
  (a, b), (da, db) = primals, tangents
  q = div(a, b)
  b = jnp.asarray(b, jnp.float32)
  return q, (jnp.asarray(da, jnp.float32) - q * jnp.asarray(db, jnp.float32)) / b


@jax.custom_jvp
def sqrt(x: jax.Array):
  """IEEE ``sqrt(x)`` in float32 for float32 ``x >= 0`` (round to nearest even)."""
  with jax.enable_x64(True):
    x = jnp.asarray(x, jnp.float32).astype(jnp.float64)
    r = jnp.sqrt(x)
    r32 = r.astype(jnp.float32)
    up = r >= r32.astype(jnp.float64)
    other = _neighbour(r32, up)
    mid = (r32.astype(jnp.float64) + other.astype(jnp.float64)) / 2
    rem = x - mid * mid  # exact: mid has at most 25 significant bits
    beyond = jnp.where(up, rem > 0, rem < 0)
    return _pick(r32, other, beyond, rem == 0, mid)


@sqrt.defjvp
def _sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  r = sqrt(x)
  return r, jnp.asarray(dx, jnp.float32) / (2 * r)


def round_quotient(q: jax.Array, a: jax.Array, b: jax.Array):
  """float32 ``RN(a / b)`` from a float64 quotient ``q`` of widened float32 ``a``, ``b``.

  ``q`` may be off by a few float64 ulps: its float32 rounding ``q32`` can then only be wrong
  when the true quotient lies beyond the midpoint ``m`` between ``q32`` and its neighbour on
  ``q``'s side; the sign of ``a - m*b`` (exact: ``m*b`` has at most 49 significant bits)
  decides, and an exact tie goes to the even neighbour. Call under ``jax.enable_x64``.
  """
  q32 = q.astype(jnp.float32)
  up = q >= q32.astype(jnp.float64)
  other = _neighbour(q32, up)
  mid = (q32.astype(jnp.float64) + other.astype(jnp.float64)) / 2
  rem = a - mid * b
  beyond = jnp.where(up, rem * b > 0, rem * b < 0)
  return _pick(q32, other, beyond, rem == 0, mid)


def _neighbour(v, up):
  """The float32 next to ``v`` towards +inf (``up``) or -inf, by stepping the bit pattern."""
  bits = lax.bitcast_convert_type(v, jnp.int32)
  away = up == (bits >= 0)  # moving away from zero increments the magnitude
  stepped = jnp.where(v == 0, jnp.where(up, 1, -2**31 + 1), bits + jnp.where(away, 1, -1))
  return lax.bitcast_convert_type(stepped.astype(jnp.int32), jnp.float32)


def _pick(v, other, beyond, tie, mid):
  odd = (lax.bitcast_convert_type(v, jnp.int32) & 1) == 1
  take_other = (beyond | (tie & odd)) & jnp.isfinite(mid) & jnp.isfinite(v) & (v != other)
  return jnp.where(take_other, other, v)


@jax.custom_jvp
def fma(a: jax.Array, b: jax.Array, c: jax.Array):
  """Single-rounding float32 ``a*b + c``, exact on every backend.

  The product of two float32 values is exact in float64; the float64 sum is made
  round-to-odd (TwoSum error term, then nudge an even result one ulp towards the
  error), which makes the final float64 -> float32 rounding correct. Its derivative
  (``jax.custom_jvp``) is that of ``a*b + c``: the nudge step alone would have none.
  """
  with jax.enable_x64(True):
    a, b, c = (jnp.asarray(v, jnp.float32).astype(jnp.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    bits = lax.bitcast_convert_type(s, jnp.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0) & jnp.isfinite(err)
    step = jnp.where((err > 0) == (s > 0), 1, -1).astype(jnp.int64)
    s = jnp.where(inexact_even, lax.bitcast_convert_type(bits + step, jnp.float64), s)
    return s.astype(jnp.float32)


@fma.defjvp
def _fma_jvp(primals, tangents):
  a, b, c = (jnp.asarray(v, jnp.float32) for v in primals)
  da, db, dc = (jnp.asarray(v, jnp.float32) for v in tangents)
  return fma(a, b, c), da * b + a * db + dc

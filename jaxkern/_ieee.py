"""Correctly rounded float32 arithmetic for the kernels and their XLA paths: the one home of these helpers.

XLA's float32 ``/`` and ``sqrt`` are not correctly rounded on GPU, XLA rewrites a division by a
broadcast or constant divisor into a reciprocal multiply on every backend (docs/usage.md, "Numerics in XLA"),
and a kernel's ``/`` is approximate on the GPU. Three families, one per place the arithmetic runs:

* XLA code and interpret mode (:func:`div`, :func:`sqrt`): the backend's approximate result ``q`` is
  moved to a neighbour while the exact value lies beyond the midpoint between them. The midpoint test
  compares ``a`` with ``midpoint * b`` (or ``x`` with ``midpoint ** 2``) exactly, using 12-bit limb
  products in int32, so the result is IEEE round-to-nearest-even on every backend. Two correction
  rounds fix any seed within two ulps. Operands: ``a >= 0``, ``b > 0``, ``x >= 0`` (the gating ops'
  domain); ``b = inf`` gives 0. Subnormal operands and results are outside the exact domain: XLA
  flushes them to zero on CPU and GPU.
* Mosaic GPU kernels (:func:`exact_div`, :func:`refine_quotient`, :func:`div_by_reciprocal`):
  candidates around a first quotient scored by an FMA residual.
* Pallas-Triton kernels (:func:`triton_div`, :func:`triton_sqrt`): the PTX ``div.rn`` / ``sqrt.rn``
  instructions through inline assembly; in interpret mode (no PTX) :func:`div` / :func:`sqrt`.
* Compiled Mosaic GPU kernels may instead apply a correctly rounded PTX instruction (``div.rn.f32``,
  ``rcp.rn.f32``) elementwise through inline Mosaic GPU code (:func:`mosaic_ptx`); interpret mode has no PTX
  and uses the candidates above, which give the same bits.

The ``jnp`` references do not use this module: :mod:`jaxkern.reference.ieee` divides on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt


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


def exact_div(a, b):
  """Correctly rounded float32 ``a / b`` (round to nearest even) inside a Mosaic GPU kernel.

  ``a / b`` in a kernel is an approximate division on the GPU (bitwise IEEE on ~71% of inputs,
  measured on the H200) and may become a reciprocal multiply in interpret mode. Starting from that
  first quotient ``q0``, the candidates ``q0 ± k`` ulp (``k ≤ 2``, stepped through the bit pattern,
  sign-aware) are scored by the residual ``q·b − a``, written as a multiply-add that Mosaic GPU and
  XLA on CPU contract into one FMA (measured): for a near-correct ``q`` the FMA residual is exact, so
  the candidate with the smallest ``|q·b − a|`` is the correctly rounded quotient; an exact tie goes
  to the even significand.

  Assumptions: finite, nonzero operands; ``q0`` within 2 ulp of the true quotient; a normal float32
  quotient (no overflow or underflow); the FMA contraction; ``|a| < 2^-60`` only with ``|a / b| < 2^64``
  (then the residuals are scored on ``a·2^64``, so that flushing subnormals cannot create false ties:
  e.g. the e2m1 clamp minimum ``6·2^-126 / 6``). The scale-factor divisions
  (``a / 448``, ``448 / a`` with ``a`` at least the amax clamp, ``1 / sf``) satisfy them.
  ``a`` may be a Python float; ``b`` must not be a constant in interpret mode, where XLA folds
  ``(a·(1/c))·c`` into ``a`` (the kernels load the divisor 448 from memory).
  """
  return refine_quotient(a / b, a, b)


def newton_div(a, b):
  """Correctly rounded float32 ``a / b`` inside a Mosaic GPU kernel for a divisor ``b >= 1`` (``+inf``
  included), with about a third of :func:`exact_div`'s operations: the SwiGLU kernels divide every element
  by ``1 + exp(-x)`` and are arithmetic-bound.

  ``y = 1 / b`` (the GPU's approximate division) seeds ``q = a·y`` and one Newton step
  ``q + (a - q·b)·y``, which leaves ``q`` within an ulp of ``a / b``; the residuals ``a - q·b`` of ``q`` and
  of its neighbour towards ``a / b`` (FMA-contracted multiply-adds, exact, as in :func:`exact_div`) pick
  the correctly rounded one (a quotient of two float32 values is never exactly halfway between two
  float32 values unless it is exact). Divisors above ``2^64`` are scaled by ``2^-64`` together with ``a``
  (exact for ``|a| >= 2^-60``), so that ``y`` stays normal; ``a = ±0`` and ``b = inf`` give ``a·0`` (a
  signed zero).

  Assumptions: ``b >= 1`` or ``+inf``; ``a`` finite with ``|a| >= 2^-100`` (the residuals stay normal),
  zero, or any ``a`` when ``b`` is a power of two (then ``q = a·y`` is exact); a normal quotient. SwiGLU's
  ``x / (1 + exp(-x))`` satisfies them: ``1 + exp(-x)`` rounds to exactly 2 for ``|x| < 2^-24``.
  """
  big = b > 2.0**64
  s = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
  a, bs = a * s, b * s
  y = 1.0 / bs
  q = a * y
  q = q + (a - q * bs) * y
  r = a - q * bs
  u = lax.bitcast_convert_type(q, jnp.int32)
  cand = lax.bitcast_convert_type(u + jnp.where((r > 0) != (a < 0), 1, -1), jnp.float32)
  q = jnp.where(jnp.abs(a - cand * bs) < jnp.abs(r), cand, q)
  return jnp.where((bs == jnp.inf) | (a == 0), a * 0.0, q)


def refine_quotient(q0, a, b):
  """The correctly rounded ``a / b`` from a float32 quotient ``q0`` within 2 ulp of it (see
  :func:`exact_div`)."""
  # For a tiny |a| the residuals are subnormal and may be flushed to zero (XLA on CPU does), which
  # would make wrong candidates tie with the right one: score them on a and q scaled by 2^64 (exact).
  s = 1.0 if isinstance(a, float) else jnp.where(jnp.abs(a) < 2.0**-60, jnp.float32(2.0**64), jnp.float32(1.0))
  a_s = a * s
  u = lax.bitcast_convert_type(q0, jnp.int32)
  sign = u & jnp.int32(-2**31)
  mag = u & 0x7FFFFFFF
  best, best_r = q0, jnp.abs((q0 * s) * b - a_s)
  for k in (-1, 1, -2, 2):
    qk = lax.bitcast_convert_type(sign | (mag + k), jnp.float32)
    rk = jnp.abs((qk * s) * b - a_s)
    take = (rk < best_r) | ((rk == best_r) & (((mag + k) & 1) == 0))
    best, best_r = jnp.where(take, qk, best), jnp.where(take, rk, best_r)
  return best


def div_by_reciprocal(c, d, y):
  """Correctly rounded ``c / d`` from ``y = RN(1 / d)``: ``q = c·y``, then twice
  ``q + (c - q·d)·y`` (two FMAs each; the residual ``c - q·d`` is exact). After the first
  correction ``q`` is within an ulp of ``c / d``, so the second rounds correctly (Markstein's
  theorem). Weights below ``2^-60`` are scaled by ``2^64`` (exactly) so that residuals stay normal; a finite
  weight whose ``c·y`` overflows is divided as ``c / 4`` and the quotient times 4 (rounding commutes with the
  scaling, overflow included), and stays ``±inf`` where ``c·y / 4`` overflows too (the quotient is then beyond
  float32's range). A zero or infinite ``y`` (``d`` infinite or zero) keeps ``c·y``, IEEE's ``c / d`` there
  (the corrections would make ``inf·0`` NaN)."""
  inf = jnp.float32(jnp.inf)  # comparisons: Mosaic GPU lowers no is_finite
  first = c * y
  small = jnp.abs(c) < 2.0**-60
  huge = (jnp.abs(first) == inf) & (jnp.abs(c) < inf)
  one = jnp.float32(1.0)
  cs = c * jnp.where(small, jnp.float32(2.0**64), jnp.where(huge, jnp.float32(0.25), one))
  q = cs * y
  for _ in range(2):
    q = q + (cs - q * d) * y
  q = q * jnp.where(small, jnp.float32(2.0**-64), jnp.where(huge, jnp.float32(4.0), one))
  special = (c == 0) | (y == 0) | (jnp.abs(y) == inf) | (huge & (q != q))
  return jnp.where(special, first, q)  # a zero weight: a signed zero


def _asm(op: str, *args):
  """One float32 PTX instruction ``op`` applied elementwise to ``args`` (broadcast)."""
  args = jnp.broadcast_arrays(*args)
  regs = ", ".join(f"${i}" for i in range(len(args) + 1))
  out = jax.ShapeDtypeStruct(args[0].shape, jnp.float32)
  return plt.elementwise_inline_asm(f"{op} {regs};", args=args, constraints="=r" + ",r" * len(args), pack=1,
                                    result_shape_dtypes=[out])[0]


def triton_div(a, b, interpret: bool):
  """Correctly rounded ``a / b`` (``a >= 0``, ``b > 0``)."""
  return div(a, b) if interpret else _asm("div.rn.f32", a, b)


def triton_sqrt(x, interpret: bool):
  """Correctly rounded ``sqrt(x)`` (``x >= 0``)."""
  return sqrt(x) if interpret else _asm("sqrt.rn.f32", x)


def mosaic_ptx(instr: str, layout, shape):
  """``f(*operands)``: the one- or two-operand float32 PTX instruction ``instr`` (e.g. ``"div.rn.f32"``) applied
  elementwise to float32 ``shape`` arrays held in the register layout ``layout`` inside a compiled Mosaic GPU
  kernel (scalar operands are broadcast). Not for interpret mode: inline PTX has no interpreter."""
  ret = plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout)
  op = mgpu_fa.FragmentedArray._lift_fast_instr(instr)

  @plgpu.inline_mgpu(arg_types=(layout,) * 2, return_type=ret)
  def binary(_, a, b):
    return a._pointwise(op, b)

  @plgpu.inline_mgpu(arg_types=(layout,), return_type=ret)
  def unary(_, a):
    return a._pointwise(op)

  def apply(*args):
    args = [plgpu.layout_cast(jnp.broadcast_to(a, shape), layout) if jnp.ndim(a) == 0 else a for a in args]
    return binary(*args) if len(args) == 2 else unary(*args)

  return apply


def mosaic_swish_divisions(layout, shape, sf_layout, sf_shape, interpret):
  """``(swish, sf_div)`` for a Mosaic GPU SwiGLU kernel: ``swish(x, d)`` is ``(x / d, 1 / d)`` correctly rounded
  for ``d = 1 + exp(-x) >= 1`` (float32 ``shape`` arrays in ``layout``), ``sf_div(a, b)`` the correctly rounded
  division of the scale factors (``sf_shape`` arrays in ``sf_layout``, or scalars). Compiled (``interpret`` None):
  the PTX ``div.rn.f32`` and ``rcp.rn.f32`` (:func:`mosaic_ptx`); in interpret mode :func:`newton_div` and
  :func:`exact_div`, which give the same bits."""
  if interpret is None:
    div, rcp = mosaic_ptx("div.rn.f32", layout, shape), mosaic_ptx("rcp.rn.f32", layout, shape)
    return (lambda x, d: (div(x, d), rcp(d))), mosaic_ptx("div.rn.f32", sf_layout, sf_shape)
  return (lambda x, d: (newton_div(x, d), newton_div(jnp.ones_like(d), d))), exact_div

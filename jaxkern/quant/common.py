"""Argument checks and scale-factor layout helpers shared by the :mod:`jaxkern.quant` ops."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks
from jaxkern._layouts import row_layout
from jaxkern.reference.quant import cdiv, format_sf, sf_logical, sf_to_float

__all__ = ["cdiv", "encode_e2m1", "exact_div", "format_sf", "row_layout", "sf_logical", "sf_to_float"]

FMTS = ("e4m3", "e2m1")
BM = 64  # rows of the WGMMA register layout (per-channel kernel)
# 64-byte swizzle for e4m3 SMEM tiles, so that arrays whose width is a multiple of 64 (576) can be copied.
FP8_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
THREAD_BYTES = 128  # input bytes per thread and CTA that the row kernels aim for
# Lanes that share one row of a group (the rest of the warp takes other rows). Every lane holding a
# part of a row redoes that row's scale-factor arithmetic, so narrow groups want few lanes per row;
# 4 lanes (64 contiguous bytes of a row per load) measured best on the H200 for 128-wide groups.
GROUP_LANES = 4


MAX_SEGMENTS = 16  # partial last group: at most this many groups per row run as separate segments


def row_plan(m: int, k: int, group: int):
  """How the row kernels view an ``(m, k)`` array with one value per row and ``group`` columns:
  ``(view rows, view width, column segments)`` (one segment per group of a view row), or None
  (too many groups per row; use the reference). ``(m·k/group, group)`` when ``group`` divides
  ``k`` (then the view-row order of the per-group values is row-major ``(m, k/group)``)."""
  if group >= k:
    return m, k, ((0, k),)
  if k % group == 0:
    return m * k // group, group, ((0, group),)
  segs = tuple((c, min(group, k - c)) for c in range(0, k, group))
  return (m, k, segs) if len(segs) <= MAX_SEGMENTS else None


def tile_rows(num_rows: int, width: int, itemsize: int, unit: int, thread_bytes: int = THREAD_BYTES) -> int:
  """Rows per CTA for ``(num_rows, width)``: a multiple of ``unit`` near ``thread_bytes`` per thread,
  at most ``num_rows`` (the caller pads arrays with fewer than ``unit`` rows)."""
  rows = max(1, thread_bytes * 128 // (width * itemsize) // unit) * unit
  return max(unit, min(rows, num_rows // unit * unit))


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


def encode_e2m1(q):
  """float32 -> e2m1 nibble (int32 in 0..15), bit-identical to
  :func:`jaxkern.reference.quant.encode_e2m1` (also for ±inf and NaN) in about a third of its
  operations, for the kernels.

  ``|q|`` is saturated at 6 and rounded to nearest even on the e2m1 grid by adding and subtracting
  ``M = 2^22 · step`` (step 0.5 below 2, 1 in [2, 4), 2 from 4 up: the sum's ulp is the step); the
  rounded value ``r`` is 0, 0.5 or ``1.5·2^e``/``2^e`` whose bits ``>> 22`` minus 252 are the code
  (0.5 and 0 are fixed up by ``max(·, min(bits, 1))``). Subnormal ``|q|`` round to 0 with or without
  flushing; no multiply, so no contraction.
  """
  u = lax.bitcast_convert_type(q, jnp.int32)
  a = jnp.minimum(u & 0x7FFFFFFF, 0x40C00000)  # bit patterns of non-negative floats order like the floats
  m = jnp.maximum((a & 0x7F800000) + (22 << 23), 149 << 23)
  a_f, m_f = (lax.bitcast_convert_type(v, jnp.float32) for v in (a, m))
  r = lax.bitcast_convert_type((a_f + m_f) - m_f, jnp.int32)
  return ((u >> 28) & 8) | jnp.maximum((r >> 22) - 252, jnp.minimum(r, 1))


def check_fmt(fmt: str, allowed=FMTS) -> None:
  if fmt not in allowed:
    raise ValueError(f"fmt must be one of {allowed}, got {fmt!r}")


def check_sf_flags(use_tma_aligned_col_major_sf: bool, round_sf: bool, use_packed_ue8m0: bool) -> None:
  if use_packed_ue8m0 and not (use_tma_aligned_col_major_sf and round_sf):
    raise ValueError("use_packed_ue8m0 requires use_tma_aligned_col_major_sf=True and round_sf=True")


def check_sf(name: str, sf, shape, dtype) -> None:
  _checks.check_dtype(name, sf, (dtype,))
  if tuple(sf.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(sf.shape)}")


def sf_shape(num_rows: int, num_cols: int, *, col_major: bool, packed: bool) -> tuple[int, int]:
  """Shape of a layout A / B / C sf for a logical ``(num_rows, num_cols)`` matrix."""
  if not col_major:
    return num_rows, num_cols
  mp = cdiv(num_rows, 4) * 4
  return (cdiv(num_cols, 4), mp) if packed else (num_cols, mp)


def check_quant_tensor(name: str, x, block_size, *, col_major: bool = False, fp4: bool = True) -> int:
  """Checks a QuantTensor ``(q, sf)`` for blocks ``block_size``; returns the logical width ``K``."""
  if not (isinstance(x, tuple) and len(x) == 2):
    raise ValueError(f"{name} must be a QuantTensor (data, sf)")
  q, sf = x
  if block_size is None or len(block_size) != 2 or min(block_size) < 1:
    raise ValueError(f"x_block_size must be a pair of positive ints for a QuantTensor, got {block_size}")
  _checks.check_rank(f"{name}[0]", q, 2)
  _checks.check_dtype(f"{name}[0]", q, (jnp.float8_e4m3fn, jnp.int8, jnp.uint8) if fp4 else (jnp.float8_e4m3fn,))
  m, k = q.shape[0], q.shape[1] * (1 if q.dtype == jnp.float8_e4m3fn else 2)
  _checks.check_rank(f"{name}[1]", sf, 2)
  _checks.check_dtype(f"{name}[1]", sf, (jnp.float32, jnp.int32))
  mb, kb = cdiv(m, block_size[0]), cdiv(k, block_size[1])
  packed = sf.dtype == jnp.int32
  want = sf_shape(mb, kb, col_major=col_major or packed, packed=packed)
  if tuple(sf.shape) != want:
    raise ValueError(f"{name}[1] (sf) must have shape {want} for blocks {tuple(block_size)}, got {tuple(sf.shape)}")
  return k

"""``jnp`` references for :mod:`jaxkern.quant` (docs/quant.md), plus the shared numerics.

The numeric helpers (scale factors, e4m3 / e2m1 encoding and decoding, the sf layouts)
are also used inside the Pallas kernels, so kernel and reference round identically.
Every division is correctly rounded (docs/usage.md, "Numerics in XLA"): :func:`jaxkern.reference.ieee.div` (float64 plus a midpoint
correction, because XLA's float32 division is approximate on GPU and turns division by a constant
into a reciprocal multiply), ``jaxkern._ieee.exact_div`` inside the kernels.

Scale-factor layouts (docs/quant.md, "Scale layouts"), for a logical sf matrix ``S`` of shape ``(Mb, Kb)``:

* A (default): ``(Mb, Kb)`` float32, row-major.
* B (``use_tma_aligned_col_major_sf``): the physical column-major buffer ``(Kb, Mp)`` float32,
  ``Mp = align(Mb, 4)``, i.e. ``S.T`` zero-padded on its last axis.
* C (``use_tma_aligned_col_major_sf`` and ``use_packed_ue8m0``, needs ``round_sf``): ``(ceil(Kb/4), Mp)``
  int32; word ``[w, i]`` holds the UE8M0 bytes of ``S[i, 4w:4w+4]``, block column ``4w`` in the least
  significant byte; padding bytes and rows are zero.

E5M6 (docs/quant.md, "Number formats"): 12-bit codes ``s eeeee mmmmmm`` (the top 12 bits of an fp16 pattern), eight
per three little-endian uint32 words, returned as bytes ``(M, 3K/2)`` uint8.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern.reference import ieee
from jaxkern.types import QuantTensor, QuantTensorWithClampedCount, SwigluBackward

FP8_MAX = 448.0
FP4_MAX = 6.0
E5M6_MAX = 65024.0
MAX_VALUE = {"e4m3": FP8_MAX, "e2m1": FP4_MAX, "e5m6": E5M6_MAX}
CLAMP_MIN = {"e4m3": float(np.float32(1e-4)), "e2m1": 6.0 * 2.0**-126, "e5m6": float(np.float32(1e-4))}
# Magnitudes of the e2m1 nibbles 0..7; nibbles 8..15 are their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.int32)


def _float(u):
  return lax.bitcast_convert_type(u, jnp.float32)


def scale_factors(amax: jax.Array, max_value: float, fmt: str, round_sf: bool, div: Callable = ieee.div,
                  clamp_min: float | None = None):
  """``(sf, sf_inv)`` from a group's absolute maximum (docs/quant.md, "Scale factors").

  ``max_value`` is the format's largest value (a float or an array shaped like ``amax``). ``div`` is
  the correctly rounded division: :func:`jaxkern.reference.ieee.div`, ``jaxkern._ieee.exact_div`` inside
  the kernels. ``clamp_min``: the amax clamp minimum (float32), default the format's :data:`CLAMP_MIN`.
  With ``round_sf`` the sf is the power of two ``2^ceil(log2(a / max_value))`` and ``sf_inv`` its exact
  inverse.
  """
  a = jnp.maximum(amax, CLAMP_MIN[fmt] if clamp_min is None else float(np.float32(clamp_min)))
  sf = div(a, max_value)
  if not round_sf:
    return sf, div(max_value, a)
  e = ((_bits(sf) - 1) >> 23) + 1  # biased exponent of the next power of two up
  return _float(e << 23), _float((254 - e) << 23)


CANONICAL_NAN = 0x7FFFFFFF  # the float32 NaN that NVIDIA GPUs return from every arithmetic instruction


def canonical_nan(v: jax.Array):
  """float32 ``v`` with every NaN replaced by the canonical NaN (:data:`CANONICAL_NAN`, positive).

  The GPU makes that NaN for every NaN result, while x86 CPUs keep an operand's NaN (its sign and
  payload; with two NaN operands the one XLA happened to put first) or make a negative one (``0 · inf``):
  the casts define their NaN results as the GPU's, so that they are the same on every backend.
  """
  return jnp.where(jnp.isnan(v), _float(jnp.int32(CANONICAL_NAN)), v)


def abs_max(x: jax.Array, axis: int):
  """``max |x|`` along ``axis``, NaN-propagating: a NaN anywhere gives NaN (the largest sign-cleared NaN
  pattern), else +inf if there is one, else the finite maximum.

  Reduced on the float32 bit patterns with the sign cleared, which order like the magnitudes (NaN above
  +inf): XLA's float max reductions drop NaN on the CPU for some shapes (measured with jax 0.11.2:
  ``jnp.max(x, axis=1)`` of a ``(40, 128)`` float32 array gives a finite maximum for a row holding a NaN,
  of a ``(4, 128)`` array NaN), integer ones cannot. The kernels' maxima are NaN-propagating too
  (``max.NaN.f32`` on the GPU).
  """
  return _float(jnp.max(_bits(x) & 0x7FFFFFFF, axis=axis))


def encode_e4m3(q: jax.Array):
  """float32 -> float8_e4m3fn with saturation to ±448 (round to nearest even)."""
  return jnp.clip(q, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def encode_e2m1(q: jax.Array):
  """float32 -> e2m1 nibble (int32 in 0..15): round to nearest even, saturate at ±6, keep the sign
  (docs/quant.md, "Number formats")."""
  u = _bits(q)
  sign = lax.shift_right_logical(u, 31)
  e = (u >> 23) & 0xFF
  f = u & 0x7FFFFF
  shift = jnp.clip(127 - e, 0, 24)
  big = e >= 127
  g = jnp.where(big, f, lax.shift_right_logical(0x800000 | f, shift))
  lost = jnp.where(big, 0, (0x800000 | f) & ((1 << shift) - 1))
  ee = jnp.where(big, jnp.minimum(e - 126, 4), 0)
  keep = (g >> 22) & 1
  guard = (g >> 21) & 1
  sticky = ((g & 0x1FFFFF) | lost) != 0
  code = ((ee << 1) | keep) + (guard & (sticky | (keep == 1)).astype(jnp.int32))
  return (sign << 3) | jnp.minimum(code, 7)


def decode_e2m1(n: jax.Array):
  """e2m1 nibble (int32 in 0..15) -> float32 with integer operations (also used inside the kernels):
  a magnitude ``m >= 2`` is the float32 pattern ``(m << 22) + (126 << 23)``, 1 is 0.5, 0 is 0; the
  sign bit 3 moves to bit 31 (nibble 8 is -0.0)."""
  m = n & 7
  mag = jnp.where(m >= 2, (m << 22) + (126 << 23), jnp.where(m == 1, 126 << 23, 0))
  return _float(mag | ((n & 8) << 28))


def pack_e2m1(nibbles: jax.Array):
  """``(..., 2L)`` nibbles -> ``(..., L)`` int8, column ``2j`` in the low nibble of byte ``j``."""
  n = nibbles.reshape(*nibbles.shape[:-1], nibbles.shape[-1] // 2, 2)
  return (n[..., 0] | (n[..., 1] << 4)).astype(jnp.uint8).astype(jnp.int8)


def _decode(q):
  """Quantised data -> float32 values and logical width: e4m3 ``(M, K)`` or packed e2m1 ``(M, K/2)``."""
  if q.dtype == jnp.float8_e4m3fn:
    return q.astype(jnp.float32)
  return unpack_from_e2m1fn_x2(q)


def sf_exponent_bytes(sf: jax.Array):
  """Biased exponent field (the UE8M0 byte) of a float32 power-of-two sf."""
  return (_bits(sf) >> 23) & 0xFF


def format_sf(sf: jax.Array, use_tma_aligned_col_major_sf: bool = False, use_packed_ue8m0: bool = False):
  """Logical ``(Mb, Kb)`` float32 sf -> layout A, B or C (see the module docstring)."""
  if not use_tma_aligned_col_major_sf:
    return sf
  mb, kb = sf.shape
  mp = cdiv(mb, 4) * 4
  if not use_packed_ue8m0:
    return jnp.pad(sf.T, ((0, 0), (0, mp - mb)))
  b = jnp.pad(sf_exponent_bytes(sf), ((0, mp - mb), (0, cdiv(kb, 4) * 4 - kb)))
  b = b.reshape(mp, cdiv(kb, 4), 4)
  words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
  return words.T


def sf_to_float(sf: jax.Array, num_rows: int, num_cols: int, *, use_tma_aligned_col_major_sf: bool = False):
  """Any sf layout -> the decoded logical ``(num_rows, num_cols)`` float32 matrix (docs/quant.md, "Scale layouts").

  An int32 sf is layout C; a float32 sf is layout B with ``use_tma_aligned_col_major_sf``, else A.
  UE8M0 bytes decode as ``float(b << 23)`` (0 -> +0.0, 255 -> +inf).
  """
  if sf.dtype == jnp.int32:
    w = sf.T[:num_rows]
    b = jnp.stack([lax.shift_right_logical(w, 8 * t) & 0xFF for t in range(4)], axis=-1)
    return _float(b.reshape(num_rows, 4 * w.shape[1])[:, :num_cols] << 23)
  if use_tma_aligned_col_major_sf:
    return sf.T[:num_rows]
  return sf


def sf_logical(sf: jax.Array, num_rows: int, *, use_tma_aligned_col_major_sf: bool, use_packed_ue8m0: bool = False):
  """Layout B / C physical buffer -> the logical view (``(Mb, Kb)`` float32 or ``(Mb, words)`` int32)."""
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    return sf.T[:num_rows]
  return sf


def _blocked(v, bm: int, bk: int, fill=0.0):
  """``(M, K)`` -> ``(Mb, bm, Kb, bk)``, padded with ``fill``."""
  m, k = v.shape
  mb, kb = cdiv(m, bm), cdiv(k, bk)
  v = jnp.pad(v, ((0, mb * bm - m), (0, kb * bk - k)), constant_values=fill)
  return v.reshape(mb, bm, kb, bk)


def _unblocked(v, m: int, k: int):
  mb, bm, kb, bk = v.shape
  return v.reshape(mb * bm, kb * bk)[:m, :k]


def _expand(s, bm: int, bk: int, m: int, k: int):
  """Per-block ``(Mb, Kb)`` values -> per-element ``(M, K)``."""
  return jnp.repeat(jnp.repeat(s, bm, axis=0), bk, axis=1)[:m, :k]


def _encode(q, fmt: str):
  if fmt == "e4m3":
    return encode_e4m3(q)
  return pack_e2m1(encode_e2m1(q))


def scaled_abs_max(v: jax.Array, sfv_in: jax.Array, block_size: tuple[int, int], x_block_size: tuple[int, int]):
  """The amax of each ``block_size`` block of the dequantised ``v · sfv_in`` (``(M, K)`` each, ``sfv_in``
  constant on the ``x_block_size`` blocks), in the kernels' order (and upstream's): per part, the intersection
  of an output block and an input block, ``max|v|`` times the part's one input scale, then the NaN-propagating
  maximum over the parts (:func:`abs_max`). The same bits as ``abs_max(v · sfv_in)`` for finite scales (the
  rounding is monotonic); with a +inf scale a part's amax is +inf, or NaN (``0 · inf``) only where all its data
  are zero, and a NaN scale gives NaN."""
  (bm, bk), (ibm, ibk) = block_size, x_block_size
  pm, pk = math.gcd(bm, ibm), math.gcd(bk, ibk)
  part_max = abs_max(_blocked(v, pm, pk), axis=(1, 3))
  part_sf = _blocked(sfv_in, pm, pk)[:, 0, :, 0]  # each part's first element is inside the array
  return abs_max(_blocked(part_max * part_sf, bm // pm, bk // pk), axis=(1, 3))


def cast(x: jax.Array | QuantTensor | tuple[jax.Array, jax.Array], fmt: str, block_size: tuple[int, int], *,
         x_block_size: tuple[int, int] | None = None, sf: jax.Array | None = None, round_sf: bool = False,
         use_tma_aligned_col_major_sf: bool = False, use_packed_ue8m0: bool = False,
         x_use_tma_aligned_col_major_sf: bool = False):
  """Blockwise cast to e4m3 / packed e2m1 (the upstream reference ``cast``).

  Args:
    x: ``(M, K)`` bfloat16 / float32, or a QuantTensor ``(q, sf_in)`` for blocks ``x_block_size``.
    fmt: ``"e4m3"`` or ``"e2m1"``.
    block_size: ``(bm, bk)`` of the output sf.
    sf: optional precomputed float32 layout-A sf ``(Mb, Kb)``; then ``sf_inv = 1 / sf`` and only the
      data are returned.

  Returns:
    ``(out, out_sf)`` (or ``out`` with ``sf``): ``out`` ``(M, K)`` e4m3 or ``(M, K/2)`` int8.
  """
  bm, bk = block_size
  if isinstance(x, tuple):
    q_in, sf_in = x
    v = _decode(q_in)
    m, k = v.shape
    ibm, ibk = x_block_size
    sfv_in = _expand(sf_to_float(sf_in, cdiv(m, ibm), cdiv(k, ibk),
                                 use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf), ibm, ibk, m, k)
  else:
    v = x.astype(jnp.float32)
    sfv_in = None
    m, k = v.shape
  if sf is not None:
    inv = _expand(ieee.div(1.0, sf), bm, bk, m, k)
    return _encode(canonical_nan(v * inv if sfv_in is None else v * (sfv_in * inv)), fmt)
  if sfv_in is None:
    amax = abs_max(_blocked(v, bm, bk), axis=(1, 3))
  else:
    amax = scaled_abs_max(v, sfv_in, (bm, bk), x_block_size)
  out_sf, inv = scale_factors(amax, MAX_VALUE[fmt], fmt, round_sf)
  inv = _expand(inv, bm, bk, m, k)
  # Scales first for a QuantTensor input (the kernels' order, docs/quant.md, "Casts"). As upstream's kernel, an
  # all-zero group whose sfv_in · sf_inv overflows gives 0 · inf = NaN, encoded as +NaN (CUDA's NaN).
  # NaN products and sf are the GPU's canonical NaN on every backend (canonical_nan), encoded as e4m3 0x7F
  # and e2m1 +6.
  q = canonical_nan(v * inv if sfv_in is None else v * (sfv_in * inv))
  return _encode(q, fmt), format_sf(canonical_nan(out_sf), use_tma_aligned_col_major_sf, use_packed_ue8m0)


def lossless_scales(sf_in: jax.Array, m: int, k: int, x_block_size: tuple[int, int], out_block_size: tuple[int, int],
                    x_use_tma_aligned_col_major_sf: bool = False):
  """The exponent bookkeeping of :func:`per_block_cast_lossless` at block granularity.

  Returns ``(scale, e_out)``: ``scale`` float32 ``(M, cdiv(K, bk_in))``, the power of two
  ``2^(E(b) - Eout(B))`` (as ``float((d + 127) << 23)``) that every element of input block ``b``
  (row by row) is multiplied by, and ``e_out`` int32 ``(Mb_out, Kb_out)``, the output exponent bytes.
  """
  ibm, ibk = x_block_size
  obm, obk = out_block_size
  e_in = sf_exponent_bytes(sf_to_float(sf_in, cdiv(m, ibm), cdiv(k, ibk),
                                       use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf))
  e_rows = jnp.repeat(e_in, ibm, axis=0)[:m]  # (M, Kb_in); blocks outside the tensor are gone
  emax = jnp.max(_blocked(e_rows, obm, obk // ibk, fill=0), axis=(1, 3))
  e_out = jnp.maximum(emax - 6, 0)
  d = e_rows - _expand(e_out, obm, obk // ibk, m, e_rows.shape[1])
  return _float((d + 127) << 23), e_out


# References of the per-token and per-block casts

def per_token_cast(x: jax.Array | QuantTensor | tuple[jax.Array, jax.Array], fmt: str, num_per_channels: int, *,
                   x_block_size: tuple[int, int] | None = None, use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False,
                   x_use_tma_aligned_col_major_sf: bool = False) -> QuantTensor:
  """Reference of :func:`jaxkern.quant.per_token_cast` (docs/quant.md, "Casts"): :func:`cast` with blocks
  ``(1, num_per_channels)``; ``x`` a plain ``(M, K)`` array or a QuantTensor for blocks ``x_block_size``.

  Non-finite inputs (outside upstream's contract, docs/quant.md, "Non-finite inputs and edge cases"; defined here so that kernel and
  reference agree bit for bit on every backend): the amax is NaN-propagating (:func:`abs_max`): a group
  with a NaN has amax NaN, else with a ±inf amax +inf. The scale computation (docs/quant.md, "Scale factors") applied to it gives sf = sf_inv = NaN, or
  sf = +inf and sf_inv = 0; with ``round_sf`` the exponent arithmetic on those patterns gives sf = -0.0
  (UE8M0 byte 0) and sf_inv = -2^127 for NaN, sf = +inf (UE8M0 byte 255) and sf_inv = -inf for inf. A
  QuantTensor input's amax is ``max|data| · sf_in`` per input block within the group (:func:`scaled_abs_max`):
  an infinite input sf gives +inf, NaN only for a part whose data are all zero. The
  data are ``encode(x · sf_inv)`` as always: ±inf products saturate (e4m3 ±448, e2m1 ±6). Every NaN result
  (sf, products) is the GPU's canonical NaN 0x7FFFFFFF (:func:`canonical_nan`), so NaN data encode as
  e4m3 0x7F and e2m1 +6 (nibble 7), whatever the sign of the input NaN. ``fmt="e5m6"``:
  :func:`per_token_cast_to_e5m6` (plain input only).
  """
  if fmt == "e5m6":
    return per_token_cast_to_e5m6(x, num_per_channels, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                                  round_sf=round_sf, use_packed_ue8m0=use_packed_ue8m0)
  return QuantTensor(*cast(x, fmt, (1, num_per_channels), x_block_size=x_block_size, round_sf=round_sf,
                           use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0,
                           x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf))


def per_token_cast_with_sf_only(x: jax.Array, fmt: str, num_per_channels: int, *,
                                x_block_size: tuple[int, int] | None = None, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False):
  """Reference of :func:`jaxkern.quant.per_token_cast_with_sf_only`: the ``sf`` of :func:`per_token_cast`."""
  return per_token_cast(x, fmt, num_per_channels, x_block_size=x_block_size, round_sf=round_sf,
                        use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                        use_packed_ue8m0=use_packed_ue8m0).sf


def per_token_cast_with_precomputed_sf(x: jax.Array, fmt: str, num_per_channels: int, sf: jax.Array, *,
                                       x_block_size: tuple[int, int] | None = None,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False):
  """Reference of :func:`jaxkern.quant.per_token_cast_with_precomputed_sf` (docs/quant.md, "Casts"): ``encode(x ·
  RN(1 / sf))`` with the layout-A float32 ``sf`` ``(M, ceil(K / num_per_channels))``; the flags and
  ``x_block_size`` have no effect here (the op rejects them). Non-finite ``x`` encode as in :func:`per_token_cast`."""
  return cast(x, fmt, (1, num_per_channels), sf=sf)


def per_block_cast(x: jax.Array, fmt: str, block_size: tuple[int, int], *, use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False) -> QuantTensor:
  """Reference of :func:`jaxkern.quant.per_block_cast` (docs/quant.md, "Casts"): :func:`cast` with blocks
  ``block_size``; non-finite inputs as in :func:`per_token_cast`, per block."""
  return QuantTensor(*cast(x, fmt, tuple(block_size), round_sf=round_sf,
                           use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                           use_packed_ue8m0=use_packed_ue8m0))


def per_block_cast_with_sf_only(x: jax.Array, fmt: str, block_size: tuple[int, int], *,
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False):
  """Reference of :func:`jaxkern.quant.per_block_cast_with_sf_only`: the ``sf`` of :func:`per_block_cast`."""
  return per_block_cast(x, fmt, block_size, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                        round_sf=round_sf, use_packed_ue8m0=use_packed_ue8m0).sf


def per_block_cast_with_precomputed_sf(x: jax.Array, fmt: str, block_size: tuple[int, int], sf: jax.Array, *,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False):
  """Reference of :func:`jaxkern.quant.per_block_cast_with_precomputed_sf` (docs/quant.md, "Casts"): ``encode(x ·
  RN(1 / sf))`` per block with the layout-A float32 ``sf`` ``(Mb, Kb)``; the flags have no effect here."""
  return cast(x, fmt, tuple(block_size), sf=sf)


def per_block_cast_lossless(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, x_block_size: tuple[int, int],
                            out_block_size: tuple[int, int], *, use_tma_aligned_col_major_sf: bool = False,
                            round_sf: bool = False, use_packed_ue8m0: bool = False,
                            x_use_tma_aligned_col_major_sf: bool = False) -> QuantTensor:
  """Reference of :func:`jaxkern.quant.per_block_cast_lossless` (docs/quant.md, "Casts"): exact re-quantisation of a
  packed-e2m1 QuantTensor with power-of-two sf into ``fmt`` e4m3 with larger blocks (``round_sf`` has no
  effect: the output sf are powers of two). Returns ``QuantTensor(out (M, K) e4m3, out_sf)``."""
  del fmt, round_sf  # e4m3 only; the sf are powers of two either way
  q4, sf_in = x
  v = unpack_from_e2m1fn_x2(q4)
  m, k = v.shape
  scale, e_out = lossless_scales(sf_in, m, k, tuple(x_block_size), tuple(out_block_size),
                                 x_use_tma_aligned_col_major_sf)
  out = encode_e4m3(v * _expand(scale, 1, x_block_size[1], m, k))
  return QuantTensor(out, format_sf(_float(e_out << 23), use_tma_aligned_col_major_sf, use_packed_ue8m0))


# References of the per-channel casts and cast-backs


def _per_channel(x, fmt: str, num_per_tokens: int, round_sf: bool) -> QuantTensor:
  """:func:`cast` with blocks ``(num_per_tokens, 1)`` (one scale per column and group of rows), its
  maxima NaN-propagating on every backend (:func:`abs_max`)."""
  v = x.astype(jnp.float32)
  m, k = v.shape
  sf, inv = scale_factors(abs_max(_blocked(v, num_per_tokens, 1), axis=(1, 3)), MAX_VALUE[fmt], fmt, round_sf)
  return QuantTensor(_encode(v * _expand(inv, num_per_tokens, 1, m, k), fmt), sf)


def per_channel_cast(x: jax.Array, fmt: str, num_per_tokens: int, *, round_sf: bool = False) -> QuantTensor:
  """Per-channel cast of ``x`` ``(M, K)`` (bf16 / float32): ``QuantTensor(data (M, K) e4m3, sf
  (ceil(M/num_per_tokens), K) float32)``.

  Non-finite inputs (the kernels give the same bits): the group maximum propagates NaN, and the data
  are ``e4m3(v·sf_inv)`` as always (saturating at ±448, NaN for a NaN product). A NaN in a group makes
  its amax NaN: ``sf = sf_inv = NaN``, so the whole group is NaN; with ``round_sf`` the exponent
  arithmetic of :func:`scale_factors` on that NaN gives ``sf = -0.0``, ``sf_inv = -2^127``. An
  infinity makes the amax inf: ``sf = inf``, ``sf_inv = 0`` (finite values become signed zeros, the
  infinity NaN); with ``round_sf`` ``sf = inf``, ``sf_inv = -inf`` (zeros become NaN, other values
  -448 / 448 with the sign flipped).
  """
  return _per_channel(x, fmt, num_per_tokens, round_sf)


def per_channel_cast_and_transpose(x: jax.Array, fmt: str, num_per_tokens: int, *,
                                   round_sf: bool = False) -> QuantTensor:
  """:func:`per_channel_cast` with the data transposed: ``QuantTensor(data (K, M) e4m3, sf
  (ceil(M/num_per_tokens), K) float32)``."""
  data, sf = _per_channel(x, fmt, num_per_tokens, round_sf)
  return QuantTensor(data.T, sf)


def per_channel_cast_fused(x: jax.Array | QuantTensor, fmt: str, num_per_tokens: int, *, round_sf: bool = False,
                           num_per_channels: int | None = None, pos_to_token: jax.Array | None = None) -> QuantTensor:
  """Per-channel cast (blocks ``(num_per_tokens, 1)``) with an optional row gather.

  ``x`` is ``(M, K)`` bf16 / float32, or a QuantTensor ``(q, sf)`` with e4m3 ``q`` and a layout-A
  float32 sf ``(M, ceil(K/num_per_channels))``, dequantised (``RN(q·sf)``) before the cast.
  ``pos_to_token`` ``(Mo,)`` gathers rows: row ``p`` is ``x[pos_to_token[p]]``, a zero row where the
  entry is negative or ``>= M``. Rows past ``Mo`` in a partial last block are not part of any amax.
  Returns ``QuantTensor(data (Mo, K) e4m3, sf (ceil(Mo/num_per_tokens), K) float32)``; non-finite
  inputs as :func:`per_channel_cast`.
  """
  if isinstance(x, tuple):
    q, sf = x
    v = q.astype(jnp.float32) * jnp.repeat(sf, num_per_channels, axis=1)[:, :q.shape[1]]
  else:
    v = x.astype(jnp.float32)
  if pos_to_token is not None and v.shape[0] == 0:  # every entry is out of range
    v = jnp.zeros((pos_to_token.shape[0], v.shape[1]), jnp.float32)
  elif pos_to_token is not None:
    valid = (pos_to_token >= 0) & (pos_to_token < v.shape[0])
    v = jnp.where(valid[:, None], v[jnp.clip(pos_to_token, 0, v.shape[0] - 1)], 0.0)
  return _per_channel(v, fmt, num_per_tokens, round_sf)


def cast_back(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, x_block_size: tuple[int, int], *,
              x_special_fmt: Literal["e5m6"] | None = None, x_use_tma_aligned_col_major_sf: bool = False):
  """Dequantises ``(q, sf)`` with blocks ``x_block_size`` to ``fmt`` (``"bf16"`` / ``"fp32"``):
  ``RN(f32(q)·sf)`` in float32, then one rounding to bf16. ``q`` is e4m3 ``(M, K)`` or packed e2m1
  ``(M, K/2)``; ``sf`` in layout A, B or C (see the module docstring). NaN / infinite data or scales
  follow IEEE multiplication (``0·inf`` is NaN). ``x_special_fmt``: None, or ``"e5m6"`` for
  :func:`cast_back_e5m6`."""
  if x_special_fmt == "e5m6":
    return cast_back_e5m6(x, fmt, x_block_size, x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)
  if x_special_fmt is not None:
    raise ValueError(f"x_special_fmt must be None or 'e5m6', got {x_special_fmt!r}")
  q, sf = x
  v = _decode(q)
  m, k = v.shape
  bm, bk = x_block_size
  s = sf_to_float(sf, cdiv(m, bm), cdiv(k, bk), use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)
  out = v * _expand(s, bm, bk, m, k)
  return out.astype(jnp.bfloat16 if fmt == "bf16" else jnp.float32)


def per_token_cast_back(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, num_per_channels: int, *,
                        x_special_fmt: Literal["e5m6"] | None = None, x_use_tma_aligned_col_major_sf: bool = False):
  """:func:`cast_back` with blocks ``(1, num_per_channels)``."""
  return cast_back(x, fmt, (1, num_per_channels), x_special_fmt=x_special_fmt,
                   x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)


def unpack_from_e2m1fn_x2(x: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.float32):
  """Packed e2m1 bytes ``(..., L)`` (int8 / uint8) -> decoded values ``(..., 2L)`` of ``out_dtype``,
  element ``2j`` from the low nibble of byte ``j``."""
  b = x.astype(jnp.uint8).astype(jnp.int32)
  n = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*x.shape[:-1], 2 * x.shape[-1])
  table = jnp.asarray(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), jnp.float32)
  return table[n].astype(out_dtype)


# E5M6 (docs/quant.md, "Number formats", "Casts", "Cast-backs")


def fp16_rtz_bits(u: jax.Array):
  """float32 patterns (int32) -> fp16 patterns rounded toward zero (int32 in 0..0xFFFF), the integer recipe
  of the E5M6 encoding (docs/quant.md, "Number formats"), first step: exponents above the fp16 range (and inf) give ±inf 0x7C00, NaN 0x7FFF."""
  sign = lax.shift_right_logical(u, 16) & 0x8000
  e = (u >> 23) & 0xFF
  f = u & 0x7FFFFF
  normal = ((e - 112) << 10) | (f >> 13)
  subnormal = lax.shift_right_logical(0x800000 | f, jnp.clip(126 - e, 0, 31))
  special = jnp.where((e == 255) & (f != 0), 0x7FFF, 0x7C00)
  mag = jnp.where(e >= 143, special, jnp.where(e >= 113, normal, jnp.where(e >= 103, subnormal, 0)))
  return sign | mag


def encode_e5m6(v: jax.Array):
  """float32 -> 12-bit E5M6 code (int32 in 0..0xFFF), the E5M6 encoding of docs/quant.md, "Number formats": the fp16 pattern rounded toward
  zero, its top 12 bits, plus one where ``(code & 1) + (low 17 bits of the float32 pattern) > 0x10000`` (round
  to nearest even for fp16-normal magnitudes; the format's literal rule below 2^-14)."""
  u = _bits(v)
  t = lax.shift_right_logical(fp16_rtz_bits(u), 4)
  return jnp.where((t & 1) + (u & 0x1FFFF) > 0x10000, t + 1, t) & 0xFFF


def e5m6_words(t: jax.Array):
  """Eight E5M6 codes ``t0..t7`` (int32 arrays) -> the three int32 words of their 96-bit big-endian
  concatenation (docs/quant.md, "Number formats")."""
  w0 = (t[0] << 20) | (t[1] << 8) | (t[2] >> 4)
  w1 = (t[2] << 28) | (t[3] << 16) | (t[4] << 4) | (t[5] >> 8)
  w2 = (t[5] << 24) | (t[6] << 12) | t[7]
  return w0, w1, w2


def e5m6_codes(w0: jax.Array, w1: jax.Array, w2: jax.Array):
  """The inverse of :func:`e5m6_words`: three int32 words -> the eight codes (int32 in 0..0xFFF)."""
  srl = lax.shift_right_logical
  return (srl(w0, 20), (w0 >> 8) & 0xFFF, ((w0 & 0xFF) << 4) | srl(w1, 28), (w1 >> 16) & 0xFFF,
          (w1 >> 4) & 0xFFF, ((w1 & 0xF) << 8) | srl(w2, 24), (w2 >> 12) & 0xFFF, w2 & 0xFFF)


def pack_e5m6(codes: jax.Array):
  """``(M, K)`` codes -> ``(M, 3K/2)`` uint8: per group of 8 columns the words ``w0, w1, w2``, little-endian."""
  m, k = codes.shape
  g = codes.reshape(m, k // 8, 8)
  words = jnp.stack(e5m6_words([g[..., i] for i in range(8)]), axis=-1)
  return lax.bitcast_convert_type(words, jnp.uint8).reshape(m, 3 * k // 2)


def unpack_e5m6(packed: jax.Array):
  """``(M, 3K/2)`` uint8 -> ``(M, K)`` E5M6 codes (int32)."""
  m, n = packed.shape
  words = lax.bitcast_convert_type(packed.reshape(m, n // 12, 3, 4), jnp.int32)
  return jnp.stack(e5m6_codes(*(words[..., i] for i in range(3))), axis=-1).reshape(m, 2 * n // 3)


def decode_e5m6(t: jax.Array):
  """E5M6 codes (int32) -> float32: the fp16 with pattern ``t << 4``, widened (exact)."""
  return lax.bitcast_convert_type((t << 4).astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def per_token_cast_to_e5m6(x: jax.Array, num_per_channels: int, *, use_tma_aligned_col_major_sf: bool = False,
                           round_sf: bool = False, use_packed_ue8m0: bool = False) -> QuantTensor:
  """Reference of :func:`jaxkern.quant.per_token_cast_to_e5m6` (docs/quant.md, "Casts"): ``x`` ``(M, K)`` bf16 / float32,
  one sf per group of ``num_per_channels`` columns (a divisor of ``K``; the op requires ``K``), max value 65024,
  clamp minimum 1e-4; data ``pack(encode_e5m6(RN(x · sf_inv)))`` ``(M, 3K/2)`` uint8, sf in layout A / B / C.
  Non-finite inputs as :func:`per_token_cast` (NaN-propagating amax, canonical NaN for every NaN result)."""
  v = x.astype(jnp.float32)
  m, k = v.shape
  amax = abs_max(v.reshape(m, k // num_per_channels, num_per_channels), axis=2)
  sf, inv = scale_factors(amax, E5M6_MAX, "e5m6", round_sf)
  q = canonical_nan(v * jnp.repeat(inv, num_per_channels, axis=1))
  return QuantTensor(pack_e5m6(encode_e5m6(q)),
                     format_sf(canonical_nan(sf), use_tma_aligned_col_major_sf, use_packed_ue8m0))


def cast_back_e5m6(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, x_block_size: tuple[int, int], *,
                   x_use_tma_aligned_col_major_sf: bool = False):
  """Reference of :func:`jaxkern.quant.cast_back_e5m6` (docs/quant.md, "Cast-backs"): ``(packed (M, 3K/2) uint8, sf)`` with
  blocks ``x_block_size`` -> ``RN(decode(code) · sf)`` as ``fmt`` (``"bf16"`` / ``"fp32"``); NaN results are
  the canonical NaN (:func:`canonical_nan`)."""
  q, sf = x
  v = decode_e5m6(unpack_e5m6(q))
  m, k = v.shape
  bm, bk = x_block_size
  s = sf_to_float(sf, cdiv(m, bm), cdiv(k, bk), use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)
  out = canonical_nan(v * _expand(s, bm, bk, m, k))
  return out.astype(jnp.bfloat16 if fmt == "bf16" else jnp.float32)
# References of the fused SwiGLU ops


def _clamp_flags_and_halves(x, swiglu_clamp_value):
  """float32 halves ``(l', r')`` of ``x`` ``(E, 2h)`` after the optional clamp, and the clamp flags
  ``(l > C, r > C, r < -C)`` of the unclamped values (None without a clamp) (docs/quant.md, "Fused SwiGLU")."""
  h = x.shape[1] // 2
  v = x.astype(jnp.float32)
  left, right = v[:, :h], v[:, h:]
  if swiglu_clamp_value is None:
    return left, right, None
  c = float(np.float32(swiglu_clamp_value))
  flags = (left > c, right > c, right < -c)
  return jnp.minimum(left, c), jnp.clip(right, -c, c), flags


def _silu_times(left, right):
  """``RN(div_rn(l, RN(1 + exp(-l))) · r)`` in this evaluation order (docs/quant.md, "Fused SwiGLU")."""
  return ieee.div(left, 1.0 + jnp.exp(-left)) * right


def row_weights(pos_to_token_topk: jax.Array, topk_weights: jax.Array, num_rows: int):
  """Per-row weight ``(E,)`` float32: ``topk_weights.reshape(-1)[j]`` for ``j = pos_to_token_topk[p] >= 0``,
  else 0 (an index past the end is undefined behaviour: clamped here)."""
  flat = topk_weights.astype(jnp.float32).reshape(-1)
  if flat.shape[0] == 0:
    return jnp.zeros((num_rows,), jnp.float32)
  pos = pos_to_token_topk.astype(jnp.int32)
  return jnp.where(pos >= 0, flat[jnp.clip(pos, 0, flat.shape[0] - 1)], 0.0)


def _add_counts(clamped_count, flags, rows=None):
  """``clamped_count + [#flag for each flag]``, counting only ``rows`` (a row mask) when given."""
  keep = (lambda f: f) if rows is None else (lambda f: f & rows[:, None])
  counts = jnp.stack([jnp.sum(keep(f), dtype=clamped_count.dtype) for f in flags])
  return clamped_count + counts


def swiglu_forward(x: jax.Array, pos_to_token_topk: jax.Array | None = None, topk_weights: jax.Array | None = None,
                   swiglu_clamp_value: float | None = None, clamped_count: jax.Array | None = None):
  """The upstream reference ``swiglu_forward`` (docs/quant.md, "Fused SwiGLU"): ``silu(left) · right`` of ``x`` ``(E, 2h)``
  bf16 / float32 in float32, ``left`` clamped from above and ``right`` to ``[-C, C]`` with a clamp value
  ``C``, then each row times its top-k weight (:func:`row_weights`: 0 for ``pos_to_token_topk < 0``) when
  ``pos_to_token_topk`` and ``topk_weights`` ``(T, k)`` are given.

  Returns ``out`` ``(E, h)`` float32, or ``(out, clamped_count_new)`` when ``clamped_count`` (a ``(3,)``
  integer array) is given: upstream adds the counts of ``l > C``, ``r > C``, ``r < -C`` (unclamped values,
  every row) into it in place; here they are added to a copy (nothing is added without a clamp).
  """
  left, right, flags = _clamp_flags_and_halves(x, swiglu_clamp_value)
  out = _silu_times(left, right)
  if pos_to_token_topk is not None:
    out = out * row_weights(pos_to_token_topk, topk_weights, x.shape[0])[:, None]
  if clamped_count is None:
    return out
  return out, clamped_count if flags is None else _add_counts(clamped_count, flags)


def swiglu_forward_and_per_token_cast(x: jax.Array, fmt: str, num_per_channels: int,
                                      pos_to_token_topk: jax.Array | None = None, topk_weights: jax.Array | None = None,
                                      pos_to_expert: jax.Array | None = None, *,
                                      use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                      use_packed_ue8m0: bool = False, swiglu_clamp_value: float | None = None,
                                      clamped_count: jax.Array | None = None, sf_clamp_min: float | None = None):
  """Reference of :func:`jaxkern.quant.swiglu_forward_and_per_token_cast` (docs/quant.md, "Fused SwiGLU").

  ``a = RN(act · w)`` (:func:`swiglu_forward`; no product without weights), then a per-token e4m3 cast of
  ``a`` with groups of ``num_per_channels`` (amax clamp minimum ``sf_clamp_min`` or 1e-4). Rows with
  ``pos_to_expert < 0`` are skipped: e4m3 zeros, sf 0 (0.0 / UE8M0 byte 0), not counted. Returns
  ``QuantTensor(data (E, h) e4m3, sf)`` in the layout of the flags, or
  ``QuantTensorWithClampedCount(data, sf, clamped_count + counts)`` when ``clamped_count`` is given.
  """
  del fmt  # e4m3 only
  left, right, flags = _clamp_flags_and_halves(x, swiglu_clamp_value)
  act = _silu_times(left, right)
  if pos_to_token_topk is not None:
    act = act * row_weights(pos_to_token_topk, topk_weights, x.shape[0])[:, None]
  e, h = act.shape
  rows = None if pos_to_expert is None else pos_to_expert >= 0
  if rows is not None:
    act = jnp.where(rows[:, None], act, 0.0)
  amax = abs_max(_blocked(act, 1, num_per_channels), axis=(1, 3))
  sf, inv = scale_factors(amax, FP8_MAX, "e4m3", round_sf, clamp_min=sf_clamp_min)
  if rows is not None:
    sf = jnp.where(rows[:, None], sf, 0.0)
  data = encode_e4m3(canonical_nan(act * _expand(inv, 1, num_per_channels, e, h)))
  sf = format_sf(canonical_nan(sf), use_tma_aligned_col_major_sf, use_packed_ue8m0)
  if clamped_count is None:
    return QuantTensor(data, sf)
  counts = clamped_count if flags is None else _add_counts(clamped_count, flags, rows)
  return QuantTensorWithClampedCount(data, sf, counts)


def swiglu_forward_and_per_channel_cast_and_transpose(x: jax.Array, fmt: str, num_per_tokens: int, *,
                                                      round_sf: bool = False, without_transpose: bool = False,
                                                      swiglu_clamp_value: float | None = None):
  """Reference of :func:`jaxkern.quant.swiglu_forward_and_per_channel_cast_and_transpose` (docs/quant.md, "Fused SwiGLU").

  ``act`` of ``x`` ``(M, 2h)`` bf16 as :func:`swiglu_forward` (float32, clamp in float32, no weights), rounded to
  bf16 (round to nearest even; :func:`jax.lax.reduce_precision`, which XLA keeps, where a bf16 round trip inside
  one jit may be dropped), then :func:`per_channel_cast` of that with blocks ``(num_per_tokens, 1)``. Returns
  ``QuantTensor(data (h, M) e4m3, or (M, h) with without_transpose, sf (M/num_per_tokens, h) float32)``.
  """
  act = lax.reduce_precision(swiglu_forward(x, swiglu_clamp_value=swiglu_clamp_value), exponent_bits=8,
                             mantissa_bits=7)
  data, sf = _per_channel(act, fmt, num_per_tokens, round_sf)
  return QuantTensor(data if without_transpose else data.T, sf)


def swiglu_rows(x: jax.Array, num_per_channels: int):
  """The float32 rows ``(E, 2h)`` of the SwiGLU backward input: a QuantTensor ``(q, sf)`` (``q`` e4m3
  ``(..., 2h)`` flattened to rows, ``sf`` float32 layout A ``(E, 2h/npc)``) dequantised as
  ``RN(f32(q) · sf)``, or a plain float array ``(..., 2h)`` widened to float32."""
  if isinstance(x, tuple):
    q, sf = x
    q = q.reshape(-1, q.shape[-1])
    return q.astype(jnp.float32) * jnp.repeat(sf.astype(jnp.float32), num_per_channels, axis=1)
  return x.reshape(-1, x.shape[-1]).astype(jnp.float32)


def scatter_weight_grad(dots: jax.Array, pos_to_token_topk: jax.Array, shape: tuple[int, ...]):
  """``weight_grad`` ``shape`` float32: zeros, plus ``dots[p]`` at flat slot ``pos_to_token_topk[p]`` for every
  row with a non-negative slot (rows naming the same slot add up; an index past the end is dropped)."""
  size = int(np.prod(shape))
  pos = pos_to_token_topk.astype(jnp.int32)
  idx = jnp.where(pos >= 0, pos, size)
  return jnp.zeros((size,), jnp.float32).at[idx].add(dots.astype(jnp.float32), mode="drop").reshape(shape)


def swiglu_backward(x: jax.Array, grad_out: jax.Array, weight: jax.Array, pos_to_token_topk: jax.Array,
                    token_topk_to_pos: jax.Array, num_per_channels: int, swiglu_clamp_value: float | None = None):
  """The upstream reference ``swiglu_backward`` (docs/quant.md, "Fused SwiGLU"): the SwiGLU backward in float32.

  Args:
    x: QuantTensor ``(q, sf)``: ``q`` float8_e4m3fn ``(E, 2h)`` (or ``(..., 2h)``, flattened to rows), ``sf``
      float32 layout A ``(E, 2h/num_per_channels)``; or a plain ``(E, 2h)`` float array (the dequantised values).
    grad_out: ``(E, h)`` (or ``(..., h)``) cotangent of the weighted activation.
    weight: ``(T, k)`` float32 top-k weights; row ``p`` uses ``weight.reshape(-1)[pos_to_token_topk[p]]``, 0 where
      that index is negative.
    pos_to_token_topk: ``(E,)`` int32.
    token_topk_to_pos: ``(T, k)`` int32; only its shape is used (the mapping pair is assumed mutually inverse).
    num_per_channels: the columns per sf of ``x`` (a QuantTensor).
    swiglu_clamp_value: the clamp ``C`` or None.

  Returns:
    ``(out, x_grad, weight_grad)``: ``out`` ``(E, h)`` float32 = ``RN(act · w)``; ``x_grad`` ``(E, 2h)`` float32
    ``[dx | dy]``; ``weight_grad`` ``(T, k)`` float32, ``Σ_c f32(grad_out) · act`` (unweighted act) scattered to
    each row's slot (:func:`scatter_weight_grad`), zero elsewhere. Per element, each step one IEEE rounding:
    ``t = 1 + exp(-x)``, ``act = (x / t) · y``, ``s = 1 / t``, ``gw = (g · w) · s``,
    ``dx = (gw · y) · fma(x, 1 - s, 1)`` (0 where ``x > C``), ``dy = gw · x`` (0 where ``|y| > C``), with ``x``,
    ``y`` the left and right halves after the clamp (``x`` to ``C`` from above, ``y`` to ``[-C, C]``).
  """
  del token_topk_to_pos  # only its shape matters (the checks of the op)
  v = swiglu_rows(x, num_per_channels)
  e, h = v.shape[0], v.shape[1] // 2
  xv, yv = v[:, :h], v[:, h:]
  g = grad_out.reshape(-1, h).astype(jnp.float32)
  if swiglu_clamp_value is not None:
    c = float(np.float32(swiglu_clamp_value))
    cx, cyu, cyl = xv > c, yv > c, yv < -c
    xv = jnp.where(cx, c, xv)
    yv = jnp.where(cyu, c, jnp.where(cyl, -c, yv))
  w = row_weights(pos_to_token_topk, weight, e)[:, None]
  t = 1.0 + jnp.exp(-xv)
  act = ieee.div(xv, t) * yv
  s = ieee.div(1.0, t)
  gw = (g * w) * s
  dx = (gw * yv) * ieee.fma(xv, 1.0 - s, 1.0)
  dy = gw * xv
  if swiglu_clamp_value is not None:
    dx = jnp.where(cx, 0.0, dx)
    dy = jnp.where(cyu | cyl, 0.0, dy)
  weight_grad = scatter_weight_grad(jnp.sum(g * act, axis=1), pos_to_token_topk, weight.shape)
  return act * w, jnp.concatenate([dx, dy], axis=1), weight_grad


def swiglu_backward_and_per_token_cast(x: jax.Array, grad_out: jax.Array, weight: jax.Array,
                                       pos_to_token_topk: jax.Array, token_topk_to_pos: jax.Array,
                                       num_per_channels: int, *, round_sf: bool = False,
                                       swiglu_clamp_value: float | None = None) -> SwigluBackward:
  """Reference of :func:`jaxkern.quant.swiglu_backward_and_per_token_cast` (docs/quant.md, "Fused SwiGLU"): :func:`swiglu_backward`,
  then ``out`` and ``x_grad`` rounded to bfloat16 and the per-token e4m3 cast (groups of ``num_per_channels``,
  layout A, ``round_sf``) of the float32 ``x_grad``."""
  out, x_grad, weight_grad = swiglu_backward(x, grad_out, weight, pos_to_token_topk, token_topk_to_pos,
                                             num_per_channels, swiglu_clamp_value=swiglu_clamp_value)
  q, sf = cast(x_grad, "e4m3", (1, num_per_channels), round_sf=round_sf)
  return SwigluBackward(out.astype(jnp.bfloat16), QuantTensor(q, sf), x_grad.astype(jnp.bfloat16), weight_grad)

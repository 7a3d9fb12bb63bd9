"""E5M6 casts (quant.md §4.6, §5.4, §9.3): ``per_token_cast_to_e5m6`` and ``cast_back_e5m6``.

E5M6 is a 12-bit format (the top 12 bits of an fp16 pattern) with no hardware conversion, so both
kernels are integer bit manipulation on float32 patterns (shifts, and/or, selects, bitcasts), which
Mosaic GPU lowers like any other elementwise operation: the encoder is the spec's recipe itself
(:func:`jaxkern.reference.quant.encode_e5m6`: fp16 round toward zero, then the 17-bit drop rule), the
packing and unpacking of 8 codes into three uint32 words are
:func:`jaxkern.reference.quant.e5m6_words` / :func:`jaxkern.reference.quant.e5m6_codes`.

Both Mosaic GPU kernels view a row as groups of 8 columns: the encoder reads the input as ``(M, K/8, 8)``
float32 patterns (bf16 as ``(M, K/8, 4)`` int32 pairs) and writes ``(M, K/8, 3)`` words; the decoder
reads the words and writes ``(M, K/8, 8)`` float32 (bf16 as int32 pairs). Each of those is a strided
GMEM load / store of one element per thread vector in :func:`jaxkern._layouts.row_layout` (whole warps
per row), straight between GMEM and registers, so any row count runs without padding (inputs of
fewer rows than one layout block are padded); the last CTA's rows are moved back to end at the last
row, as in :mod:`jaxkern.quant._per_token_cast`. The encoder reduces the row's ``|x|`` (one sf per
row: ``num_per_channels == K``), computes the sf with correctly rounded divisions
(:func:`jaxkern._ieee.exact_div`) and writes it as float32 ``(1, M)``, which XLA formats into layout
A / B / C (``M`` values). The decoder reads one sf per row in the kernel (layout A / B float32, or the
UE8M0 byte of a packed layout-C word) and decodes the codes with integer operations (no fp16 in the
kernel): a normal code is the float32 pattern ``sign | (e + 112) << 23 | m << 17``, a subnormal one
``m · 2^-20``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _autodiff, _checks, _config, _dispatch, _ieee
from jaxkern._layouts import row_layout
from jaxkern.quant import _tiling as tiling
from jaxkern.quant import _validate as validate
from jaxkern.quant._cast_back import _sf_decode, _sf_raw
from jaxkern.quant._per_token_cast import abs_key, gpu_nan, key_value
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor


def _group_layout(k: int):
  """Register layout of one strided column of the ``(rows, K/8, n)`` group view (one element per vector,
  whole warps per row) and the rows it covers."""
  return row_layout(k // 8, 16)


def _tile(m: int, k: int, unit: int):
  """Rows per CTA and CTAs for ``m`` rows (at least ``unit``) of ``k`` float32-sized values."""
  rt = tiling.tile_rows(m, k, 4, unit)
  return rt, pl.cdiv(m, rt)


def _pad_rows(a, rows: int):
  return jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1)) if rows > a.shape[0] else a


def _split_bf16(u):
  """int32 words of two bf16 (element ``2j`` in the low half) -> their two float32 values."""
  return lax.bitcast_convert_type(u << 16, jnp.float32), lax.bitcast_convert_type(u & jnp.int32(-65536), jnp.float32)


def _join_bf16(lo, hi):
  """Two float32 arrays -> int32 words of their bf16 roundings (``lo`` in the low half)."""
  lo, hi = (lax.bitcast_convert_type(h.astype(jnp.bfloat16).astype(jnp.float32), jnp.int32) for h in (lo, hi))
  return lax.shift_right_logical(lo, 16) | hi


@functools.partial(jax.jit, static_argnames=("round_sf", "col_major", "packed", "interpret"))
def _encode_kernel(x, *, round_sf, col_major, packed, interpret):
  """``x`` ``(M, K)`` bf16 / float32 -> ``(packed (M, 3K/2) uint8, sf in layout A / B / C)``."""
  m, k = x.shape
  g = k // 8
  lay, unit = _group_layout(k)
  bf16 = x.dtype == jnp.bfloat16
  xv = lax.bitcast_convert_type(x.reshape(m, k // 2, 2), jnp.int32) if bf16 else x
  xv = _pad_rows(xv.reshape(m, g, 4 if bf16 else 8), unit)
  r = xv.shape[0]
  rt, num_ctas = _tile(r, k, unit)

  @functools.partial(plgpu.kernel, out_type=(jax.ShapeDtypeStruct((r, g, 3), jnp.int32),
                                             jax.ShapeDtypeStruct((1, r), jnp.float32)),
                     grid=(num_ctas,), grid_names=("i",), interpret=interpret)
  def kernel(x_g, c_g, o_g, sf_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, r - rt), rt)
    cols = [plgpu.load(x_g.at[rows, pl.ds(0, g), j], layout=lay, optimized=False) for j in range(xv.shape[2])]
    vals = [h for u in cols for h in _split_bf16(u)] if bf16 else cols
    amax = key_value(functools.reduce(jnp.maximum, [jnp.max(abs_key(v, interpret), axis=1) for v in vals]),
                     interpret)
    sf, inv = ref.scale_factors(amax, c_g[0], "e5m6", round_sf, div=_ieee.exact_div)
    sf_g[0, rows] = gpu_nan(sf, interpret)
    codes = [ref.encode_e5m6(gpu_nan(v * inv[:, None], interpret)) for v in vals]
    for j, w in enumerate(ref.e5m6_words(codes)):
      o_g[rows, pl.ds(0, g), j] = w

  # The largest value as a one-element host constant, loaded in the kernel (not folded in interpret mode).
  words, sf = kernel(xv, np.full((1,), ref.E5M6_MAX, np.float32))
  data = lax.bitcast_convert_type(words[:m], jnp.uint8).reshape(m, 3 * k // 2)
  return data, ref.format_sf(sf[0, :m, None], col_major, packed)


def _decode(t):
  """E5M6 codes (int32) -> float32 with integer operations: normal and inf / NaN codes as the float32
  pattern ``sign | E << 23 | m << 17`` (``E = e + 112``, 255 for ``e = 31``), subnormal ones ``m · 2^-20``."""
  e = (t >> 6) & 0x1F
  m = t & 0x3F
  normal = (jnp.where(e == 31, 255, e + 112) << 23) | (m << 17)
  subnormal = lax.bitcast_convert_type(m.astype(jnp.float32) * jnp.float32(2.0**-20), jnp.int32)
  return lax.bitcast_convert_type(((t & 0x800) << 20) | jnp.where(e == 0, subnormal, normal), jnp.float32)


@functools.partial(jax.jit, static_argnames=("out_dtype", "col_major", "interpret"))
def _decode_kernel(q, sf, *, out_dtype, col_major, interpret):
  """``q`` ``(M, 3K/2)`` uint8 with one sf per row (layout A ``(M, 1)``, B ``(1, Mp)``, C ``(1, Mp)`` int32)
  -> ``(M, K)`` ``out_dtype``."""
  m, n = q.shape
  k, g = 2 * n // 3, n // 12
  lay, unit = _group_layout(k)
  words = _pad_rows(lax.bitcast_convert_type(q.reshape(m, g * 3, 4), jnp.int32).reshape(m, g, 3), unit)
  r = words.shape[0]
  mode = "packed" if sf.dtype == jnp.int32 else "rows"
  sf = sf if col_major or mode == "packed" else sf.reshape(1, m)
  sf = jnp.pad(sf, ((0, 0), (0, max(0, r - sf.shape[1]))))
  rt, num_ctas = _tile(r, k, unit)
  bf16 = out_dtype == jnp.bfloat16
  out_type = jax.ShapeDtypeStruct((r, g, 4), jnp.int32) if bf16 else jax.ShapeDtypeStruct((r, g, 8), jnp.float32)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(num_ctas,), grid_names=("i",), interpret=interpret)
  def kernel(w_g, sf_g, o_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, r - rt), rt)
    scale = _sf_decode(_sf_raw(sf_g, mode, 0, rows, lay.reduce(1)), mode, 0)[:, None]
    w = [plgpu.load(w_g.at[rows, pl.ds(0, g), j], layout=lay, optimized=False) for j in range(3)]
    vals = [gpu_nan(_decode(t) * scale, interpret) for t in ref.e5m6_codes(*w)]
    if bf16:
      for j in range(4):
        o_g[rows, pl.ds(0, g), j] = _join_bf16(vals[2 * j], vals[2 * j + 1])
    else:
      for j, v in enumerate(vals):
        o_g[rows, pl.ds(0, g), j] = v

  out = kernel(words, sf)[:m]
  if bf16:
    out = lax.bitcast_convert_type(out, jnp.bfloat16)
  return out.reshape(m, k)


def _check_cast(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  _checks.check_multiple("x", x, 1, 8)
  if num_per_channels != x.shape[1]:
    raise ValueError(f"num_per_channels must equal K={x.shape[1]} (one sf per row), got {num_per_channels}")
  validate.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  return x


def per_token_cast_to_e5m6(x, num_per_channels: int, *, use_tma_aligned_col_major_sf: bool = False,
                           round_sf: bool = False, use_packed_ue8m0: bool = False,
                           implementation: str | None = None) -> QuantTensor:
  """Row-wise cast to packed 12-bit E5M6, one scale per row (quant.md §5.4); also reached as
  ``per_token_cast(x, "e5m6", K, ...)``.

  Args:
    x: ``(M, K)`` bfloat16 / float32 array (or nested list), ``K % 8 == 0``.
    num_per_channels: must equal ``K``.
    use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: output sf layout B / power-of-two sf /
      packed UE8M0 layout C (:mod:`jaxkern.reference.quant`); packed needs the other two.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``QuantTensor(data, sf)``: ``data`` ``(M, 3K/2)`` uint8, the little-endian bytes of three uint32 words
    per 8 columns holding their E5M6 codes (``s eeeee mmmmmm``, bias 15) big-endian (quant.md §4.6);
    ``sf`` (max value 65024, clamp minimum 1e-4) layout A ``(M, 1)`` float32, B ``(1, align(M, 4))``
    float32 or C ``(1, align(M, 4))`` int32. Codes are the spec's recipe bit for bit: fp16 round toward
    zero, then ``+1`` where ``(code & 1) + (low 17 bits of x · sf_inv) > 0x10000`` (round to nearest even
    above 2^-14 relative to 65024·sf, the spec's quirk below).

  Raises:
    ValueError: another rank or dtype of ``x``, ``K % 8 != 0``, ``num_per_channels != K``, packed without
      column-major and ``round_sf``.

  Mosaic GPU kernel (module docstring); XLA (the reference) for zero rows. Non-finite inputs as
  :func:`jaxkern.quant.per_token_cast` (NaN-propagating amax, canonical NaN results; a NaN product
  encodes as 0x800 by the recipe, ±inf saturated products as ±0x7C0), identical on every backend.

  Differentiation: not differentiable; ``jax.grad`` / ``jax.jvp`` through it raise
  :class:`jaxkern.NotDifferentiableError`. Apply it to ``jax.lax.stop_gradient(x)``, or wrap it in the
  ``jax.custom_vjp`` you want (e.g. straight-through).
  """
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
               use_packed_ue8m0=use_packed_ue8m0)
  x = validate.guard("per_token_cast_to_e5m6", _check_cast(x, num_per_channels, **flags))

  def kernel(interpret):
    return QuantTensor(*_encode_kernel(x, round_sf=round_sf, col_major=use_tma_aligned_col_major_sf,
                                       packed=use_packed_ue8m0, interpret=_config.mosaic_interpret(interpret)))

  return _dispatch.run("per_token_cast_to_e5m6", implementation, kernel=kernel,
                       xla=lambda: ref.per_token_cast_to_e5m6(x, num_per_channels, **flags), empty=x.shape[0] == 0)


def _check_back(x, fmt, x_block_size, col_major):
  """Checks the QuantTensor of :func:`cast_back_e5m6`; returns it as arrays and the logical width ``K``."""
  if not (isinstance(x, tuple) and len(x) == 2):
    raise ValueError("x must be a QuantTensor (data, sf)")
  q, sf = _checks.as_array("x[0]", x[0]), _checks.as_array("x[1]", x[1])
  _checks.check_rank("x[0]", q, 2)
  _checks.check_dtype("x[0]", q, (jnp.uint8,))
  _checks.check_multiple("x[0]", q, 1, 12)
  validate.check_fmt(fmt, ("bf16", "fp32"))
  if x_block_size is None or len(x_block_size) != 2 or min(x_block_size) < 1:
    raise ValueError(f"x_block_size must be a pair of positive ints, got {x_block_size}")
  _checks.check_rank("x[1]", sf, 2)
  _checks.check_dtype("x[1]", sf, (jnp.float32, jnp.int32))
  m, k = q.shape[0], 2 * q.shape[1] // 3
  packed = sf.dtype == jnp.int32
  want = validate.sf_shape(ref.cdiv(m, x_block_size[0]), ref.cdiv(k, x_block_size[1]), col_major=col_major or packed,
                           packed=packed)
  if tuple(sf.shape) != want:
    raise ValueError(f"x[1] (sf) must have shape {want} for blocks {tuple(x_block_size)}, got {tuple(sf.shape)}")
  return QuantTensor(q, sf), k


def cast_back_e5m6(x, fmt: str, x_block_size, *, x_use_tma_aligned_col_major_sf: bool = False,
                   implementation: str | None = None) -> jax.Array:
  """Dequantises packed E5M6 ``(q, sf)`` (quant.md §9.3): ``RN(decode(code) · sf)`` in float32, then one
  rounding to bf16 for ``fmt="bf16"``; also reached as ``cast_back(x, fmt, x_block_size, x_special_fmt="e5m6")``.

  Args:
    x: QuantTensor (or plain pair) ``(q, sf)``: ``q`` ``(M, 3K/2)`` uint8 as written by
      :func:`per_token_cast_to_e5m6` (``K % 8 == 0``); ``sf`` for ``ceil(M/bm) x ceil(K/bk)`` blocks in layout
      A (float32), B (float32, ``x_use_tma_aligned_col_major_sf=True``) or C (int32 packed UE8M0).
    fmt: ``"bf16"`` or ``"fp32"``, the output dtype.
    x_block_size: ``(bm, bk)``, positive ints; ``(1, K)`` is the per-token cast's.
    x_use_tma_aligned_col_major_sf: a float32 ``sf`` is column-major (layout B).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(M, K)`` bfloat16 or float32. NaN results are the canonical NaN 0x7FFFFFFF on every backend.

  Raises:
    ValueError: ``x`` not a pair of arrays, ``q`` not rank-2 uint8 with a multiple of 12 columns, an ``sf``
      of another dtype, rank or shape for the blocks and layout, another ``fmt``, non-positive block sides.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` for blocks other than one sf
      per row (``bm == 1``, ``bk >= K``).

  Mosaic GPU kernel for one sf per row (module docstring); XLA (the reference) for other blocks and
  zero-size arrays.

  Differentiation: not differentiable (its input is quantised data): ``jax.grad`` / ``jax.jvp`` through
  ``sf`` raise :class:`jaxkern.NotDifferentiableError`; pass it through ``jax.lax.stop_gradient``.
  """
  col_major = x_use_tma_aligned_col_major_sf
  x, k = _check_back(x, fmt, x_block_size, col_major)
  block = tuple(int(b) for b in x_block_size)
  x = validate.guard("cast_back_e5m6", x, advice=_autodiff.DEQUANT_ADVICE)
  out_dtype = jnp.bfloat16 if fmt == "bf16" else jnp.float32
  unsupported = None if block[0] == 1 and block[1] >= k else f"blocks {block} (the kernel reads one sf per row)"

  def kernel(interpret):
    return _decode_kernel(*x, out_dtype=out_dtype, col_major=col_major, interpret=_config.mosaic_interpret(interpret))

  return _dispatch.run("cast_back_e5m6", implementation, kernel=kernel,
                       xla=lambda: ref.cast_back_e5m6(x, fmt, block, x_use_tma_aligned_col_major_sf=col_major),
                       unsupported=unsupported, empty=x[0].size == 0)

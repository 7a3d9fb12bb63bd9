"""Tiled 2-D and batched transposes as Mosaic GPU kernels.

One CTA (one warpgroup) per ``(BM, BN)`` tile: a TMA copy brings the tile into
SMEM, it is loaded into registers in the WGMMA layout, re-laid out to
``WGMMA_TRANSPOSED`` (a lane shuffle), stored through a transposed view of an
output SMEM buffer and written back with a TMA copy. The layout change works on
16- and 32-bit registers, so 8-bit data is widened to int16 and narrowed back,
which keeps every bit pattern (NaN payloads included). Small 2-D 16-bit
transposes instead load the tile through a transposed view of the input SMEM
buffer straight into the WGMMA layout (1.5% faster on an H200 at N = 576, where
the kernel is latency-bound; equal or slower elsewhere).

Mid-sized 2-D 16-bit transposes move the tile between GMEM and SMEM with plain
16-byte vector loads and stores instead of TMA: on an H200 that was 1-4.5% faster
there (and about the speed of XLA's transpose), while TMA stays faster for large
arrays and for other dtypes.

Large 2-D 8-bit transposes (:func:`_byte_pairs_kernel`) skip the widening: the array is
viewed as 16-bit words, each holding two neighbouring bytes of a row, and the two row
parities as separate planes, so that a 2x2 block of bytes is two words, one per plane.
Swapping bytes between the planes (shifts and masks) transposes every 2x2 block, and a
16-bit transpose of each plane moves the blocks: 3-6% faster than the widening kernel on
an H200 from 8 MB up (8064x7168: 30.1 against 31.1 µs), slower below.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _layouts
from jaxkern.reference import transpose as ref

ALIGNMENT = 64  # both transposed dimensions must be multiples of this
_LARGE_BYTES = 32 << 20  # input size above which the tiling favours bandwidth over latency
_DIRECT_BYTES = (12 << 20, 64 << 20)  # 2-D 16-bit inputs in this range skip TMA


def _tiling(b: int, m: int, n: int, itemsize: int) -> tuple[int, int, str, bool]:
  """Tile ``(BM, BN)``, grid order and whether to skip TMA, chosen from measurements on an H200.

  Tiles are 128 wide where the dimension allows it (at most 32 KiB per tile), except
  for small 16/32-bit arrays, which are latency-bound and run fastest with the most
  CTAs (64x64). Large arrays walk the output's rows first, which keeps DRAM pages open.
  """
  nbytes = b * m * n * itemsize
  if b == 1 and itemsize == 2 and _DIRECT_BYTES[0] < nbytes <= _DIRECT_BYTES[1]:
    return 64, 64, "bji", True
  small = nbytes <= _LARGE_BYTES
  if small and itemsize > 1:
    return 64, 64, "bij", False
  bm = 128 if m % 128 == 0 else 64
  bn = 128 if n % 128 == 0 and itemsize <= 2 else 64
  return bm, bn, "bij" if small else "bji", False


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def _batched_transpose_kernel(x: jax.Array, interpret=None, tiling=None) -> jax.Array:
  b, m, n = x.shape
  bm, bn, order, direct = tiling or _tiling(b, m, n, x.dtype.itemsize)
  widen = x.dtype.itemsize == 1
  load_t = b == 1 and x.dtype.itemsize == 2 and (bm, bn) == (64, 64) and not direct
  sizes = {"b": b, "i": m // bm, "j": n // bn}
  scratch = dict(x_s=plgpu.SMEM((bm, bn), x.dtype), o_s=plgpu.SMEM((bn, bm), x.dtype))
  if not direct:
    scratch["bar"] = plgpu.Barrier(num_arrivals=1)

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((b, n, m), x.dtype),
      grid=tuple(sizes[a] for a in order),
      grid_names=tuple(order),
      scratch_types=scratch,
      interpret=interpret,
  )
  def kernel(x_g, o_g, x_s, o_s, bar=None):
    bi, i, j = lax.axis_index("b"), lax.axis_index("i"), lax.axis_index("j")
    src = x_g.at[bi, pl.ds(i * bm, bm), pl.ds(j * bn, bn)]
    dst = o_g.at[bi, pl.ds(j * bn, bn), pl.ds(i * bm, bm)]
    if direct:
      x_s[...] = plgpu.load(src, layout=_layouts.row_layout(bn, x.dtype.itemsize)[0], optimized=False)
    else:
      plgpu.copy_gmem_to_smem(src, x_s, bar)
      plgpu.barrier_wait(bar)
    if load_t:
      o_s[...] = plgpu.load(x_s.T, layout=plgpu.Layout.WGMMA)
    else:
      v = plgpu.load(x_s, layout=plgpu.Layout.WGMMA)
      if widen:
        v = lax.bitcast_convert_type(v, jnp.int8).astype(jnp.int16)
      v = plgpu.layout_cast(v, plgpu.Layout.WGMMA_TRANSPOSED)
      if widen:
        v = lax.bitcast_convert_type(v.astype(jnp.int8), x.dtype)
      o_s.T[...] = v
    if direct:
      dst[...] = plgpu.load(o_s, layout=_layouts.row_layout(bm, x.dtype.itemsize)[0])
    else:
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, dst)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return kernel(x)


_PAIRS_BYTES = 8_000_000  # 2-D 8-bit inputs from this size on take the byte-pair kernel
_PAIRS_ROWS = 64  # word rows (two input rows each) per CTA of the byte-pair kernel


def _pairs_cols(nbytes: int) -> int:
  """Word columns (two input columns each) per CTA of the byte-pair kernel; H200, µs for 64 / 128:
  4032x2048 6.32 / 6.46, 8064x2048 10.05 / 9.92, 8064x7168 30.48 / 30.14."""
  return 128 if nbytes >= 2 * _PAIRS_BYTES else 64


def _use_pairs(x) -> bool:
  m, n = x.shape
  return x.dtype.itemsize == 1 and x.size >= _PAIRS_BYTES and m >= 2 * _PAIRS_ROWS and n >= 2 * _pairs_cols(x.size)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _byte_pairs_kernel(x: jax.Array, interpret=None) -> jax.Array:
  """8-bit ``(M, N) -> (N, M)`` through 2x2 byte blocks (see the module docstring).

  ``w`` int16 ``(M/2, 2, N/2)``: ``w[r, k, c]`` holds bytes ``x[2r+k, 2c]`` (low) and ``x[2r+k, 2c+1]``.
  For planes ``w0 = w[:, 0]``, ``w1 = w[:, 1]``, the output words ``y[c, k', r]`` (bytes ``x[2r, 2c+k']``
  and ``x[2r+1, 2c+k']``) are ``t0 = lo(w0) | lo(w1) << 8`` and ``t1 = hi(w0) | hi(w1) << 8``
  transposed. A CTA takes ``bw x cw`` words of each plane (two TMA copies), loads them in the WGMMA
  layout, combines them, re-lays the results out to WGMMA_TRANSPOSED and stores them through
  transposed views of an SMEM buffer, written back with two TMA copies. The last row / column tile
  is moved back to end at the edge (it rewrites some words with the same values).
  """
  m, n = x.shape
  mw, nw = m // 2, n // 2
  bw, cw = _PAIRS_ROWS, _pairs_cols(x.size)
  w = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint8).reshape(m, nw, 2), jnp.int16)

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((nw, 2, mw), jnp.int16),
      grid=(pl.cdiv(nw, cw), pl.cdiv(mw, bw)),
      grid_names=("j", "i"),
      scratch_types=dict(x_s=plgpu.SMEM((2, bw, cw), jnp.int16), o_s=plgpu.SMEM((2, cw, bw), jnp.int16),
                         bar=plgpu.Barrier(num_arrivals=2)),
      interpret=interpret,
  )
  def kernel(w_g, o_g, x_s, o_s, bar):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * bw, mw - bw), bw)
    cols = pl.ds(jnp.minimum(lax.axis_index("j") * cw, nw - cw), cw)
    for k in range(2):
      plgpu.copy_gmem_to_smem(w_g.at[rows, k, cols], x_s.at[k], bar)
    plgpu.barrier_wait(bar)
    w0, w1 = (plgpu.load(x_s.at[k], layout=plgpu.Layout.WGMMA) for k in range(2))
    t0 = (w0 & 0xFF) | lax.shift_left(w1, jnp.int16(8))
    t1 = lax.shift_right_logical(w0, jnp.int16(8)) | (w1 & jnp.int16(-256))
    for k, t in enumerate((t0, t1)):
      o_s.at[k].T[...] = plgpu.layout_cast(t, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    for k in range(2):
      plgpu.copy_smem_to_gmem(o_s.at[k], o_g.at[cols, k, rows])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  y = kernel(w.reshape(mw, 2, nw)).reshape(n, mw)
  return lax.bitcast_convert_type(lax.bitcast_convert_type(y, jnp.uint8).reshape(n, m), x.dtype)


def _check(name: str, x, ndim: int) -> None:
  _checks.check_rank(name, x, ndim)
  if x.dtype.itemsize not in (1, 2, 4):
    raise ValueError(f"{name} must have a 1-, 2- or 4-byte dtype, got {x.dtype}")
  _checks.check_multiple(name, x, -2, ALIGNMENT)
  _checks.check_multiple(name, x, -1, ALIGNMENT)


def batched_transpose(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """Swaps the last two axes: ``(B, M, N) -> (B, N, M)``, bit-exact.

  Args:
    x: ``(B, M, N)`` array of any 1-, 2- or 4-byte dtype (float8_e4m3fn, bfloat16,
      float32, ints, ...); ``M`` and ``N`` must be multiples of 64.
    implementation: see :mod:`jaxkern._config`.

  Returns:
    ``(B, N, M)`` array with ``out[b, j, i] = x[b, i, j]``.
  """
  _check("x", x, 3)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or x.size == 0:
    return ref.batched_transpose(x)
  return _batched_transpose_kernel(x, interpret=_config.mosaic_interpret(impl))


def transpose(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """2-D transpose ``(M, N) -> (N, M)``, bit-exact; same constraints as :func:`batched_transpose`."""
  _check("x", x, 2)
  impl = _config.get_implementation(implementation)
  if impl != "reference" and _use_pairs(x):
    return _byte_pairs_kernel(x, interpret=_config.mosaic_interpret(impl))
  return batched_transpose(x[None], implementation=implementation)[0]

"""Per-channel e4m3 casts: one scale per column and group of ``num_per_tokens`` rows (docs/quant.md, "Casts").

One Mosaic GPU kernel (:func:`_kernel`) serves all three ops (bf16 ``per_channel_cast`` and the ``pos_to_token``
gather excepted, below). Each CTA (one warpgroup) owns 128 rows (one group of 128
or four of 32) and 128 columns (64 where 128 does not divide ``K``, e.g. 576), TMA-loaded into SMEM
once and read from there twice, in :func:`jaxkern._layouts.row_layout` (16-byte vectors along a row,
lanes along the columns, the rest of the lanes and the warps down the rows; conflict-free reads):

1. column maxima of ``|x|``: elementwise over 32-row chunks, then one reduction per group (in-thread,
   lane shuffles, SMEM across warps). bf16 stays bf16 (the maximum is exact); a QuantTensor input
   (e4m3 + one float32 sf per row and 128 columns) is dequantised (``RN(q·sf)``) in float32 first;
2. the maxima go through SMEM to one column per thread for the scale factors (correctly rounded
   :func:`jaxkern._ieee.exact_div`; computing them in the reduced layout would repeat every
   column's division on up to 16 threads), written to GMEM and back to SMEM as ``sf_inv``;
3. ``e4m3(RN(v·sf_inv))`` (the GPU conversion saturates: ``|v·sf_inv| <= 448`` up to rounding, so no
   clip), stored straight from registers to GMEM (8 bytes per thread and row); for
   ``per_channel_cast_and_transpose`` instead in the WGMMA layout, re-laid out to WGMMA_TRANSPOSED
   (a lane shuffle on the int16-widened bytes, as in :mod:`jaxkern.transpose`) into SMEM and
   TMA-stored as ``(K, M)``, so the data crosses DRAM once.

H200 (runner, cold L2, 2026-11-22, bf16 ``per_channel_cast`` when it ran this kernel): ``8064x7168`` 45.3 µs (90%
of copy, 2.4x XLA), ``4096x576`` 5.6 µs (1.9x); the previous kernel (WGMMA-layout reductions, 255 registers
avoided by the same one-column-per-thread step) took 72.1 / 10.8 µs. Walking 2 or 4 column tiles per CTA through a
TMA pipeline, 64- or 256-column tiles and the column-major grid order measured equal or slower.

``per_channel_cast`` of a bf16 input runs :func:`_split_register_kernel`: the same three steps with each CTA's
``(128, 128)`` tile (``(128, 64)`` where 128 does not divide ``K``) over two warpgroups of 64 rows (TileKernels runs
256 threads per 128-row tile), loaded straight from GMEM into registers (no TMA, no SMEM copy of the data) and kept
there for step 3; each warp's rows reduce to partial column maxima in-thread and by lane shuffles, the 8 partials
of a column meet in SMEM after one mbarrier, and both warpgroups compute the same scale factors. H200 (2026-11-30,
runner, three runs): ``4096x576`` 4.40-4.45 µs, ``4096x2048`` 8.62-8.74, ``8064x7168`` 43.09-43.33 (TileKernels 4.53 /
8.73 / 46.19). From ``K = 2048`` it replaced a TMA-loaded form of the same steps and that form's persistent grid (a
ring of tiles per CTA), which were level or slower on every shape of the op's grid (:func:`_split_register_kernel`).

The Mosaic GPU kernels take the e4m3 maximum as a one-element constant operand, broadcast in registers
(:func:`_max_operand`): an ``(C,)`` constant became an XLA broadcast kernel before every call. NVIDIA H200 (CUPTI,
cold L2, 2026-11-29), bf16, one warpgroup per tile above ``K = 576``, µs (TileKernels in brackets): ``4096x576``
4.62 (4.53), ``4096x2048`` 9.22 (8.73), ``4096x2560`` 10.82 (10.47), ``4096x3072`` 12.93 (12.27), ``8064x576`` 6.56
(6.30), ``8064x2048`` 15.26 (15.43);
with the ``(C,)`` operand 5.28 / 9.97 at ``4096x576`` / ``4096x2048`` (the kernel 4.58 / 9.28 plus a 0.67 µs
broadcast launch). Measured on the same card and dropped: the two-warpgroup register kernel with 128-column tiles
4.40 at ``4096x576`` but 7.38 at ``8064x576`` and 9.79 at ``4096x2048``; over four warpgroups 5.25 at ``4096x576``.
(These figures predate :func:`_split_register_kernel` as it is now: that earlier two-warpgroup register kernel walked
the column tiles first in its grid, 9.79 µs at ``4096x2048`` against 8.62-8.74 now.)

With a ``pos_to_token`` gather ``per_channel_cast_fused`` runs a Pallas-Triton kernel instead
(:func:`_gather_kernel`): Mosaic GPU has no per-row register gather, and feeding :func:`_kernel`
from an XLA gather (0.77-0.85x XLA) or one-row TMA copies (0.66x) was slower than the XLA reference.
Each program gathers 128 rows x 64 columns with per-row addresses, 4 warps (best of 1/2/4 warps x
32/64/128 columns on an H200). H200 (runner, 24 MoE gathers of 25-29k rows, bf16 and QuantTensor
inputs): 1.89-2.00x XLA, e.g. ``E=32x8 H=7168`` 221 µs (XLA 441). Divisions as in
:mod:`jaxkern.quant._per_token_cast`.

Non-finite inputs give the reference's bits: the column maxima propagate NaN (Mosaic GPU's
``max.NaN``; the Triton kernel compares the int32 bit patterns of ``|v|``, because Pallas-Triton
lowers a float max to the NaN-dropping ``maxnumf``), and the e4m3 conversion is the GPU's saturating
``cvt.rn.satfinite`` (NaN stays NaN). Interpret mode runs XLA on the CPU, whose float max reductions
can drop a NaN and whose e4m3 conversion overflows to NaN: there the kernels compare bit patterns
and clip before converting (:func:`_column_max`, :func:`_e4m3`), as the reference does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern._layouts import NO_AUTO_BARRIERS, row_layout
from jaxkern.quant import _validate as validate
from jaxkern.quant._tiling import BM
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor

_ROWS = 128  # rows per CTA: one group of 128 or four of 32
_CHUNK = 32  # rows per register load in the row layout


def _per_thread(n: int):
  """Layout of an ``(n,)`` vector, one element per thread (for ``n = 64`` threads 64.. repeat 0..)."""
  if n % 128 == 0:
    return plgpu.Layout.WG_STRIDED((n,), vec_size=1)
  assert n == 64, n
  return plgpu.Layout.TILED(mgpu_fa.Tiling(((64,), (32,), (1,))), (-3, mgpu_fa.Replicated(2)), (-2,), -1)


def _e4m3(v, interpret: bool):
  """float32 -> e4m3 as the GPU converts (``cvt.rn.satfinite.e4m3x2.f32`` in Mosaic GPU and Triton):
  round to nearest even, ±448 for larger magnitudes and infinities, NaN stays NaN. Interpret mode
  runs XLA's conversion, which overflows to NaN: there :func:`jaxkern.reference.quant.encode_e4m3`
  clips first, the same function (the kernels skip the clip on the GPU, where it is free)."""
  return ref.encode_e4m3(v) if interpret else v.astype(jnp.float8_e4m3fn)


def _tile_cols(k: int) -> int:
  """Columns per CTA of every per-channel Mosaic GPU kernel: 128 where they divide ``K``, else 64 (e.g. ``K = 576``);
  the measurements that chose them: :func:`_kernel`, :func:`_split_register_kernel`."""
  return 128 if k % 128 == 0 else 64


def _column_max(parts, interpret: bool):
  """Column maxima of non-negative ``(rows, C)`` parts, NaN-propagating: elementwise, then one
  reduction, with the GPU's ``max.NaN``. Interpret mode runs XLA on the CPU, whose float max
  reductions can drop a NaN: there the bit patterns (int16 / int32) are compared, the same order for
  non-negative values with NaN above inf, as the reference does."""
  if not interpret:
    return jnp.max(functools.reduce(jnp.maximum, parts), axis=0)
  dtype = parts[0].dtype
  ints = [lax.bitcast_convert_type(p, {2: jnp.int16, 4: jnp.int32}[dtype.itemsize]) for p in parts]
  return lax.bitcast_convert_type(jnp.max(functools.reduce(jnp.maximum, ints), axis=0), dtype)


def _transposed_e4m3(q):
  """e4m3 ``(64, C)`` in the WGMMA layout -> the same values in the WGMMA_TRANSPOSED layout."""
  w = lax.bitcast_convert_type(q, jnp.int8).astype(jnp.int16)
  w = plgpu.layout_cast(w, plgpu.Layout.WGMMA_TRANSPOSED)
  return lax.bitcast_convert_type(w.astype(jnp.int8), jnp.float8_e4m3fn)


def _max_operand():
  """The e4m3 maximum as a kernel operand (the divisor of :func:`jaxkern._ieee.exact_div` must be one XLA cannot
  fold in interpret mode): a one-element numpy constant, which XLA keeps as a constant buffer. A ``jnp.full`` is
  a broadcast kernel, and XLA rewrites a uniform constant of more than one element into one too
  (``loop_broadcast_fusion``, 0.67 µs before every call on an H200, 2026-11-29)."""
  return np.full((1,), ref.FP8_MAX, np.float32)


def _max_vector(c_g, n: int, layout):
  """The e4m3 maximum as an ``(n,)`` vector in ``layout``, broadcast in registers from the operand ``c_g`` of
  :func:`_max_operand`."""
  return plgpu.layout_cast(jnp.broadcast_to(c_g[0], (n,)), layout)


@functools.partial(jax.jit, static_argnames=("npt", "round_sf", "transpose_out", "interpret"))
def _kernel(x, sf_in=None, *, npt, round_sf, transpose_out=False, interpret=False):
  """Per-channel cast of ``x`` ``(M, K)``, ``M % 128 == 0``, ``K % 64 == 0``; ``sf_in`` float32
  ``(M, K/128)`` makes ``x`` (e4m3) a QuantTensor. Returns ``(out (M, K) e4m3, or (K, M) if
  transpose_out, sf (M/npt, K) float32)``. ``interpret``: Pallas interpret mode (a bool).
  """
  m, k = x.shape
  r = _ROWS
  c = _tile_cols(k)  # (64 / 256 measured no faster on an H200)
  groups, chunk = r // npt, min(_CHUNK, npt)
  lay = row_layout(c, 4 if sf_in is not None else x.dtype.itemsize)[0]  # f32 reductions: 4 per vector
  per_thread = _per_thread(c)
  if transpose_out:
    out_type = jax.ShapeDtypeStruct((k, m), jnp.float8_e4m3fn)
    scratch = dict(o_s=plgpu.SMEM((r // BM, c, BM), jnp.float8_e4m3fn))
  else:
    out_type = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
    scratch = {}
  inputs = [x, _max_operand()]
  if sf_in is not None:
    inputs.append(sf_in)

  @functools.partial(
      plgpu.kernel, grid=(k // c, m // r), grid_names=("j", "i"),
      interpret=_config.mosaic_interpret(interpret),
      out_type=(out_type, jax.ShapeDtypeStruct((m // npt, k), jnp.float32)),
      scratch_types=dict(x_s=plgpu.SMEM((r, c), x.dtype), a_s=plgpu.SMEM((groups, c), jnp.float32),
                         inv_s=plgpu.SMEM((groups, c), jnp.float32), bar=plgpu.Barrier(num_arrivals=1),
                         **scratch))
  def kernel(x_g, c_g, *refs, x_s, a_s, inv_s, bar, o_s=None):
    s_g, o_g, sf_g = refs if sf_in is not None else (None, *refs)
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * c, c)
    plgpu.copy_gmem_to_smem(x_g.at[pl.ds(i * r, r), cols], x_s, bar)
    maxv = _max_vector(c_g, c, per_thread)
    plgpu.barrier_wait(bar)

    def rows(r0, n, layout):  # rows r0..r0+n of the tile: bf16 as is, else float32 (dequantised)
      v = plgpu.load(x_s.at[pl.ds(r0, n)], layout=layout)
      if s_g is not None:
        s = plgpu.load(s_g.at[pl.ds(i * r + r0, n), j * c // 128], layout=layout.reduce(1), optimized=False)
        return v.astype(jnp.float32) * s[:, None]
      return v if v.dtype == jnp.bfloat16 else v.astype(jnp.float32)

    # Column maxima of each group (exact in bf16): elementwise over row chunks, then one reduction
    # (in-thread, shuffles, SMEM across warps).
    for g in range(groups):
      a = _column_max([jnp.abs(rows(g * npt + h, chunk, lay)) for h in range(0, npt, chunk)], interpret)
      a_s[g] = a.astype(jnp.float32)
    plgpu.commit_smem()
    for g in range(groups):  # one column per thread
      sf, inv = ref.scale_factors(plgpu.load(a_s.at[g], layout=per_thread), maxv, "e4m3", round_sf,
                                  div=_ieee.exact_div)
      sf_g[groups * i + g, cols] = sf
      inv_s[g] = inv
    plgpu.commit_smem()
    if transpose_out:  # 64-row halves in the WGMMA layout, re-laid out transposed through SMEM
      col_layout = plgpu.Layout.WGMMA.reduce(0)
      for h in range(r // BM):
        if npt == 128:
          inv = plgpu.load(inv_s.at[0], layout=col_layout)[None, :]
        else:  # rows 0..31 of the half are warps 0-1, rows 32..63 warps 2-3
          top = plgpu.broadcasted_iota(jnp.int32, (BM, c), 0, layout=plgpu.Layout.WGMMA) < 32
          inv = jnp.where(top, plgpu.load(inv_s.at[2 * h], layout=col_layout)[None, :],
                          plgpu.load(inv_s.at[2 * h + 1], layout=col_layout)[None, :])
        v = rows(h * BM, BM, plgpu.Layout.WGMMA).astype(jnp.float32)
        o_s.at[h].T[...] = _transposed_e4m3(_e4m3(v * inv, interpret))
      plgpu.commit_smem()
      for h in range(r // BM):
        plgpu.copy_smem_to_gmem(o_s.at[h], o_g.at[cols, pl.ds(i * r + h * BM, BM)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    else:  # row chunks straight from registers to GMEM
      for g in range(groups):
        inv = plgpu.load(inv_s.at[g], layout=lay.reduce(0), optimized=False)[None, :]
        for h in range(g * npt, (g + 1) * npt, chunk):
          v = rows(h, chunk, lay).astype(jnp.float32)
          o_g[pl.ds(i * r + h, chunk), cols] = _e4m3(v * inv, interpret)

  return kernel(*inputs)


def _elementwise_max(parts, interpret: bool):
  """Elementwise maximum of non-negative float32 arrays, NaN-propagating (as :func:`_column_max`)."""
  if not interpret:
    return functools.reduce(jnp.maximum, parts)
  ints = [lax.bitcast_convert_type(p, jnp.int32) for p in parts]
  return lax.bitcast_convert_type(functools.reduce(jnp.maximum, ints), jnp.float32)


def _warp_column_max(v, interpret: bool):
  """Column maxima over axis 1 of non-negative ``(4, rows, C)`` values, NaN-propagating (as :func:`_column_max`)."""
  if not interpret:
    return jnp.max(v, axis=1)
  ints = lax.bitcast_convert_type(v, {2: jnp.int16, 4: jnp.int32}[v.dtype.itemsize])
  return lax.bitcast_convert_type(jnp.max(ints, axis=1), v.dtype)


def _warp_rows_layout(rows_per_warp: int, width: int, itemsize: int):
  """Register layout of a ``(4, rows_per_warp, width)`` view of a warpgroup's rows: warp ``w`` holds the rows of
  ``[w]``, its lanes 16-byte vectors along a row (as :func:`jaxkern._layouts.row_layout`) and the remaining lanes
  consecutive rows, the rest of the rows in registers; a reduction over axis 1 (column maxima of each warp's rows)
  is in-thread work and lane shuffles, never across warps."""
  vec = 16 // itemsize
  lanes_c = width // vec
  lanes_r = 32 // lanes_c
  tiling = mgpu_fa.Tiling(((4, rows_per_warp, width), (1, rows_per_warp, width), (1, lanes_r, width), (vec,)))
  lay = mgpu_fa.TiledLayout(tiling, (-10,), (-3, -2), -1, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(lay.tiling, lay.warp_dims, lay.lane_dims, lay.vector_dim)


def _cast_warpgroup_rows(v, maxv, o_g, sf_g, part_s, inv_s, joined, *, i, wg, rows, cols, lay, per_thread, round_sf,
                         interpret):
  """The two-warpgroup kernels' steps once warpgroup ``wg`` holds its rows ``v`` (``(4, h/4, c)`` in ``lay``, rows
  ``rows`` and columns ``cols`` of the output): its 4 warps' partial column maxima into ``part_s``, the CTA barrier
  ``joined``, the maxima of all partials one column per thread, the scale factors (warpgroup 0 stores the sf),
  ``sf_inv`` through the warpgroup's row of ``inv_s`` to ``lay``, and its rows cast to e4m3 straight to GMEM."""
  h, c = v.shape[0] * v.shape[1], v.shape[2]
  part_s[pl.ds(wg * 4, 4)] = _warp_column_max(jnp.abs(v), interpret).astype(jnp.float32)
  plgpu.barrier_arrive(joined)
  plgpu.barrier_wait(joined)
  parts = [part_s[t] if interpret else plgpu.load(part_s.at[t], layout=per_thread) for t in range(part_s.shape[0])]
  a = _elementwise_max(parts, interpret)
  sf, inv = ref.scale_factors(a, maxv, "e4m3", round_sf, div=_ieee.exact_div)

  @pl.when(wg == 0)
  def _():
    sf_g[i, cols] = sf

  inv_s[wg] = inv
  plgpu.commit_smem()  # its warpgroup's threads read the row it wrote
  inv = inv_s[wg] if interpret else plgpu.load(inv_s.at[wg], layout=lay.reduce(0).reduce(0), optimized=False)
  q = _e4m3(v.astype(jnp.float32) * inv[None, None, :], interpret)
  if interpret:
    o_g[rows, cols] = q.reshape(h, c)
  else:
    o_g.at[rows, cols].reshape(4, h // 4, c)[...] = q


# :func:`_split_register_kernel` with 128-column tiles where 128 divides ``K`` (:func:`_tile_cols`). With them it
# replaced, from ``K = 2048``, the TMA-loaded form of the same two-warpgroup steps (one 128x128 tile
# per CTA, below 14 Mi elements) and that form's persistent grid (a ring of 3 tiles per CTA, tiles by ticket from 28
# Mi). NVIDIA H200, 2026-11-30 (runner, CUPTI, cold L2, two runs of each alternating in one call), µs, replaced ->
# this kernel: 4096x2048 8.80 / 8.85 -> 8.74 / 8.67, 4096x2560 10.40 / 10.43 -> 10.06 / 10.08, 4096x3072 12.02 /
# 11.94 -> 11.74 / 11.71, 8064x2048 14.64 / 14.56 -> 14.40 / 14.35, 8064x2560 17.66 / 17.68 -> 17.22 / 17.28,
# 8064x3072 20.51 / 20.66 -> 20.16 / 20.18, 8064x7168 43.15 / 43.01 -> 43.33 / 43.09, the other shapes of the
# op's grid within the runs' spread; median vs TileKernels over the 14 shapes 1.048 / 1.027 -> 1.056 / 1.056. Where
# 128 does not divide ``K`` (64-column tiles; median of 20, two rounds): 4096x704 4.96-5.02 -> 4.64-4.69, 8064x2112
# 15.97-16.18 -> 15.84-15.95, 8064x3776 24.88-24.94 -> 25.46-25.57 (the ticket ring 2.5% faster there). 64-column
# tiles at K = 2048-3072 were 2-7% slower than the TMA kernel.


@functools.partial(jax.jit, static_argnames=("round_sf", "interpret"))
def _split_register_kernel(x, *, round_sf, interpret=False):
  """Per-channel cast of a plain bf16 ``x`` ``(M, K)`` (``M % 128 == 0``, ``K % 64 == 0``), one group of 128 rows,
  with each CTA's ``(128, c)`` tile over two warpgroups of 64 rows (256 threads per tile, as TileKernels) held in
  registers: ``(out (M, K) e4m3, sf (M/128, K) float32)``; ``c`` = 128 where it divides ``K``, else 64
  (:func:`_tile_cols`).

  Each warpgroup loads its 64 rows straight from GMEM into registers in :func:`_warp_rows_layout` (warp ``w`` holds
  16 consecutive rows; no TMA, no SMEM copy of the data), reduces each warp's rows to partial column maxima in-thread
  and by lane shuffles and writes its 4 partials to SMEM; after one CTA barrier (an mbarrier, one arrival per
  warpgroup) each warpgroup takes the maximum of the 8 partials one column per thread and computes the scale
  factors (the same bits in both; warpgroup 0 stores the sf), passes ``sf_inv`` through its own SMEM row to its
  layout and casts its rows, still in registers, straight to GMEM. Row tiles are the grid's fastest axis, as
  TileKernels launches its CTAs; no automatic warpgroup barriers. Interpret mode reads and writes the refs whole
  instead of in the layout (the same values).

  NVIDIA H200, 2026-11-29 (runner, CUPTI, cold L2), µs, against the one-warpgroup register kernel it replaced
  (128-column tiles, a 64-column last one; TileKernels in brackets): ``4096x576`` 4.70 -> 4.38 (4.53), ``8064x576``
  6.66 -> 6.33 (6.30); bit-exact on the card, non-finite inputs and ``round_sf`` included. With 128-column tiles
  and a 64-column last one this kernel took 4.38 at ``4096x576`` but 7.20 at ``8064x576``. Row tiles fastest instead
  of column tiles (H200, 2026-11-30, two calls, two runs of each order in each): ``8064x576`` 6.40 / 6.34 / 6.43 /
  6.37 -> 6.11 / 6.19 / 6.26 / 6.14, ``4096x576`` 4.42 / 4.42 / 4.51 / 4.45 -> 4.42 / 4.42 / 4.42 / 4.51. Above
  ``K = 576``: the comment above this function.
  """
  m, k = x.shape
  r, c, nwg = _ROWS, _tile_cols(k), 2
  h = r // nwg  # rows per warpgroup
  lay = _warp_rows_layout(h // 4, c, x.dtype.itemsize)
  per_thread = _per_thread(c)

  @functools.partial(
      plgpu.kernel, grid=(m // r, k // c), grid_names=("i", "j"), num_threads=nwg, thread_name="wg",
      interpret=_config.mosaic_interpret(interpret),
      out_type=(jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m // r, k), jnp.float32)),
      scratch_types=dict(part_s=plgpu.SMEM((4 * nwg, c), jnp.float32), inv_s=plgpu.SMEM((nwg, c), jnp.float32),
                         joined=plgpu.Barrier(num_arrivals=nwg)),
      compiler_params=NO_AUTO_BARRIERS)
  def kernel(x_g, c_g, o_g, sf_g, part_s, inv_s, joined):
    i, j, wg = lax.axis_index("i"), lax.axis_index("j"), lax.axis_index("wg")
    cols, rows = pl.ds(j * c, c), pl.ds(i * r + wg * h, h)
    src = x_g.at[rows, cols]
    v = src[...].reshape(4, h // 4, c) if interpret else plgpu.load(src.reshape(4, h // 4, c), layout=lay,
                                                                    optimized=False)
    maxv = _max_vector(c_g, c, per_thread)
    _cast_warpgroup_rows(v, maxv, o_g, sf_g, part_s, inv_s, joined, i=i, wg=wg, rows=rows, cols=cols, lay=lay,
                         per_thread=per_thread, round_sf=round_sf, interpret=interpret)

  return kernel(x, _max_operand())


_GATHER_WARPS = 4  # warps per program of the gather kernel
_GATHER_COLS = 64  # columns per program of the gather kernel


def _gather_div(a, b, interpret: bool):
  """Correctly rounded ``a / b`` in the gather kernel, non-finite operands included (a NaN or
  infinite amax): ``div.rn.f32`` on the GPU; in interpret mode :func:`jaxkern._ieee.div` for finite
  operands (its domain) and the plain quotient, exact there, for the others."""
  if not interpret:
    return _ieee.triton_div(a, b, interpret=False)
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  finite = jnp.isfinite(a) & jnp.isfinite(b)
  q = _ieee.triton_div(jnp.where(finite, a, 1.0), jnp.where(finite, b, 1.0), interpret=True)
  return jnp.where(finite, q, a / b)


def _gather_kernel_body(pos_ref, x_ref, *refs, rows: int, bk: int, round_sf: bool, interpret: bool):
  sf_in_ref, o_ref, sf_ref = refs if len(refs) == 3 else (None, *refs)
  mo, m = pos_ref.shape[0], x_ref.shape[0]
  i, j = pl.program_id(0), pl.program_id(1)
  r = i * rows + jnp.arange(rows)
  src = plt.load(pos_ref.at[jnp.minimum(r, mo - 1)], mask=r < mo, other=-1)
  ok = (src >= 0) & (src < m)  # out-of-range entries (negative or >= M): zero rows, as the reference
  src = jnp.where(ok, src, 0)
  c = j * bk + jnp.arange(bk)
  v = plt.load(x_ref.at[src[:, None], c[None, :]]).astype(jnp.float32)  # padding rows read row 0
  if sf_in_ref is not None:  # RN(q * sf_in): one input scale per row and 128 columns
    v = v * plt.load(sf_in_ref.at[src, j * bk // 128])[:, None]
  v = jnp.where(ok[:, None], v, 0.0)
  # Pallas-Triton lowers float max to maxnumf, which drops NaN; the reference's max propagates it.
  # |v| >= 0 orders as its int32 bit pattern, NaN above inf: an integer max propagates NaN at the
  # same cost. The clamp inside scale_factors is such a max too: the division puts a NaN amax back.
  amax = lax.bitcast_convert_type(jnp.max(lax.bitcast_convert_type(jnp.abs(v), jnp.int32), axis=0), jnp.float32)
  nan = amax != amax
  keep_nan = lambda t: t if isinstance(t, float) else jnp.where(nan, amax, t)
  sf, inv = ref.scale_factors(amax, ref.FP8_MAX, "e4m3", round_sf,
                              div=lambda a, b: _gather_div(keep_nan(a), keep_nan(b), interpret))
  sf_ref[i, pl.ds(j * bk, bk)] = sf
  plt.store(o_ref.at[r[:, None], c[None, :]], _e4m3(v * inv[None, :], interpret), mask=(r < mo)[:, None])


@functools.partial(jax.jit, static_argnames=("round_sf", "interpret"))
def _gather_kernel(x, sf_in, pos_to_token, *, round_sf, interpret):
  """Per-channel cast of the rows ``x[pos_to_token]`` (zero rows where negative or ``>= M``):
  ``(out (Mo, K) e4m3, sf (ceil(Mo/128), K) float32)``.

  Pallas-Triton: a program gathers a (128, 128) tile (64 columns where 128 does not divide ``K``)
  of whole row segments with per-row addresses, keeps it in registers for the column maxima and the
  cast, so every gathered byte crosses DRAM once. Mosaic GPU has no per-row register gather."""
  mo, k = pos_to_token.shape[0], x.shape[1]
  rows, bk = 128, _GATHER_COLS
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * len(a.shape))
  inputs = [pos_to_token, x] + ([sf_in] if sf_in is not None else [])
  out_shape = (jax.ShapeDtypeStruct((mo, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((pl.cdiv(mo, rows), k), jnp.float32))
  return pl.pallas_call(
      functools.partial(_gather_kernel_body, rows=rows, bk=bk, round_sf=round_sf, interpret=interpret),
      out_shape=out_shape, grid=(pl.cdiv(mo, rows), k // bk), in_specs=[whole(a) for a in inputs],
      out_specs=[whole(o) for o in out_shape],
      compiler_params=plt.CompilerParams(num_warps=_GATHER_WARPS, num_stages=1), interpret=interpret)(*inputs)


def _check_positions(pos_to_token, num_rows: int) -> None:
  """Opt-in checked mode: under ``checkify.checkify(f, errors=checkify.user_checks)`` (or any error set
  with the user checks) reports the first ``pos_to_token`` entry outside ``[-1, M)``, where
  ``pos_to_token`` is traced (``f`` or the checkified function under ``jax.jit``). Without checkify
  the check is dropped and XLA removes its comparisons (the compiled program is unchanged); an eager
  call with a concrete array computes nothing (the comparisons would cost device time every call)."""
  if pos_to_token.shape[0] == 0 or not isinstance(pos_to_token, jax.core.Tracer):
    return
  bad = (pos_to_token < -1) | (pos_to_token >= num_rows)
  first = jnp.argmax(bad)
  checkify.debug_check(
      ~jnp.any(bad), "per_channel_cast_fused: pos_to_token[{}] = {} is outside [-1, M=%d) (its row is zeros)"
      % num_rows, first, pos_to_token[first])


def per_channel_cast_fused(x: jax.typing.ArrayLike | QuantTensor, fmt: str, num_per_tokens: int, *,
                           round_sf: bool = False, num_per_channels: int | None = None,
                           pos_to_token: jax.Array | None = None, implementation: str | None = None) -> QuantTensor:
  """Per-channel e4m3 cast (blocks of 128 rows x 1 column) with an optional row gather and a
  dequantised QuantTensor input.

  Args:
    x: ``(M, K)`` bf16 / float32 array (or nested list; ``K % 64 == 0``), or a QuantTensor ``(q, sf)``:
      ``q`` float8_e4m3fn ``(M, K)`` (``K % 128 == 0``), ``sf`` float32 ``(M, K/128)`` (layout A, one
      scale per row and 128 columns), dequantised as ``RN(q·sf)``.
    fmt: ``"e4m3"``.
    num_per_tokens: 128 (rows per scale).
    round_sf: power-of-two scales (``2^ceil(log2(amax/448))``).
    num_per_channels: 128 for a QuantTensor input, None for a plain one.
    pos_to_token: optional int32 ``(Mo,)`` (``Mo % 16 == 0``): output row ``p`` is
      ``x[pos_to_token[p]]``, a zero row where the entry is negative or ``>= M`` (kernel and reference
      alike, also under ``jax.jit``). ``jax.jit(checkify.checkify(f, errors=checkify.user_checks))``
      (or ``checkify.checkify(jax.jit(f), ...)``) reports the first entry outside ``[-1, M)``; the
      check needs a traced ``pos_to_token`` and adds nothing to a program that is not checkified.
      Without ``pos_to_token`` ``M % 128 == 0`` and ``Mo = M``.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``QuantTensor(data (Mo, K) float8_e4m3fn, sf (ceil(Mo/128), K) float32)``; rows past ``Mo`` in a
    partial last block are not part of any column maximum.

  Raises:
    ValueError: another ``fmt`` or ``num_per_tokens``; ``num_per_channels`` not 128 for a QuantTensor
      (not None for a plain input); wrong ranks, dtypes, shapes (above) or a bool / non-array input.

  Kernels: without ``pos_to_token`` the one-warpgroup TMA Mosaic GPU kernel (:func:`per_channel_cast`'s for
  float32, module docstring); with it a Pallas-Triton gather kernel (H200: 1.89-2.00x XLA on the MoE gathers,
  module docstring). XLA instead of a kernel: only zero-size problems (``M``, ``Mo`` or ``K`` zero: the result is
  empty or, for ``M = 0`` with ``Mo > 0``, zero rows with the clamp scale).

  Non-finite inputs give the reference's bits: the column maxima propagate NaN, so a NaN makes
  its group's ``sf`` and data NaN; an infinity gives ``sf = inf``, NaN for itself and signed zeros
  for the group's other values; with ``round_sf`` see :func:`jaxkern.reference.quant.per_channel_cast`.

  Differentiation: not differentiable (data and sf of a QuantTensor input too), as :func:`per_channel_cast`
  (raises :class:`jaxkern.NotDifferentiableError`).
  """
  validate.check_fmt(fmt, ("e4m3",))
  if num_per_tokens != 128:
    raise ValueError(f"num_per_tokens must be 128, got {num_per_tokens}")
  if isinstance(x, tuple):
    if num_per_channels != 128:
      raise ValueError(f"num_per_channels must be 128 for a QuantTensor input, got {num_per_channels}")
    if len(x) != 2:
      raise ValueError(f"x must be an array or a QuantTensor (data, sf), got a tuple of {len(x)}")
    q, sf = _checks.as_array("x[0]", x[0]), _checks.as_array("x[1]", x[1])
    _checks.check_rank("x[0]", q, 2)
    _checks.check_dtype("x[0]", q, (jnp.float8_e4m3fn,))
    _checks.check_multiple("x[0]", q, 1, 128)
    validate.check_sf("x[1]", sf, (q.shape[0], q.shape[1] // 128), jnp.float32)
    x = QuantTensor(q, sf)
    rows, k = q.shape
  else:
    if num_per_channels is not None:
      raise ValueError(f"num_per_channels must be None for a plain input, got {num_per_channels}")
    x = _checks.as_array("x", x)
    _checks.check_rank("x", x, 2)
    _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
    _checks.check_multiple("x", x, 1, 64)
    rows, k = x.shape
  if pos_to_token is None:
    if rows % 128:
      raise ValueError(f"x must have a multiple of 128 rows without pos_to_token, got {rows}")
    out_rows = rows
  else:
    pos_to_token = _checks.as_array("pos_to_token", pos_to_token)
    _checks.check_rank("pos_to_token", pos_to_token, 1)
    _checks.check_dtype("pos_to_token", pos_to_token, (jnp.int32,))
    _checks.check_multiple("pos_to_token", pos_to_token, 0, 16)
    _check_positions(pos_to_token, rows)
    out_rows = pos_to_token.shape[0]
  x = validate.guard("per_channel_cast_fused", x)
  data, sf = x if isinstance(x, tuple) else (x, None)

  def kernel(interpret):
    if pos_to_token is not None:
      return QuantTensor(*_gather_kernel(data, sf, pos_to_token, round_sf=round_sf, interpret=interpret))
    return QuantTensor(*_kernel(data, sf, npt=num_per_tokens, round_sf=round_sf, interpret=interpret))

  return _dispatch.run(
      "per_channel_cast_fused", implementation, kernel=kernel,
      xla=lambda: ref.per_channel_cast_fused(x, fmt, num_per_tokens, round_sf=round_sf,
                                             num_per_channels=num_per_channels, pos_to_token=pos_to_token),
      empty=rows == 0 or out_rows == 0 or k == 0)


def _check_plain(x, fmt, num_per_tokens, allowed, dtypes):
  x = _checks.as_array("x", x)
  validate.check_fmt(fmt, ("e4m3",))
  if num_per_tokens not in allowed:
    raise ValueError(f"num_per_tokens must be in {allowed}, got {num_per_tokens}")
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, dtypes)
  _checks.check_multiple("x", x, 0, 128)
  _checks.check_multiple("x", x, 1, 64)
  return x


def per_channel_cast(x: jax.typing.ArrayLike, fmt: str, num_per_tokens: int, *, round_sf: bool = False,
                     implementation: str | None = None) -> QuantTensor:
  """Per-channel e4m3 cast: one scale per column and block of ``num_per_tokens`` rows.

  Args:
    x: ``(M, K)`` bf16 / float32 array (or nested list), ``M % 128 == 0``, ``K % 64 == 0``.
    fmt: ``"e4m3"``.
    num_per_tokens: 128.
    round_sf: power-of-two scales (``2^ceil(log2(amax/448))``).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``QuantTensor(data (M, K) float8_e4m3fn, sf (M/128, K) float32)`` with ``sf = amax/448`` of each
    column block (amax clamped at 1e-4) and ``data = e4m3(x · RN(448/amax))``.

  Raises:
    ValueError: another ``fmt`` or ``num_per_tokens``, another rank or dtype (bool included), ``M`` /
      ``K`` not multiples of 128 / 64, a non-array ``x``.

  Mosaic GPU kernels (H200, 2026-11-30: ``8064x7168`` bf16 43.1-43.3 µs, 2.6x XLA, 1.07x TileKernels; module
  docstring). XLA instead of a kernel: only zero-size arrays.

  Non-finite inputs give the reference's bits: the column maxima propagate NaN, so a NaN makes
  its group's ``sf`` and data NaN; an infinity gives ``sf = inf``, NaN for itself and signed zeros
  for the group's other values; with ``round_sf`` see :func:`jaxkern.reference.quant.per_channel_cast`.

  Differentiation: not differentiable; ``jax.grad`` / ``jax.jvp`` through it raise
  :class:`jaxkern.NotDifferentiableError`. Apply it to ``jax.lax.stop_gradient(x)``, or wrap it in the
  ``jax.custom_vjp`` you want (e.g. straight-through).
  """
  x = validate.guard("per_channel_cast", _check_plain(x, fmt, num_per_tokens, (128,), (jnp.bfloat16, jnp.float32)))
  return _dispatch.run(
      "per_channel_cast", implementation,
      kernel=lambda interpret: QuantTensor(*_plain_kernel(x, round_sf, interpret)),
      xla=lambda: ref.per_channel_cast(x, fmt, num_per_tokens, round_sf=round_sf), empty=x.size == 0)


def _plain_kernel(x, round_sf, interpret):
  """:func:`per_channel_cast`'s kernel (``npt = 128``): for bf16 :func:`_split_register_kernel`; for float32
  :func:`_kernel` (the two-warpgroup kernel was built and measured for bf16 only)."""
  if x.dtype != jnp.bfloat16:
    return _kernel(x, npt=128, round_sf=round_sf, interpret=interpret)
  return _split_register_kernel(x, round_sf=round_sf, interpret=interpret)


def per_channel_cast_and_transpose(x: jax.typing.ArrayLike, fmt: str, num_per_tokens: int, *, round_sf: bool = False,
                                   implementation: str | None = None) -> QuantTensor:
  """:func:`per_channel_cast` of bf16 ``x`` with the data transposed (one pass: the transposed store
  is fused).

  Args:
    x: ``(M, K)`` bf16 array (or nested list), ``M % 128 == 0``, ``K % 64 == 0``.
    fmt: ``"e4m3"``.
    num_per_tokens: 32 or 128 (rows per scale).
    round_sf, implementation: as :func:`per_channel_cast`.

  Returns:
    ``QuantTensor(data (K, M) float8_e4m3fn, sf (M/num_per_tokens, K) float32)``: ``data`` is the
    transpose of :func:`per_channel_cast`'s.

  Raises:
    ValueError: as :func:`per_channel_cast` (``x`` must be bf16).

  Mosaic GPU kernel; XLA instead of a kernel: only zero-size arrays. Non-finite inputs as
  :func:`per_channel_cast`.

  Differentiation: not differentiable, as :func:`per_channel_cast` (raises :class:`jaxkern.NotDifferentiableError`).
  """
  x = validate.guard("per_channel_cast_and_transpose", _check_plain(x, fmt, num_per_tokens, (32, 128), (jnp.bfloat16,)))
  return _dispatch.run(
      "per_channel_cast_and_transpose", implementation,
      kernel=lambda interpret: QuantTensor(*_kernel(x, npt=num_per_tokens, round_sf=round_sf, transpose_out=True,
                                                    interpret=interpret)),
      xla=lambda: ref.per_channel_cast_and_transpose(x, fmt, num_per_tokens, round_sf=round_sf), empty=x.size == 0)

"""Dequantisation: ``cast_back``, ``per_token_cast_back`` and ``unpack_from_e2m1fn_x2`` (docs/quant.md, "Cast-backs"); E5M6 data
(``x_special_fmt="e5m6"``) go to :mod:`jaxkern.quant._e5m6`.

``out = RN(f32(q) · sf)`` in float32, then one rounding to bf16 for ``fmt="bf16"``.

Mosaic GPU kernel for e4m3 and packed e2m1 data whose block width divides ``K`` or is the whole row
(any block height; a partial last block column runs as separate column segments): the data are
viewed as rows of whole blocks (as in :mod:`jaxkern.quant._per_token_cast`), read straight from GMEM
into registers in :func:`jaxkern._layouts.row_layout`, multiplied by the row's sf and written
straight back; no padding for any row count. The kernel reads the caller's sf itself where a tile's
sf is a row slice of it: layout A with one group per view row (contiguous) or with column segments (a
strided column load), layout B rows, packed UE8M0 words (decoded in registers), and for blocks taller
than one row (when a tile fits in ``bm`` rows) two scalar loads per segment and a select. e4m3 data
whose blocks (at least 64 wide) divide ``K`` several times keep their rows where the blocks are
taller than one row or the sf is packed / column-major: a CTA takes a tile of :data:`TILE_COLS`
columns (a second grid axis), one segment per block, so that the sf is read in the kernel too.
Otherwise a column-major sf with several groups per view row, or blocks shorter than a layout
block, is first decoded by XLA. e4m3 data with per-channel blocks ``(bm, 1)`` (``bm % 16 == 0``, e.g.
``(128, 1)``) have their own kernel (:func:`_channel_kernel`: column-vector sf, row chunks; an sf in
layout B or C is turned into layout A by XLA first). Other block widths, and packed e2m1 data with
``(bm, 1)`` blocks, have no kernel: :func:`_cast_back_unsupported` says why, ``"auto"`` runs XLA
there and ``"pallas"`` / ``"interpret"`` raise ``KernelUnavailableError``.

Large e4m3 -> float32 casts (at least :data:`TMA_MIN_ELEMENTS`) with blocks ``(1, 128)`` or
``(bm >= 128, 128)`` and a layout-A sf take a persistent kernel instead (:func:`_tma_store_kernel`):
64-row tiles loaded by a ring of TMA copies and stored through SMEM with TMA. On an H200 that runs
at 87-97% of the copy bandwidth, 2-8% faster than the register-store kernel and 1.02-1.20x XLA's
fusion, except at 8001x7168 with (128, 128) blocks, where both run at 93-96% of copy (0.998-1.05x).

Packed e2m1: each byte decodes with integer operations (:func:`jaxkern.reference.quant.decode_e2m1`)
into columns ``2j`` (low nibble) and ``2j + 1``; a bf16 output pair is written as one int32 word (a
free bitcast of the output), a float32 pair as two strided stores. ``unpack_from_e2m1fn_x2`` is the
same kernel without scaling.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _autodiff, _checks, _config, _dispatch
from jaxkern._layouts import row_layout
from jaxkern.quant import _e5m6
from jaxkern.quant import _tiling as tiling
from jaxkern.quant import _validate as validate
from jaxkern.quant._sf_read import _sf_decode, _sf_raw
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor


# Columns per CTA (at most) of the column-tiled view (e4m3 blocks narrower than K with a block sf, a
# packed or a column-major sf). H200, e4m3 -> float32 (128, 128) blocks, µs for 256 / 512 / 1024
# columns: 8001x7168 76.1 / 75.7 / 76.0, 4001x2048 10.4 / 10.5 / 10.4 (the row view with the sf
# expanded by XLA first: 78.3 and 13.0, XLA 75.4 and 12.9).
TILE_COLS = 512


def _tile_itemsize(out_dtype, fp4, bm):
  """The itemsize that sizes the row tiles (:func:`jaxkern.quant._tiling.tile_rows`). e4m3 -> float32
  with one sf per row (``bm == 1``) takes 4: 32 values per thread; H200 8001x7168 npc 128 76.5 ->
  75.4 µs, packed sf 76.4 -> 75.4, 4001x2048 11.6 -> 10.9 and 11.1 -> 10.5; (128, 128) blocks stay
  at 2 (64 values per thread: 4001x2048 10.5 against 11.1)."""
  if fp4:
    return 2 * jnp.dtype(out_dtype).itemsize
  return 4 if out_dtype == jnp.float32 and bm == 1 else 2


def _out_layout(width, out_dtype, fp4):
  """Register layout of a segment: e4m3 bytes -> ``out_dtype``; packed e2m1 bytes -> one int32 word
  (two bf16), one int16 word (two e4m3) or a strided float32 pair half per byte."""
  if not fp4:
    return row_layout(width, jnp.dtype(out_dtype).itemsize)
  return row_layout(width, 16 if out_dtype == jnp.float32 else 4)


def _row_kernel(q, sf, *, segs, out_dtype, sf_mode, bm, num_blocks, interpret, col_tiles=1):
  """``q`` ``(R, W)`` e4m3 -> ``(R, W)`` ``out_dtype``, or packed e2m1 ``(R, W)`` int8 / uint8 (``segs``
  in bytes) -> int32 ``(R, W)`` (bf16 pairs, column ``2j`` in the low half), int16 ``(R, W)`` (e4m3
  pairs, saturating) or float32 ``(R, W, 2)``. The sf (see :func:`_sf_raw`) is read in the kernel: one value per view row and
  segment for ``bm == 1``, else one per block row of ``bm`` view rows (``num_blocks`` of them); a
  tile has at most ``bm`` rows, so it spans at most two block rows: two scalar loads and a select.
  ``sf_mode`` None: no scaling (plain decoding). ``col_tiles``: the columns split into that many
  CTA tiles of ``W / col_tiles`` columns, ``segs`` being those of the first tile (tile ``j`` takes
  segments ``j·len(segs)...`` of the sf)."""
  r, w = q.shape
  tw = w // col_tiles
  fp4 = q.dtype != jnp.float8_e4m3fn
  layouts = [_out_layout(sw, out_dtype, fp4) for _, sw in segs]
  unit = max(u for _, u in layouts)
  rt = tiling.tile_rows(r, tw, _tile_itemsize(out_dtype, fp4, bm), unit)
  if bm > 1:
    rt = min(rt, bm // unit * unit)
  if not fp4:
    out_type = jax.ShapeDtypeStruct((r, w), out_dtype)
  else:
    out_type = {jnp.dtype(jnp.bfloat16): jax.ShapeDtypeStruct((r, w), jnp.int32),
                jnp.dtype(jnp.float8_e4m3fn): jax.ShapeDtypeStruct((r, w), jnp.int16),
                jnp.dtype(jnp.float32): jax.ShapeDtypeStruct((r, w, 2), jnp.float32)}[jnp.dtype(out_dtype)]

  grid, names = ((pl.cdiv(r, rt),), ("i",)) if col_tiles == 1 else ((pl.cdiv(r, rt), col_tiles), ("i", "j"))

  @functools.partial(plgpu.kernel, out_type=out_type, grid=grid, grid_names=names, interpret=interpret)
  def kernel(q_g, *refs):
    sf_g, o_g = refs if sf_mode is not None else (None, *refs)
    start = jnp.minimum(lax.axis_index("i") * rt, r - rt)
    rows = pl.ds(start, rt)
    c0, g0 = (0, 0) if col_tiles == 1 else (lax.axis_index("j") * tw, lax.axis_index("j") * len(segs))
    segs_j = [(c0 + c, sw) for c, sw in segs]
    vals = [plgpu.load(q_g.at[rows, pl.ds(c, sw)], layout=lay, optimized=False) for (c, sw), (lay, _) in
            zip(segs_j, layouts)]
    for s, ((c, sw), (lay, _), v) in enumerate(zip(segs_j, layouts, vals)):
      s = g0 + s
      if fp4:
        b = v.astype(jnp.int32)
        halves = [ref.decode_e2m1(b & 0xF), ref.decode_e2m1((b >> 4) & 0xF)]
      else:
        halves = [v.astype(jnp.float32)]
      if sf_mode is not None:
        vec = lay.reduce(1)
        if bm == 1:
          scale = _sf_raw(sf_g, sf_mode, s, rows, vec)
        else:
          b0 = start // bm
          s0 = _sf_raw(sf_g, sf_mode, s, b0)
          s1 = _sf_raw(sf_g, sf_mode, s, jnp.minimum(b0 + 1, num_blocks - 1))
          row = plgpu.broadcasted_iota(jnp.int32, (rt,), 0, layout=vec) + start
          scale = jnp.where(row < (b0 + 1) * bm, s0, s1)
        scale = _sf_decode(scale, sf_mode, s)
        halves = [h * scale[:, None] for h in halves]
      cols = pl.ds(c, sw)
      if not fp4:
        o_g[rows, cols] = halves[0].astype(out_dtype)
      elif out_dtype == jnp.bfloat16:  # the bf16 patterns are the high halves of the rounded float32
        lo, hi = (lax.bitcast_convert_type(h.astype(jnp.bfloat16).astype(jnp.float32), jnp.int32) for h in halves)
        o_g[rows, cols] = lax.shift_right_logical(lo, 16) | hi
      elif out_dtype == jnp.float8_e4m3fn:
        lo, hi = (lax.bitcast_convert_type(ref.encode_e4m3(h), jnp.int8).astype(jnp.int32) & 0xFF for h in halves)
        o_g[rows, cols] = (lo | (hi << 8)).astype(jnp.int16)
      else:
        for t, h in enumerate(halves):
          o_g[rows, cols, t] = h

  out = kernel(q, sf) if sf_mode is not None else kernel(q)
  if fp4 and out_dtype != jnp.float32:
    out = lax.bitcast_convert_type(out, out_dtype)
  return out.reshape(r, -1)


CHANNEL_CHUNK_ROWS = 16  # rows per register chunk of the per-channel kernel
# Rows per CTA of the per-channel kernel (a divisor of the block height). H200, 4001x7168 fp32 out:
# 64 rows (one wave of 6-7 CTAs per SM) 39.7 µs against XLA's 37.4; 16 rows 37.2 against 37.8.
CHANNEL_TILE_ROWS = 16
CHANNEL_MAX_COLS = 512  # columns per CTA of the per-channel kernel (at most)


@functools.partial(jax.jit, static_argnames=("bm", "out_dtype", "interpret"))
def _channel_kernel(q, sf, *, bm, out_dtype, interpret):
  """e4m3 ``q`` ``(M, K)`` with a layout-A sf ``(ceil(M/bm), K)`` (blocks ``(bm, 1)``, ``bm % 16 == 0``)
  -> ``(M, K)`` ``out_dtype``.

  A CTA owns ``rt`` rows (a divisor of ``bm``, so they lie in one block row) and ``c`` columns (the
  largest multiple of 64 dividing ``K``, at most :data:`CHANNEL_MAX_COLS`); it loads the sf row of its
  block row and of the one above as column vectors and walks its rows in chunks of
  :data:`CHANNEL_CHUNK_ROWS` in :func:`jaxkern._layouts.row_layout`. A chunk past the last row is
  moved back to end there; its rows of the block row above take that row's sf (the same values the
  CTA above writes)."""
  m, k = q.shape
  rc = CHANNEL_CHUNK_ROWS
  rt = math.gcd(bm, CHANNEL_TILE_ROWS)
  c = max(w for w in range(64, min(k, CHANNEL_MAX_COLS) + 1, 64) if k % w == 0)
  mp = max(m, rc)
  if mp != m:  # fewer rows than one chunk (tiny inputs only)
    q = jnp.pad(q, ((0, mp - m), (0, 0)))
  lay, _ = row_layout(c, jnp.dtype(out_dtype).itemsize)
  nblk = ref.cdiv(m, bm)

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((mp, k), out_dtype), grid=(k // c, pl.cdiv(mp, rt)),
                     grid_names=("j", "i"), interpret=interpret)
  def kernel(q_g, sf_g, o_g):
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * c, c)
    b_hi = jnp.minimum(i * rt // bm, nblk - 1)
    s_hi, s_lo = (plgpu.load(sf_g.at[b, cols], layout=lay.reduce(0), optimized=False)
                  for b in (b_hi, jnp.maximum(b_hi - 1, 0)))
    for r0 in range(0, rt, rc):
      start = jnp.minimum(i * rt + r0, mp - rc)
      row = plgpu.broadcasted_iota(jnp.int32, (rc,), 0, layout=lay.reduce(1)) + start
      scale = jnp.where((row >= b_hi * bm)[:, None], s_hi[None, :], s_lo[None, :])
      v = plgpu.load(q_g.at[pl.ds(start, rc), cols], layout=lay, optimized=False).astype(jnp.float32)
      o_g[pl.ds(start, rc), cols] = (v * scale).astype(out_dtype)

  return kernel(q, sf)[:m]


# e4m3 -> float32 with (1, 128) or (bm >= 128, 128) blocks and a layout-A sf, from this many output
# elements on: :func:`_tma_store_kernel`. H200, µs, persistent kernel / register-store kernel / XLA:
# (1, 128) 4001x2560 13.3 / 13.7 / 14.1, 4001x4096 20.7 / 21.8 / 21.8, 8001x2048 20.7 / 21.8 / 21.7,
# 8001x7168 72.8 / 74.6 / 74.4; (128, 128) 4001x2560 13.4 / 13.9 / 14.6, 8001x2048 20.1 / 21.0 / 23.1;
# below it the register-store kernel wins: (1, 128) 4001x2048 (8.2M elements) 11.2 / 10.7 / 11.6.
TMA_MIN_ELEMENTS = 1 << 23
_RING_ROWS = 64  # rows per tile (of one 128-column block) of the ring kernel
# (CTAs per SM, tiles in flight per CTA). With one sf per row (bm == 1) each tile needs a strided
# GMEM load of 64 sf values: it is issued one tile ahead (a loop carry), and a second CTA per SM
# hides the rest. H200, µs against one CTA per 128 (or 32) row tile: (128, 128) 8001x7168
# 72.8-73.7 / 73.9-74.1, 8001x4096 40.6-40.9 / 41.7-41.9, 4001x7168 34.9-35.2 / 37.2-37.4, 8001x2560
# 24.6-24.7 / 26.5-26.7; (1, 128) 8001x7168 72.75-72.80 / 74.2-74.4, 8001x2560 25.62-25.63 / 27.0;
# 32-row tiles, one CTA of 128-row tiles and one CTA per SM for (1, 128) were slower.
_RING_CONFIG = {True: (2, 4), False: (1, 12)}  # keyed by bm == 1


@functools.partial(jax.jit, static_argnames=("bm", "interpret"))
def _tma_store_kernel(q, sf, *, bm, interpret):
  """e4m3 ``q`` ``(M, K)`` (``K % 128 == 0``, ``M >= 64``) with a layout-A float32 sf
  ``(ceil(M/bm), K/128)`` (blocks ``(bm, 128)``, ``bm == 1`` or ``bm >= 128``) -> float32 ``(M, K)``.

  Persistent: a tile is 64 rows of one 128-column block (row tiles moved back to end at row ``M``);
  CTA ``c`` takes tiles ``c, c + C, ...`` (column blocks fastest) with a ring of TMA loads in flight
  (:data:`_RING_CONFIG`), loads each tile from SMEM in :func:`jaxkern._layouts.row_layout`, scales
  it (``bm >= 128``: at most two block rows, two scalar sf loads and a select; ``bm == 1``: the row
  sf, loaded one tile ahead) and stores it through one of two SMEM buffers with a TMA copy."""
  m, k = q.shape
  rt, gj = _RING_ROWS, k // 128
  per_sm, stages = _RING_CONFIG[bm == 1]
  tiles = pl.cdiv(m, rt) * gj
  ctas = min(tiles, per_sm * _config.num_sms())
  lay, _ = row_layout(128, 4)
  nblk = ref.cdiv(m, bm)

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((m, k), jnp.float32),
      grid=(ctas,),
      grid_names=("c",),
      scratch_types=dict(q_s=plgpu.SMEM((stages, rt, 128), q.dtype), o_s=plgpu.SMEM((2, rt, 128), jnp.float32),
                         bar=plgpu.Barrier(num_arrivals=1, num_barriers=stages)),
      interpret=interpret,
  )
  def kernel(q_g, sf_g, o_g, q_s, o_s, bar):
    cta = lax.axis_index("c")
    count = (tiles - cta + ctas - 1) // ctas  # tiles of this CTA

    def window(t):
      tile = cta + t * ctas
      return jnp.minimum(tile // gj * rt, m - rt), tile % gj

    def fetch(t):
      @pl.when(t < count)
      def _():
        start, j = window(t)
        plgpu.copy_gmem_to_smem(q_g.at[pl.ds(start, rt), pl.ds(j * 128, 128)], q_s.at[t % stages], bar.at[t % stages])

    for t in range(stages - 1):
      fetch(t)

    def sf_rows(t):  # bm == 1: the sf of tile t's rows (a strided GMEM load)
      start, j = window(jnp.minimum(t, count - 1))
      return plgpu.load(sf_g.at[pl.ds(start, rt), j], layout=lay.reduce(1), optimized=False)

    def body(t, carry):
      fetch(t + stages - 1)
      start, j = window(t)
      rows = pl.ds(start, rt)
      if bm == 1:
        scale, carry = carry, sf_rows(t + 1)  # the next tile's sf loads while this tile is scaled
      else:
        b0 = start // bm
        row = plgpu.broadcasted_iota(jnp.int32, (rt,), 0, layout=lay.reduce(1)) + start
        scale = jnp.where(row < (b0 + 1) * bm, sf_g[b0, j], sf_g[jnp.minimum(b0 + 1, nblk - 1), j])
      plgpu.barrier_wait(bar.at[t % stages])
      v = plgpu.load(q_s.at[t % stages], layout=lay, optimized=False).astype(jnp.float32)
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store of tile t - 2 has read o_s[t % 2]
      o_s.at[t % 2][...] = v * scale[:, None]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s.at[t % 2], o_g.at[rows, pl.ds(j * 128, 128)])
      return carry

    lax.fori_loop(0, count, body, sf_rows(0) if bm == 1 else None)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return kernel(q, sf)


def _use_tma_store(q, sf, block_size, out_dtype, col_major) -> bool:
  bm, bk = block_size
  return (q.dtype == jnp.float8_e4m3fn and out_dtype == jnp.float32 and bk == 128 and q.shape[1] % 128 == 0
          and (bm == 1 or bm >= 128) and sf.dtype == jnp.float32 and not col_major
          and q.shape[0] >= _RING_ROWS and q.size >= TMA_MIN_ELEMENTS)


def _pad_rows(qv, unit):
  """Pads a view with fewer than ``unit`` rows (tiny inputs only)."""
  return jnp.pad(qv, ((0, max(0, unit - qv.shape[0])), (0, 0)))


@functools.partial(jax.jit, static_argnames=("block_size", "out_dtype", "col_major", "interpret"))
def _kernel(q, sf, *, block_size, out_dtype, col_major, interpret):
  """``q`` ``(M, K)`` e4m3 or ``(M, K/2)`` packed e2m1 -> ``(M, K)`` ``out_dtype``."""
  fp4 = q.dtype != jnp.float8_e4m3fn
  m, k = q.shape[0], q.shape[1] * (2 if fp4 else 1)
  bm, bk = block_size
  mb, kb = ref.cdiv(m, bm), ref.cdiv(k, bk)
  div = 2 if fp4 else 1
  r, w, segs = tiling.row_plan(m, k, min(bk, k))
  segs = tuple((c // div, sw // div) for c, sw in segs)
  tiles = 1
  if not fp4 and k % bk == 0 and k > bk >= 64 and (bm > 1 or col_major or sf.dtype == jnp.int32):
    tw = max(c for c in range(bk, max(bk, TILE_COLS) + 1, bk) if k % c == 0)
    tsegs = tuple((c, bk) for c in range(0, tw, bk))
    if bm == 1 or bm >= max(_out_layout(sw, out_dtype, fp4)[1] for _, sw in tsegs):
      r, w, segs, tiles = m, k, tsegs, k // tw
  w //= div
  unit = max(_out_layout(sw, out_dtype, fp4)[1] for _, sw in segs)
  rp = max(r, unit)
  # Read the caller's sf in the kernel where a tile's sf is a (strided) row slice of it; otherwise
  # decode it with XLA into one float32 value per row and group first.
  if r == m and (bm == 1 or bm >= unit):
    mode = "packed" if sf.dtype == jnp.int32 else "rows" if col_major else "cols"
    if mode == "cols" and kb == 1:
      sf, mode = sf.reshape(1, mb), "rows"  # contiguous
  else:
    sf = ref.sf_to_float(sf, mb, kb, use_tma_aligned_col_major_sf=col_major)
    if bm > 1:
      sf = jnp.repeat(sf, bm, axis=0)[:m]
    bm, mb = 1, m
    sf, mode = (sf.reshape(1, r), "rows") if len(segs) == 1 else (sf, "cols")
  if rp != r and bm == 1:
    axis = 0 if mode == "cols" else 1
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, max(0, rp - sf.shape[axis]))
    sf = jnp.pad(sf, pad)
  out = _row_kernel(_pad_rows(q.reshape(r, w), unit), sf, segs=segs, out_dtype=out_dtype, sf_mode=mode, bm=bm,
                    num_blocks=mb, interpret=interpret, col_tiles=tiles)
  return out[:r].reshape(m, k)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def _unpack_kernel(x, *, out_dtype, interpret):
  """Packed e2m1 ``(N, L)`` -> ``(N, 2L)`` ``out_dtype`` (bf16 / float32)."""
  n, w = x.shape
  unit = _out_layout(w, out_dtype, True)[1]
  out = _row_kernel(_pad_rows(x, unit), None, segs=((0, w),), out_dtype=out_dtype, sf_mode=None, bm=1,
                    num_blocks=n, interpret=interpret)
  return out[:n]


def _cast_back_unsupported(q, k: int, block_size) -> str | None:
  """Why none of the cast-back kernels can dequantise ``q`` (logical width ``k``) with these blocks."""
  bm, bk = block_size
  if bk == 1:
    if q.dtype != jnp.float8_e4m3fn:
      return "packed e2m1 data with (bm, 1) blocks (the per-channel kernel reads e4m3 data only)"
    if bm % CHANNEL_CHUNK_ROWS:
      return f"(bm, 1) blocks need bm % {CHANNEL_CHUNK_ROWS} == 0, got bm={bm}"
    return None
  if bk < 16:
    return f"blocks narrower than 16 columns (bk={bk}) other than (bm, 1)"
  if tiling.row_plan(q.shape[0], k, min(bk, k)) is None:
    return f"more than {tiling.MAX_SEGMENTS} scale groups per row with a partial last one (K={k}, bk={bk})"
  return None


def _cast_back(op, x, fmt, x_block_size, x_special_fmt, col_major, implementation):
  """Checks, then one dispatch: the per-channel, TMA-store or row kernel (chosen as measured), or XLA."""
  if x_special_fmt == "e5m6":
    return _e5m6.cast_back_e5m6(x, fmt, x_block_size, x_use_tma_aligned_col_major_sf=col_major,
                          implementation=implementation)
  if x_special_fmt is not None:
    raise ValueError(f"x_special_fmt must be None or 'e5m6', got {x_special_fmt!r}")
  if isinstance(x, tuple) and len(x) == 2:
    x = QuantTensor(_checks.as_array("x[0]", x[0]), _checks.as_array("x[1]", x[1]))
  k = validate.check_quant_tensor("x", x, x_block_size, col_major=col_major)
  if k % 64:
    raise ValueError(f"x[0] must have a logical width K % 64 == 0, got K={k}")
  validate.check_fmt(fmt, ("bf16", "fp32"))
  block = tuple(int(b) for b in x_block_size)
  x = validate.guard(op, x, advice=_autodiff.DEQUANT_ADVICE)
  q, sf = x
  out_dtype = jnp.bfloat16 if fmt == "bf16" else jnp.float32

  def kernel(interpret):
    mosaic = _config.mosaic_interpret(interpret)
    if block[1] == 1:  # per-channel blocks; an sf in layout B / C goes to layout A by XLA first
      s = sf
      if s.dtype == jnp.int32 or col_major:
        s = ref.sf_to_float(s, ref.cdiv(q.shape[0], block[0]), k, use_tma_aligned_col_major_sf=col_major)
      return _channel_kernel(q, s, bm=block[0], out_dtype=out_dtype, interpret=mosaic)
    if _use_tma_store(q, sf, block, out_dtype, col_major):
      return _tma_store_kernel(q, sf, bm=block[0], interpret=mosaic)
    return _kernel(q, sf, block_size=block, out_dtype=out_dtype, col_major=col_major, interpret=mosaic)

  return _dispatch.run(
      op, implementation, kernel=kernel,
      xla=lambda: ref.cast_back(x, fmt, block, x_use_tma_aligned_col_major_sf=col_major),
      unsupported=_cast_back_unsupported(q, k, block), empty=q.size == 0)


def cast_back(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, x_block_size: tuple[int, int], *,
              x_special_fmt: Literal["e5m6"] | None = None, x_use_tma_aligned_col_major_sf: bool = False,
              implementation: str | None = None) -> jax.Array:
  """Dequantises a QuantTensor ``(q, sf)`` with blocks ``x_block_size``: ``RN(f32(q)·sf)`` in float32,
  then one rounding to bf16 for ``fmt="bf16"``.

  Args:
    x: QuantTensor (or plain pair) ``(q, sf)``: ``q`` float8_e4m3fn ``(M, K)`` or int8 / uint8 packed
      e2m1 ``(M, K/2)`` (element ``2j`` in the low nibble of byte ``j``), logical ``K % 64 == 0``;
      ``sf`` for ``Mb = ceil(M/bm)`` x ``Kb = ceil(K/bk)`` blocks in layout A (float32 ``(Mb, Kb)``),
      B (float32 ``(Kb, align(Mb, 4))``, ``x_use_tma_aligned_col_major_sf=True``) or C (int32 packed
      UE8M0 ``(ceil(Kb/4), align(Mb, 4))``), see :mod:`jaxkern.reference.quant`.
    fmt: ``"bf16"`` or ``"fp32"``, the output dtype.
    x_block_size: ``(bm, bk)``, positive ints (a partial last block is allowed).
    x_special_fmt: None, or ``"e5m6"``: ``q`` is packed E5M6 ``(M, 3K/2)`` uint8, handled by
      :func:`jaxkern.quant.cast_back_e5m6` (its checks, kernels and XLA cases apply instead of these).
    x_use_tma_aligned_col_major_sf: a float32 ``sf`` is column-major (layout B).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(M, K)`` bfloat16 or float32.

  Raises:
    ValueError: ``x`` not a pair of arrays, another dtype or rank of ``q`` / ``sf``, an ``sf`` shape
      that does not fit the blocks and layout, logical ``K % 64 != 0``, non-positive block sides,
      another ``fmt``, an ``x_special_fmt`` other than None / ``"e5m6"``.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` for the XLA cases below.

  Kernels (Mosaic GPU): e4m3 data with ``(bm, 1)`` blocks (``bm % 16 == 0``) the per-channel kernel;
  e4m3 -> float32 with ``(1, 128)`` or ``(bm >= 128, 128)`` blocks, a layout-A sf and at least
  :data:`TMA_MIN_ELEMENTS` elements the persistent TMA kernel (H200: 87-97% of copy, 1.02-1.20x
  XLA); every other case with blocks at least 16 wide the row kernel (module docstring). XLA
  instead of a kernel: packed e2m1 data with ``(bm, 1)`` blocks, ``(bm, 1)`` blocks with
  ``bm % 16 != 0``, blocks 2-15 columns wide, more than 16 scale groups per row with a partial
  last one, and zero-size arrays.

  Non-finite values: ``RN(f32(q)·sf)`` is an IEEE product, kernel and reference alike (NaN data or
  scales give NaN, ``0·inf`` NaN, an inf scale (UE8M0 byte 255) inf); bf16 outputs round it once.

  Differentiation: not differentiable (its input is quantised data): ``jax.grad`` / ``jax.jvp`` through ``q``
  or ``sf`` raise :class:`jaxkern.NotDifferentiableError`; pass them through ``jax.lax.stop_gradient``.
  """
  return _cast_back("cast_back", x, fmt, x_block_size, x_special_fmt, x_use_tma_aligned_col_major_sf,
                    implementation)


def per_token_cast_back(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, num_per_channels: int, *,
                        x_special_fmt: Literal["e5m6"] | None = None, x_use_tma_aligned_col_major_sf: bool = False,
                        implementation: str | None = None) -> jax.Array:
  """:func:`cast_back` with blocks ``(1, num_per_channels)``: one scale per row and group of
  ``num_per_channels`` columns (``num_per_channels >= K``: one scale per row).

  Arguments, result, errors, kernels and non-finite values as :func:`cast_back` with
  ``x_block_size = (1, num_per_channels)``; XLA instead of a kernel: groups 2-15 columns wide, more
  than 16 groups per row with a partial last one, zero-size arrays.

  Differentiation: not differentiable, as :func:`cast_back` (raises :class:`jaxkern.NotDifferentiableError`).
  """
  return _cast_back("per_token_cast_back", x, fmt, (1, num_per_channels), x_special_fmt,
                    x_use_tma_aligned_col_major_sf, implementation)


def unpack_from_e2m1fn_x2(x: jax.typing.ArrayLike, *, out_dtype: jax.typing.DTypeLike = jnp.float32,
                          implementation: str | None = None) -> jax.Array:
  """Decodes packed e2m1 bytes.

  Args:
    x: int8 / uint8 array (or nested list) ``(..., L)``, rank >= 1; byte ``j`` holds element ``2j`` in
      its low nibble and ``2j + 1`` in its high nibble.
    out_dtype: a floating dtype (default float32).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``(..., 2L)`` ``out_dtype``: the e2m1 values (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6; nibble 8 is -0.0).

  Raises:
    ValueError: ``x`` of rank 0, another dtype (bool, int32, ...) or not an array; ``out_dtype`` not a
      floating dtype.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` with an ``out_dtype`` other
      than bfloat16 / float32.

  The row kernel of :func:`cast_back` without scaling (Mosaic GPU). XLA instead of a kernel: other
  output dtypes and zero-size arrays.

  Differentiation: none (the input is integer bytes: a constant to ``jax.grad`` / ``jax.jvp``).
  """
  x = _checks.as_array("x", x)
  if x.ndim < 1:
    raise ValueError(f"x must have rank >= 1, got shape {tuple(x.shape)}")
  _checks.check_dtype("x", x, (jnp.int8, jnp.uint8))
  try:
    out_dtype = jnp.dtype(out_dtype)
  except TypeError as e:
    raise ValueError(f"out_dtype must be a floating dtype, got {out_dtype!r}") from e
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise ValueError(f"out_dtype must be a floating dtype, got {out_dtype}")
  unsupported = None
  if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    unsupported = f"out_dtype {out_dtype} (the kernel writes bfloat16 or float32)"

  def kernel(interpret):
    out = _unpack_kernel(x.reshape(-1, x.shape[-1]), out_dtype=out_dtype,
                         interpret=_config.mosaic_interpret(interpret))
    return out.reshape(*x.shape[:-1], 2 * x.shape[-1])

  return _dispatch.run("unpack_from_e2m1fn_x2", implementation, kernel=kernel,
                       xla=lambda: ref.unpack_from_e2m1fn_x2(x, out_dtype=out_dtype), unsupported=unsupported,
                       empty=x.size == 0)

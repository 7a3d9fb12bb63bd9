"""Per-token casts to FP8 e4m3 / FP4 e2m1: one scale factor per row and group of ``num_per_channels`` columns.

Mosaic GPU kernel that reads the input straight from GMEM into registers and writes the e4m3 data
straight back (no SMEM, no TMA, so any row count works without padding). The wrapper views the
``(M, K)`` input as rows that each hold whole groups: ``(M·K/npc, npc)`` when ``npc`` divides ``K``
and the sf is row-major (one group per view row, so the view-row order of the sf is layout A),
``(M, K)`` for one scale per row, and ``(M, K)`` split into column segments, one per group, when the
last group is partial or the sf is column-major (then a second grid axis gives each CTA a chunk of
4 groups, one packed UE8M0 word per row). Each CTA loads a block of view rows in
:func:`jaxkern._layouts.row_layout` (16-byte vectors along the row, coalesced), reduces each group's
``|x|`` along the row (vector, warp-shuffle and cross-warp reductions), computes the scale factors,
quantises and stores. The last CTA's block is shifted back to end at the last row (its overlap with
the previous block is written twice with equal values).

Exact numerics (docs/quant.md, "Scale factors"): ``sf = a / 448``, ``sf_inv = 448 / a`` and ``1 / sf`` are
correctly rounded with :func:`jaxkern._ieee.exact_div` (the GPU's ``/`` is approximate; the
divisor 448 is loaded from memory so that XLA cannot fold it in interpret mode), checked against
numpy by a ``gpu`` test. The e4m3 conversion saturates on the GPU (``cvt.rn.satfinite``); the
explicit clip to ±448 is only needed with a precomputed sf. The kernel writes the scale factors as
float32 ``(segments, view rows)`` (the wrapper reshapes them to layout A), or, when every view row
is a row (one scale per row, or column segments), directly in the column-major layout B or packed
UE8M0 layout C, padding rows zeroed by the last row of CTAs; XLA reformats them only for inputs of
fewer rows than one layout block. The format's largest value reaches the kernel as a one-element
host constant (an XLA splat would cost a broadcast kernel).

FP4 e2m1 (same kernel, docs/quant.md, "Number formats"): Hopper has no FP4 conversion, so the rounding (nearest even,
saturating at ±6, sign kept) and the packing (column ``2j`` in the low nibble) are bit operations
(:func:`jaxkern.quant._encode.encode_e2m1`), bit-exact with :func:`jaxkern.reference.quant.encode_e2m1`.
Each pair of columns is read together: a bf16 pair as one int32 word (a free bitcast of the input; ``word << 16`` and
``word & 0xFFFF0000`` are the float32 patterns), float32 as even / odd strided loads.

QuantTensor inputs (e4m3 or packed e2m1 data with their sf in layout A / B / C) run through the same
kernel (:func:`_quant_kernel`): the data are decoded in registers (e4m3 bytes by conversion, e2m1
nibbles with integer operations) and multiplied by the input sf read in the kernel, as the rows of
column segments (one per output group, an input block per part of a group). Inputs the plan does not
cover (groups straddling input blocks, fewer rows than one register layout block, blocks of 2..unit-1
rows, more than 16 groups with a partial last one) are unsupported: ``"auto"`` / ``"xla"`` run the ``jnp``
reference, ``"pallas"`` / ``"interpret"`` raise.

Non-finite inputs: the group maxima are NaN-propagating on both backends
(:func:`jaxkern.quant._nan.abs_key`: ``max.NaN.f32`` on the GPU, integer maxima of the sign-cleared patterns in
interpret mode, where XLA's float reductions can drop NaN), the e4m3 conversion saturates on both (:func:`to_e4m3`)
and NaN results are the GPU's canonical NaN on both (:func:`jaxkern.quant._nan.gpu_nan`), so that kernel and
reference (:func:`jaxkern.reference.quant.abs_max`, :func:`jaxkern.reference.quant.canonical_nan`) give the same
bits for NaN and ±inf inputs on every backend. Interpret mode pays for the last two; the compiled kernel does
nothing extra.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern._layouts import row_layout
from jaxkern.quant import _tiling as tiling
from jaxkern.quant import _validate as validate
from jaxkern.quant._encode import encode_e2m1
from jaxkern.quant._sf_read import _sf_decode, _sf_raw
from jaxkern.quant._e5m6 import per_token_cast_to_e5m6
from jaxkern.quant._nan import abs_key, gpu_nan, key_value
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor

# Groups per CTA when groups dividing K run as column segments (one packed UE8M0 word).
SEG_CHUNK = 4
# Lanes sharing a row when each group is a column segment of a row (the CTA's rows then span several
# groups, so fewer rows per CTA keep enough CTAs). H200, 8001x7168 npc 128 layout C (chunks of 4):
# 4 lanes 53.1 / 81.5 µs (bf16 / float32), 8 lanes 42.2 / 69.0, 16 lanes 48.9 / 71.0; e2m1 float32
# 4001x576 npc 128 (5 segments per row): 15.0, 11.0, 10.1 µs.
SEGMENT_LANES = 8


def to_e4m3(q, interpret):
  """float32 -> e4m3, saturating at ±448 (docs/quant.md, "Number formats"): on the GPU the conversion itself saturates
  (``cvt.rn.satfinite``; an explicit clip would cost a min and a max per value), in interpret mode XLA's
  conversion would send ±inf and ``|q| >= 464`` to NaN, so it clips first
  (:func:`jaxkern.reference.quant.encode_e4m3`)."""
  return q.astype(jnp.float8_e4m3fn) if interpret is None else ref.encode_e4m3(q)


def _fp4_pairs(x):
  """``(R, W)`` -> the pair view of the e2m1 kernel: bf16 pairs as one int32 word each ``(R, W/2)``
  (column ``2j`` in the low half), float32 as ``(R, W/2, 2)``."""
  r, w = x.shape
  x = x.reshape(r, w // 2, 2)
  return lax.bitcast_convert_type(x, jnp.int32) if x.dtype == jnp.bfloat16 else x


def _pair_layout(x, width, lanes):
  """Register layout of one half of the e2m1 pair view (16-byte int32 vectors for bf16 words,
  single elements for the strided float32 halves)."""
  return row_layout(width, 4 if x.ndim == 2 else 16, lanes)


def _load_pairs(x_g, rows, c, sw, layout):
  """Even and odd columns of ``[rows, 2c : 2(c+sw)]`` of the pair view, as float32."""
  if len(x_g.shape) == 2:
    u = plgpu.load(x_g.at[rows, pl.ds(c, sw)], layout=layout, optimized=False)
    return (lax.bitcast_convert_type(u << 16, jnp.float32),
            lax.bitcast_convert_type(u & jnp.int32(-65536), jnp.float32))
  return tuple(plgpu.load(x_g.at[rows, pl.ds(c, sw), h], layout=layout, optimized=False) for h in (0, 1))


class QuantIn(NamedTuple):
  """A QuantTensor input of :func:`row_kernel`: ``kind`` of the data view (``"e4m3"`` bytes, ``"e4m3x2"``
  int16 words of two e4m3 bytes, ``"e2m1"`` packed bytes), the caller's ``sf`` array read in the kernel
  as ``mode`` (see :func:`jaxkern.quant._sf_read._sf_raw`), its blocks ``bm`` rows × ``bk`` view
  columns, ``num_blocks`` block rows, and the ``itemsize`` that sizes the register vectors
  (:func:`jaxkern._layouts.row_layout`)."""

  kind: str
  sf: jax.Array
  mode: str
  bm: int
  bk: int
  num_blocks: int
  itemsize: int


def _parts(c, sw, bk):
  """Static ``(column, width)`` parts of the segment ``(c, sw)`` (``c`` a multiple of ``bk`` or of ``sw``)
  that lie in one input block of ``bk`` columns each."""
  return ((c, sw),) if bk >= sw else tuple((c + o, min(bk, sw - o)) for o in range(0, sw, bk))


def _decode_e4m3(b):
  """e4m3 bytes (int32 0..255) -> float32."""
  return lax.bitcast_convert_type(b.astype(jnp.int8), jnp.float8_e4m3fn).astype(jnp.float32)


def row_kernel(x, sf_in, *, segs, lanes, fmt, round_sf, write_data, compute_sf, interpret, sf_layout="rows",
               seg_chunk=None, thread_bytes=tiling.THREAD_BYTES, quant_in=None):
  """Per-row-group cast of ``x`` (``R`` at least one layout block of rows).

  ``x``: ``(R, W)`` for e4m3; for e2m1 the pair view of :func:`_fp4_pairs` (``W/2`` pairs, ``segs``
  in pairs). ``segs``: static ``(column, width)`` groups of each row; ``lanes``: at most this many
  lanes share a row (:func:`jaxkern._layouts.row_layout`). ``seg_chunk``: None (each CTA takes all
  segments of its rows) or, for equal-width segments ``(j·sw, sw)``, the segments per CTA (a multiple
  of 4 for layout C): a second grid axis runs over the chunks, the last one may be shorter.
  ``sf_in``: precomputed float32 sf ``(len(segs), R)`` or None. ``sf_layout``: ``"rows"`` writes the
  sf as float32 ``(len(segs), R)``; with one view row per row, ``"B"`` / ``"C"`` write layout B
  ``(len(segs), Mp)`` float32 / layout C ``(ceil(len(segs)/4), Mp)`` int32 packed UE8M0 directly
  (``Mp = align(R, 4)``; the last row of CTAs zeroes the padding rows with scalar stores). Returns
  ``(out | None, sf | None)``: ``out`` ``(R, W)`` e4m3 or ``(R, W/2)`` int8 (packed e2m1, column ``2j``
  in the low nibble).

  ``quant_in``: a :class:`QuantIn` whose data ``x`` (``(R, W)``, one view row per row) is decoded in
  registers and multiplied by its block's sf: the amax uses ``RN(d·s)`` (as ``RN(max|d|·s)``), the data
  ``RN(d·RN(s·sf_inv))`` (docs/quant.md, "Casts"). ``e4m3x2`` and ``e2m1`` views are pair views (``segs`` in
  pairs); an e4m3 output from a pair view is int16 words of two e4m3 bytes. A group wider than an input
  block runs as parts of ``bk`` view columns. Blocks taller than one row need tiles of at most ``bm``
  rows (two scalar sf loads and a select per part, as in :mod:`jaxkern.quant._cast_back`).
  """
  r, w = x.shape[:2]
  fp4 = fmt == "e2m1"
  qk = quant_in.kind if quant_in is not None else None
  pairs = fp4 or qk == "e2m1"  # view columns are pairs of elements
  itemsize = x.dtype.itemsize * (2 if x.ndim == 3 else 1)  # input bytes per view element
  nseg = len(segs)
  chunk = seg_chunk or nseg
  num_chunks = ref.cdiv(nseg, chunk)

  def seg_layout(sw):
    if qk is not None:
      return row_layout(sw, quant_in.itemsize, lanes)
    return _pair_layout(x, sw, lanes) if fp4 else row_layout(sw, itemsize, lanes)

  def parts(c, sw):
    return ((c, sw),) if qk is None else _parts(c, sw, quant_in.bk)

  unit = max(seg_layout(pw)[1] for c, sw in segs for _, pw in parts(c, sw))
  rt = tiling.tile_rows(r, w if seg_chunk is None else chunk * segs[0][1], itemsize, unit, thread_bytes)
  if quant_in is not None and quant_in.bm > 1:
    rt = min(rt, quant_in.bm // unit * unit)
  out_type = []
  if write_data:
    out_dtype = jnp.int8 if fp4 else jnp.int16 if pairs else jnp.float8_e4m3fn
    out_type.append(jax.ShapeDtypeStruct((r, w), out_dtype))
  mp = ref.cdiv(r, 4) * 4
  sf_type = {"rows": ((nseg, r), jnp.float32), "B": ((nseg, mp), jnp.float32),
             "C": ((ref.cdiv(nseg, 4), mp), jnp.int32)}[sf_layout]
  if compute_sf:
    out_type.append(jax.ShapeDtypeStruct(*sf_type))
  num_ctas = pl.cdiv(r, rt)

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(num_chunks, num_ctas), grid_names=("g", "i"),
                     interpret=interpret)
  def kernel(*refs):
    x_g, c_g, *rest = refs
    sfin_g = rest.pop(0) if sf_in is not None else None
    qsf_g = rest.pop(0) if quant_in is not None else None
    o_g = rest.pop(0) if write_data else None
    sf_g = rest.pop(0) if compute_sf else None
    start = jnp.minimum(lax.axis_index("i") * rt, r - rt)
    rows = pl.ds(start, rt)

    def load(col, sw, lay):
      """Float32 values of view columns ``[col, col + sw)``: one array, or the even and odd columns."""
      if qk is None and fp4:
        return _load_pairs(x_g, rows, col, sw, lay)
      v = plgpu.load(x_g.at[rows, pl.ds(col, sw)], layout=lay, optimized=False)
      if qk in (None, "e4m3"):
        return (v.astype(jnp.float32),)
      b = v.astype(jnp.int32)
      if qk == "e2m1":
        return ref.decode_e2m1(b & 0xF), ref.decode_e2m1((b >> 4) & 0xF)
      return _decode_e4m3(b & 0xFF), _decode_e4m3((b >> 8) & 0xFF)

    def in_scale(col, vec):
      """The input sf of view column ``col`` for the tile's rows (a vector in layout ``vec``)."""
      blk = col // quant_in.bk
      if quant_in.bm == 1:
        raw = _sf_raw(qsf_g, quant_in.mode, blk, rows, vec)
      else:
        b0 = start // quant_in.bm
        s0 = _sf_raw(qsf_g, quant_in.mode, blk, b0)
        s1 = _sf_raw(qsf_g, quant_in.mode, blk, jnp.minimum(b0 + 1, quant_in.num_blocks - 1))
        row = plgpu.broadcasted_iota(jnp.int32, (rt,), 0, layout=vec) + start
        raw = jnp.where(row < (b0 + 1) * quant_in.bm, s0, s1)
      return _sf_decode(raw, quant_in.mode, blk)

    def body(col0, seg0, local):
      """Segments ``seg0 + t`` at columns ``col0 + c`` for the static ``(c, sw)`` of ``local``
      (``seg0`` a multiple of 4 for layout C)."""
      maxv = c_g[0] if sf_in is None else None
      segments = []  # per segment: its parts as (columns, layout, values, input sf or None)
      for c, sw in local:
        ps = []
        for pc, pw in parts(c, sw):
          lay = seg_layout(pw)[0]
          ps.append((pl.ds(col0 + pc, pw), lay, load(col0 + pc, pw, lay),
                     in_scale(col0 + pc, lay.reduce(1)) if qk is not None else None))
        segments.append(ps)
      for t, ps in enumerate(segments):
        vec = ps[0][1].reduce(1)
        if sf_in is not None:
          inv = _ieee.exact_div(1.0, plgpu.load(sfin_g.at[seg0 + t, rows], layout=vec, optimized=False))
        else:
          maxes = [key_value(jnp.max(functools.reduce(jnp.maximum, [abs_key(h, interpret) for h in v]), axis=1),
                             interpret) for _, _, v, _ in ps]
          amax = functools.reduce(jnp.maximum, [a if s is None else a * s for a, (_, _, _, s) in zip(maxes, ps)])
          sf, inv = ref.scale_factors(amax, maxv, fmt, round_sf, div=_ieee.exact_div)
          sf = gpu_nan(sf, interpret)
          if compute_sf and sf_layout != "C":
            sf_g[seg0 + t, rows] = sf
          elif compute_sf:  # UE8M0 byte of segment seg0 + t into byte t % 4 of word (seg0 + t) // 4
            byte = ((lax.bitcast_convert_type(sf, jnp.int32) >> 23) & 0xFF) << (8 * (t % 4))
            word = byte if t % 4 == 0 else word | byte
            if t % 4 == 3 or t == len(local) - 1:
              sf_g[seg0 // 4 + t // 4, rows] = word
        for cols, _, v, s in ps if write_data else ():
          scale = inv if s is None else s * inv
          q = [gpu_nan(h * scale[:, None], interpret) for h in v]
          if fp4:
            out = (encode_e2m1(q[0]) | (encode_e2m1(q[1]) << 4)).astype(jnp.int8)
          elif pairs:  # e4m3 pairs as int16 words
            lo, hi = (lax.bitcast_convert_type(ref.encode_e4m3(h), jnp.int8).astype(jnp.int32) & 0xFF for h in q)
            out = (lo | (hi << 8)).astype(jnp.int16)
          else:
            out = ref.encode_e4m3(q[0]) if sf_in is not None or qk else to_e4m3(q[0], interpret)
          o_g[rows, cols] = out
      if compute_sf and sf_layout != "rows" and mp > r:
        @pl.when(lax.axis_index("i") == num_ctas - 1)
        def _():
          first, count = (seg0, len(local)) if sf_layout == "B" else (seg0 // 4, ref.cdiv(len(local), 4))
          for j in range(r, mp):
            for t in range(count):
              sf_g[first + t, j] = jnp.zeros((), sf_type[1])

    if seg_chunk is None:
      body(0, 0, segs)
    else:
      sw = segs[0][1]
      g = lax.axis_index("g")
      full = tuple((t * sw, sw) for t in range(chunk))
      tail = nseg - (num_chunks - 1) * chunk
      if tail == chunk:
        body(g * (chunk * sw), g * chunk, full)
      else:
        pl.when(g < num_chunks - 1)(lambda: body(g * (chunk * sw), g * chunk, full))
        pl.when(g == num_chunks - 1)(lambda: body((num_chunks - 1) * chunk * sw, (num_chunks - 1) * chunk, full[:tail]))

  # A one-element host constant (a splat vector would become an XLA broadcast kernel), loaded by
  # the kernel so that the division by it is not folded in interpret mode.
  consts = np.full((1,), ref.MAX_VALUE[fmt], np.float32)
  outs = list(kernel(x, consts, *(a for a in (sf_in, quant_in and quant_in.sf) if a is not None)))
  return (outs.pop(0) if write_data else None), (outs.pop(0) if compute_sf else None)


def _view(x, segs, fmt, lanes):
  """The kernel's view of ``x`` ``(R, W)`` and its segments (pairs for e2m1), and the layout block rows."""
  if fmt == "e2m1":
    xv, segs = _fp4_pairs(x), tuple((c // 2, sw // 2) for c, sw in segs)
    return xv, segs, max(_pair_layout(xv, sw, lanes)[1] for _, sw in segs)
  return x, segs, max(row_layout(sw, x.dtype.itemsize, lanes)[1] for _, sw in segs)


@functools.partial(jax.jit, static_argnames=("npc", "fmt", "round_sf", "col_major", "packed", "write_data",
                                             "compute_sf", "interpret"))
def _kernel(x, sf_in, *, npc, fmt, round_sf, col_major, packed, write_data, compute_sf, interpret):
  """``x`` ``(M, K)``, ``sf_in`` layout-A ``(M, Kb)`` or None -> ``(out (M, K) e4m3 or (M, K/2) int8 |
  None, sf in layout A / B / C | None)``. The kernel writes layouts B / C itself when each view row is
  a row (whole-row groups, column segments, or groups dividing ``K`` as column segments in chunks of
  :data:`SEG_CHUNK` per CTA when ``M`` is at least one layout block); otherwise XLA reformats its
  layout-A sf."""
  m, k = x.shape
  r, w, segs = tiling.row_plan(m, k, npc)
  kb = ref.cdiv(k, npc)
  # One scale per row: whole warps per row; groups as view rows: GROUP_LANES; column segments: SEGMENT_LANES.
  lanes = 32 if npc >= k else SEGMENT_LANES if r == m else tiling.GROUP_LANES
  seg_chunk = None
  # Groups dividing K: column segments of the rows, except e2m1 groups narrower than 128 (H200, bf16,
  # packed layout C, as view rows + XLA sf reformat vs as segments: npc 64 4001x7168 87.2 vs 97.3 µs,
  # 8001x7168 162.1 vs 186.2; npc 32 101.5 vs 100.5, 187.8 vs 191.7).
  if col_major and sf_in is None and r != m and (fmt == "e4m3" or npc >= 128):
    csegs = tuple((j * npc, npc) for j in range(kb))
    xv, vsegs, unit = _view(x, csegs, fmt, SEGMENT_LANES)
    if unit <= m:
      r, segs, seg_chunk, lanes = m, vsegs, SEG_CHUNK, SEGMENT_LANES
  if seg_chunk is None:
    xv, segs, unit = _view(x.reshape(r, w), segs, fmt, lanes)
  rp = max(r, unit)
  if rp != r:  # fewer rows than one layout block: pad (tiny inputs only)
    xv = jnp.pad(xv, ((0, rp - r),) + ((0, 0),) * (xv.ndim - 1))
  if sf_in is not None:
    sf_in = sf_in.reshape(1, r) if len(segs) == 1 else sf_in.T
    sf_in = jnp.pad(sf_in, ((0, 0), (0, rp - r)), constant_values=1.0)
  in_kernel = col_major and r == m and rp == r
  sf_layout = ("C" if packed else "B") if in_kernel else "rows"
  out, sf = row_kernel(xv, sf_in, segs=segs, lanes=lanes, fmt=fmt, round_sf=round_sf, write_data=write_data,
                       compute_sf=compute_sf, interpret=interpret, sf_layout=sf_layout, seg_chunk=seg_chunk)
  if out is not None:
    out = out[:r].reshape(m, out.shape[1] * r // m)
  if sf is not None and not in_kernel:
    sf = sf[:, :r]
    sf = ref.format_sf(sf.reshape(m, kb) if len(segs) == 1 else sf.T, col_major, packed)
  return out, sf


_QUANT_ITEMSIZE = {"e4m3": 1, "e4m3x2": 2, "e2m1": 2}  # row_layout itemsize: up to 16 decoded values per vector
_QUANT_THREAD_BYTES = {"e4m3": 64, "e4m3x2": 64, "e2m1": 32}  # 64 values per thread


def _quant_plan(q, x_block_size, npc, fmt):
  """How the kernel runs a QuantTensor input: ``(kind, view width divisor, segments, seg_chunk,
  itemsize)``, or a string saying why it cannot: groups must not straddle input blocks, a partial last
  group allows at most :data:`jaxkern.quant._tiling.MAX_SEGMENTS` groups, and blocks taller than one
  row must be at least one register layout block of rows (narrower vectors are tried for that),
  which the input must have too."""
  m = q.shape[0]
  fp4_in = q.dtype != jnp.float8_e4m3fn
  k = q.shape[1] * (2 if fp4_in else 1)
  ep = 2 if fp4_in or fmt == "e2m1" else 1  # elements per view column
  kind = "e2m1" if fp4_in else "e4m3x2" if ep == 2 else "e4m3"
  bm, bk = x_block_size
  kb = ref.cdiv(k, npc)
  if bk % ep:
    return f"input blocks of an odd width ({bk} columns) with pairs of values per kernel column"
  if max(bk, npc) % min(bk, npc):
    return f"groups of {npc} columns straddle input blocks of {bk} columns"
  if k % npc and kb > tiling.MAX_SEGMENTS:
    return f"a partial last group with more than {tiling.MAX_SEGMENTS} groups per row ({kb})"
  segs = tuple((j * npc // ep, min(npc, k - j * npc) // ep) for j in range(kb))
  for itemsize in (_QUANT_ITEMSIZE[kind], 4, 8, 16):
    unit = max(row_layout(pw, itemsize, SEGMENT_LANES)[1] for c, sw in segs for _, pw in _parts(c, sw, bk // ep))
    if bm == 1 or unit <= bm:
      break
  if 1 < bm < unit:
    return f"input blocks of {bm} rows, fewer than one register layout block ({unit} rows)"
  if m < unit:
    return f"{m} rows, fewer than one register layout block ({unit} rows)"
  return kind, ep, segs, SEG_CHUNK if k % npc == 0 else None, itemsize


@functools.partial(jax.jit, static_argnames=("x_block_size", "x_col_major", "npc", "fmt", "round_sf", "col_major",
                                             "packed", "interpret"))
def _quant_kernel(q, sf, *, x_block_size, x_col_major, npc, fmt, round_sf, col_major, packed, interpret):
  """QuantTensor ``(q, sf)`` -> ``(out, out_sf)`` of :func:`per_token_cast`: rows with one column
  segment per output group (chunks of :data:`SEG_CHUNK` groups per CTA when they divide ``K``); e4m3
  data as bytes, or as int16 words of two bytes for an e2m1 output; packed e2m1 as bytes (pairs)."""
  kind, ep, segs, seg_chunk, itemsize = _quant_plan(q, x_block_size, npc, fmt)
  m = q.shape[0]
  k = q.shape[1] * (2 if kind == "e2m1" else 1)
  qv = lax.bitcast_convert_type(q.reshape(m, k // 2, 2), jnp.int16) if kind == "e4m3x2" else q
  mode = "packed" if sf.dtype == jnp.int32 else "rows" if x_col_major else "cols"
  bm, bk = x_block_size
  quant_in = QuantIn(kind, sf, mode, bm, bk // ep, ref.cdiv(m, bm), itemsize)
  sf_layout = ("C" if packed else "B") if col_major else "rows"
  out, out_sf = row_kernel(qv, None, segs=segs, lanes=SEGMENT_LANES, fmt=fmt, round_sf=round_sf, write_data=True,
                           compute_sf=True, interpret=interpret, sf_layout=sf_layout, seg_chunk=seg_chunk,
                           thread_bytes=_QUANT_THREAD_BYTES[kind], quant_in=quant_in)
  if out.dtype == jnp.int16:  # e4m3 pairs
    out = lax.bitcast_convert_type(out, jnp.float8_e4m3fn).reshape(m, k)
  return out, (out_sf if col_major else out_sf.T)


def _check_plain(x, fmt, npc, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  validate.check_fmt(fmt)
  validate.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  k = x.shape[1]
  if npc not in (16, 32, 64, 128) and npc != k:
    raise ValueError(f"num_per_channels must be 16, 32, 64, 128 or K={k}, got {npc}")
  if npc == k and k % 64:
    raise ValueError(f"num_per_channels == K needs K % 64 == 0, got x.shape {tuple(x.shape)}")
  if fmt == "e2m1":
    _checks.check_multiple("x", x, 1, 2)
  return x


def _check_quant(x, fmt, npc, x_block_size, x_col_major, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  """Checks a QuantTensor input of :func:`per_token_cast`; returns ``(q, sf)`` as arrays."""
  if len(x) != 2:
    raise ValueError(f"x must be a QuantTensor (data, sf) or an array, got a tuple of {len(x)}")
  x = (_checks.as_array("x[0]", x[0]), _checks.as_array("x[1]", x[1]))
  k = validate.check_quant_tensor("x", x, x_block_size, col_major=x_col_major)
  validate.check_fmt(fmt)
  validate.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  if npc not in (16, 32, 64, 128):
    raise ValueError(f"num_per_channels must be 16, 32, 64 or 128 for a QuantTensor input, got {npc}")
  if fmt == "e2m1" and k % 2:
    raise ValueError(f"fmt='e2m1' needs an even logical width K, got K={k}")
  return x


def _plain_unsupported(x, npc) -> str | None:
  """Why the kernel cannot cast the plain input ``x``, or None."""
  if tiling.row_plan(*x.shape, npc) is None:
    return (f"a partial last group with more than {tiling.MAX_SEGMENTS} groups per row (K={x.shape[1]}, "
            f"num_per_channels={npc})")
  return None


def _run_kernel(x, fmt, npc, interpret, *, sf_in=None, round_sf=False, col_major=False, packed=False,
                write_data=True, compute_sf=True):
  return _kernel(x, sf_in, npc=npc, fmt=fmt, round_sf=round_sf, col_major=col_major, packed=packed,
                 write_data=write_data, compute_sf=compute_sf, interpret=_config.mosaic_interpret(interpret))


def per_token_cast(x: jax.typing.ArrayLike | QuantTensor | tuple[jax.Array, jax.Array], fmt: str, num_per_channels: int,
                   *, x_block_size: tuple[int, int] | None = None, use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False, x_use_tma_aligned_col_major_sf: bool = False,
                   implementation: str | None = None) -> QuantTensor:
  """Row-wise cast to FP8 e4m3 or packed FP4 e2m1, one scale per ``num_per_channels`` columns (docs/quant.md, "Casts").

  Args:
    x: ``(M, K)`` bfloat16 / float32 array (or nested list), or a QuantTensor ``(data, sf)``: e4m3
      ``(M, K)`` or int8 / uint8 packed e2m1 ``(M, K/2)`` data, float32 sf in layout A ``(Mb, Kb)`` or B
      (with ``x_use_tma_aligned_col_major_sf``), or int32 packed UE8M0 layout C, for blocks ``x_block_size``.
    fmt: ``"e4m3"`` or ``"e2m1"`` (``K`` even); ``"e5m6"`` runs :func:`jaxkern.quant.per_token_cast_to_e5m6`
      (plain input, ``num_per_channels == K``; its result, checks and XLA cases).
    num_per_channels: group width: 16, 32, 64, 128, or ``K`` (plain input, ``K % 64 == 0``); the last
      group may be partial.
    x_block_size: ``(bm, bk)`` of a QuantTensor input; None for a plain input.
    use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: output sf layout B / power-of-two sf /
      packed UE8M0 layout C (:mod:`jaxkern.reference.quant`); packed needs the other two.
    x_use_tma_aligned_col_major_sf: a float32 input sf is the layout-B buffer.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._dispatch`).

  Returns:
    ``QuantTensor(data, sf)``: ``data`` ``(M, K)`` float8_e4m3fn or ``(M, K/2)`` int8 (column ``2j`` in
    the low nibble); ``sf`` layout A ``(M, Kb)`` float32, B ``(Kb, align(M, 4))`` float32 or C
    ``(ceil(Kb/4), align(M, 4))`` int32, ``Kb = ceil(K / num_per_channels)``.

  Raises:
    ValueError: another rank or dtype, a ``num_per_channels`` or ``fmt`` outside the lists above, an odd
      ``K`` with e2m1, packed without column-major and ``round_sf``, ``x_block_size`` given for a plain
      input or missing for a QuantTensor, an input sf of the wrong shape or dtype.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` for the XLA cases below.

  XLA (the reference) instead of a kernel: zero rows; a plain input with a partial last group and more
  than 16 groups per row; QuantTensor inputs whose groups straddle input blocks, with fewer rows than one
  register layout block, blocks of 2 rows to one layout block, odd block widths with an e2m1 side, or a
  partial last group and more than 16 groups (:func:`jaxkern.explain` names the reason). Everything else
  runs the kernel; its figures are in the module docstring.

  Non-finite inputs (NaN, ±inf; outside upstream's contract, docs/quant.md, "Non-finite inputs and edge cases")
  give the same bits from the kernel (compiled or interpreted) and the reference on every backend: the amax is
  NaN-propagating (a group with a NaN has sf NaN, one with ±inf sf +inf; with ``round_sf`` -0.0 / +inf, UE8M0
  bytes 0 / 255), the data are ``encode(x · sf_inv)`` as for finite inputs (±inf saturates), and every NaN result
  is the GPU's canonical NaN 0x7FFFFFFF (NaN data: e4m3 0x7F, e2m1 +6). A QuantTensor input's amax is ``max|data| · sf_in``
  per input block within the group, so an infinite input sf gives sf +inf (NaN only where that block's part of
  the group holds only zeros; the data of such a group are NaN). Details:
  :func:`jaxkern.reference.quant.per_token_cast`.

  Differentiation: not differentiable (data and sf of a QuantTensor input too); ``jax.grad`` / ``jax.jvp``
  through it raise :class:`jaxkern.NotDifferentiableError`. Apply it to ``jax.lax.stop_gradient(x)``, or wrap
  it in the ``jax.custom_vjp`` you want (e.g. straight-through).
  """
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
               use_packed_ue8m0=use_packed_ue8m0)
  npc = num_per_channels
  if fmt == "e5m6":
    return _to_e5m6(x, npc, x_block_size, x_use_tma_aligned_col_major_sf, flags, implementation)
  if isinstance(x, tuple):
    x = _check_quant(x, fmt, npc, x_block_size, x_use_tma_aligned_col_major_sf, **flags)
    x = validate.guard("per_token_cast", x)
    x_block_size = tuple(x_block_size)
    plan = _quant_plan(x[0], x_block_size, npc, fmt)
    unsupported = plan if isinstance(plan, str) else None
    empty = x[0].shape[0] == 0

    def kernel(interpret):
      return QuantTensor(*_quant_kernel(
          *x, x_block_size=x_block_size, x_col_major=x_use_tma_aligned_col_major_sf, npc=npc, fmt=fmt,
          round_sf=round_sf, col_major=use_tma_aligned_col_major_sf, packed=use_packed_ue8m0,
          interpret=_config.mosaic_interpret(interpret)))
  else:
    if x_block_size is not None:
      raise ValueError(f"x_block_size must be None for a plain input, got {x_block_size}")
    x = validate.guard("per_token_cast", _check_plain(x, fmt, npc, **flags))
    unsupported, empty = _plain_unsupported(x, npc), x.shape[0] == 0

    def kernel(interpret):
      return QuantTensor(*_run_kernel(x, fmt, npc, interpret, round_sf=round_sf,
                                      col_major=use_tma_aligned_col_major_sf, packed=use_packed_ue8m0))

  def reference():
    return ref.per_token_cast(x, fmt, npc, x_block_size=x_block_size, **flags,
                              x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)

  return _dispatch.run("per_token_cast", implementation, kernel=kernel, xla=reference, unsupported=unsupported,
                       empty=empty)


def _to_e5m6(x, npc, x_block_size, x_col_major, flags, implementation):
  """``per_token_cast(x, "e5m6", ...)``: :func:`jaxkern.quant.per_token_cast_to_e5m6` of a plain input."""
  if isinstance(x, tuple) or x_block_size is not None or x_col_major:
    raise ValueError("fmt='e5m6' needs a plain (M, K) array x (no QuantTensor, x_block_size None)")
  return per_token_cast_to_e5m6(x, npc, **flags, implementation=implementation)


def _plain_only(x, x_block_size):
  if isinstance(x, tuple) or x_block_size is not None:
    raise ValueError("x must be a plain (M, K) array and x_block_size None (no QuantTensor input)")


def per_token_cast_with_sf_only(x: jax.typing.ArrayLike, fmt: str, num_per_channels: int, *,
                                x_block_size: tuple[int, int] | None = None, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False,
                                implementation: str | None = None) -> jax.Array:
  """The ``sf`` of :func:`per_token_cast` for a plain ``(M, K)`` bfloat16 / float32 ``x``, bit-identical,
  without writing the data. Arguments, layouts, errors, XLA cases and non-finite inputs as
  :func:`per_token_cast` (``x_block_size`` must be None: no QuantTensor input).

  Differentiation: not differentiable, as :func:`per_token_cast` (raises :class:`jaxkern.NotDifferentiableError`).
  """
  _plain_only(x, x_block_size)
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
               use_packed_ue8m0=use_packed_ue8m0)
  x = validate.guard("per_token_cast_with_sf_only", _check_plain(x, fmt, num_per_channels, **flags))

  def kernel(interpret):
    return _run_kernel(x, fmt, num_per_channels, interpret, round_sf=round_sf,
                       col_major=use_tma_aligned_col_major_sf, packed=use_packed_ue8m0, write_data=False)[1]

  return _dispatch.run("per_token_cast_with_sf_only", implementation, kernel=kernel,
                       xla=lambda: ref.per_token_cast_with_sf_only(x, fmt, num_per_channels, **flags),
                       unsupported=_plain_unsupported(x, num_per_channels), empty=x.shape[0] == 0)


def per_token_cast_with_precomputed_sf(x: jax.typing.ArrayLike, fmt: str, num_per_channels: int, sf: jax.Array, *,
                                       x_block_size: tuple[int, int] | None = None,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False, implementation: str | None = None) -> jax.Array:
  """Quantises a plain ``(M, K)`` bfloat16 / float32 ``x`` with a caller-given sf.

  ``sf``: float32 layout A ``(M, ceil(K / num_per_channels))`` (a dequantisation sf, e.g. the ``sf`` of
  :func:`per_token_cast`); ``sf_inv = RN(1 / sf)``, ``data = encode(x · sf_inv)`` with the e4m3 clamp to
  ±448 (it can bite here). ``round_sf`` has no effect. Returns ``data`` only: ``(M, K)`` float8_e4m3fn or
  ``(M, K/2)`` int8 packed e2m1. Non-finite ``x`` encode as in :func:`per_token_cast`.

  Preconditions: every ``sf`` finite and non-zero. A concrete ``sf`` with a zero, inf or NaN raises
  ``ValueError``; a traced one gives unspecified data, and ``checkify.checkify(f, errors=checkify.user_checks)``
  reports the first such scale (docs/usage.md, "Bad values under jit").

  Raises ValueError as :func:`per_token_cast`, and for an ``sf`` of another shape or dtype or (concrete) values
  outside the preconditions, a QuantTensor
  ``x``, ``x_block_size`` given, or ``use_tma_aligned_col_major_sf`` / ``use_packed_ue8m0`` set.
  KernelUnavailableError and XLA cases (zero rows, a partial last group and more than 16 groups per row) as
  :func:`per_token_cast` for a plain input.

  Differentiation: not differentiable in ``x`` or ``sf``, as :func:`per_token_cast` (raises
  :class:`jaxkern.NotDifferentiableError`).
  """
  _plain_only(x, x_block_size)
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    raise ValueError("use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False with a precomputed sf")
  x = _check_plain(x, fmt, num_per_channels, False, False, False)
  m, k = x.shape
  sf = _checks.as_array("sf", sf)
  validate.check_sf("sf", sf, (m, ref.cdiv(k, num_per_channels)), jnp.float32)
  _checks.check_and_debug_check("per_token_cast_with_precomputed_sf", "sf", sf, _checks.zero_or_not_finite,
                                "a finite non-zero scale (1 / sf would be inf or 0: the data would look valid)")
  x, sf = validate.guard("per_token_cast_with_precomputed_sf", x, sf)

  def kernel(interpret):
    return _run_kernel(x, fmt, num_per_channels, interpret, sf_in=sf, compute_sf=False)[0]

  return _dispatch.run("per_token_cast_with_precomputed_sf", implementation, kernel=kernel,
                       xla=lambda: ref.per_token_cast_with_precomputed_sf(x, fmt, num_per_channels, sf),
                       unsupported=_plain_unsupported(x, num_per_channels), empty=m == 0)

"""Per-block casts (``bm × bk`` blocks, ``bm, bk ∈ {32, 128}``) and the lossless FP4 -> FP8 re-quantisation.

Mosaic GPU kernel for e4m3 and bf16 -> e2m1 (``per_block_cast*``): each CTA owns one block row and ``nb`` block
columns (``bm · nb·bk`` elements, ``nb·bk`` = 256 columns for ``bm = 32``, 128 for ``bm = 128``).
Each block comes in by its own TMA box into an untiled SMEM buffer (the box clips at the array
edges and zero-fills, so partial blocks and any row count need no padding), is loaded into
registers in :func:`jaxkern._layouts.row_layout` (conflict-free: the buffer is contiguous), and
reduced over both axes to the block's amax; the quantisation re-reads the buffer, writes e4m3 to an
SMEM buffer and TMA stores it (clipped at the edges). The sf is stored per block from the kernel,
float32 ``(Mb, kt·nb)``; the wrapper cuts the padding columns and formats the layout. Divisions and
non-finite inputs (NaN-propagating maxima, saturating e4m3, canonical NaN) as in
:mod:`jaxkern.quant._per_token_cast`.

e2m1 from bf16 reads each pair of columns as one int32 word (a free bitcast of the input; the data
TMA boxes are half as wide) and packs the two nibbles per output byte as in
:mod:`jaxkern.quant._per_token_cast`, with the short encoder :func:`jaxkern.quant._encode.encode_e2m1`.
float32 -> e2m1 has its own kernel (:func:`_fp4_from_f32_kernel`) that reads the even and odd
columns straight from GMEM (strided SMEM loads do not lower) and stores through SMEM and TMA.

e4m3 with 32-row blocks, computed sf (:func:`_wide_kernel`, chosen by :func:`_variant`): each CTA owns
one block row and ``WIDE_COLS`` columns (eight 32x32 blocks), brought in by one TMA box and read from the
untiled SMEM buffer as a ``(32, blocks, bk/vec, vec)`` view in :func:`jaxkern._layouts.group_vectors_layout`
(16-byte vectors, a block's columns on consecutive lanes): the amax of all of the CTA's blocks is one
reduction (in-thread and lane shuffles over the block's columns, then over the rows), the sf one vector
division, and the quantised tile one TMA store; the per-block kernel above reduces and divides block by
block, one warpgroup synchronisation each, which dominated narrow rows (K = 576: 2x TileKernels' time).

``per_block_cast_lossless`` computes the exponents per block in XLA (small: one value per input
block) and moves the data through the packed-e2m1 row kernel of :mod:`jaxkern.quant._cast_back`
with an e4m3 output (decode, multiply by the block's power of two, saturating e4m3 pairs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern._layouts import group_vectors_layout, row_layout
from jaxkern.quant import _validate as validate
from jaxkern.quant._encode import encode_e2m1
from jaxkern.quant._cast_back import _kernel as _cast_back_kernel
from jaxkern.quant._per_token_cast import abs_key, gpu_nan, key_value, to_e4m3
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor

BLOCK_SIDES = (32, 128)


def _blocks_per_cta(block_size) -> int:
  bm, bk = block_size
  return (256 if bm == 32 else 128) // bk


WIDE_COLS = 256  # columns per CTA of the wide kernel (one TMA box: at most 256 elements per dimension)
WIDE_DTYPES = ("bfloat16",)  # inputs for which "auto" picks the wide kernel (float32 lowers too; not timed yet)
# "blocks" / "wide" / ("wide", cols) / ("wide_direct", cols) / ("split", rows) / ("split_direct", rows): forces
# the e4m3 kernel with computed sf (timing scripts)
_VARIANT_OVERRIDE = None


# 128x128 blocks of a WIDE_DTYPES input with K up to this run the wide kernel one block wide (("wide", 128)).
# H100, 2026-11-26 (scratch/time_narrow2.py, CUPTI cold L2, bit-exact): M=4001 / 8001 x K=576 / 2048 all 1.02-1.05x
# faster than the per-block kernel (K=576 7.10 -> 6.75 µs at M=4001); K > 2048 not timed.
WIDE128_MAX_K = 2048


def _variant(x_dtype, fmt, block_size, precomputed, k: int) -> str | tuple:
  """The e4m3 kernel for these arguments: ``"wide"`` (:func:`_wide_kernel`) for 32x32 blocks with computed
  sf from a :data:`WIDE_DTYPES` input, ``("wide", 128)`` for 128x128 ones with ``K <= WIDE128_MAX_K``, else
  ``"blocks"`` (:func:`_kernel`)."""
  if fmt != "e4m3" or precomputed:
    return "blocks"
  if _VARIANT_OVERRIDE is not None:  # the wide kernel also runs 128-row blocks (one or two per CTA)
    return _VARIANT_OVERRIDE
  if jnp.dtype(x_dtype).name not in WIDE_DTYPES:
    return "blocks"
  if block_size == (32, 32):
    return "wide"
  return ("wide", 128) if block_size == (128, 128) and k <= WIDE128_MAX_K else "blocks"


def _untiled(width, array_width):
  """SMEM transforms of a ``(·, width)`` TMA buffer of an array ``array_width`` wide: a one-row tiling
  keeps the buffer row-major and stops the transform inference from choosing an (8, ·) tiling, which
  would make TMA require a row count that is a multiple of 8; the tile width must divide the array's
  width too (K/2 is only a multiple of 32)."""
  return (plgpu.TilingTransform((1, math.gcd(64, width, array_width))),)


def _load_halves(x_s, layout, fp4):
  """Float32 values of an SMEM block: ``(v,)``, or for e2m1 (bf16 pairs as int32 words) the even
  and odd columns."""
  if not fp4:
    return (plgpu.load(x_s, layout=layout).astype(jnp.float32),)
  u = plgpu.load(x_s, layout=layout)
  return (lax.bitcast_convert_type(u << 16, jnp.float32), lax.bitcast_convert_type(u & jnp.int32(-65536), jnp.float32))


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "round_sf", "write_data", "compute_sf",
                                             "split", "direct", "interpret"))
def _kernel(x, sf_in, *, fmt, block_size, round_sf, write_data, compute_sf, interpret, split=None, direct=False):
  """``x`` ``(M, K)``; ``sf_in`` precomputed layout-A sf ``(Mb, Kb)`` or None.

  Returns ``(out (M, K) e4m3 or (M, K/2) int8 | None, sf (Mb, Kb) float32 | None)``.

  ``split`` (e4m3 only, a divisor of ``bm``; :data:`_VARIANT_OVERRIDE` ``("split", rows)``): each block comes in
  as ``bm / split`` TMA boxes of ``split`` rows with a barrier each, its amax is reduced chunk by chunk as
  the chunks arrive (``split`` rows in registers, not ``bm``), and each quantised chunk is TMA-stored as soon
  as it is written, so loads, reductions and stores of one CTA overlap. A chunk that would start at or
  past the last row is moved back to end there (never before the block's first row): it re-reads rows
  of its own block (the maximum is unchanged) and re-writes the same bytes, so no box lies wholly
  outside the array and nothing needs a predicate. With ``direct`` (``("split_direct", rows)``) a block wholly
  inside the array stores its chunks straight from registers to GMEM instead (no SMEM, fence or TMA store).
  """
  m, k = x.shape
  bm, bk = block_size
  nb = _blocks_per_cta(block_size)
  mb, kb, kt = ref.cdiv(m, bm), ref.cdiv(k, bk), ref.cdiv(k, nb * bk)
  fp4 = fmt == "e2m1"  # bf16 only: each pair of columns as one int32 word (a free bitcast of the input)
  if fp4:
    x = lax.bitcast_convert_type(x.reshape(m, k // 2, 2), jnp.int32)
  obk = bk // 2 if fp4 else bk  # block width in x's columns and in output bytes
  layout, _ = row_layout(obk, x.dtype.itemsize)
  # e2m1 works on 32-row slices of a block: the integer rounding of a whole 128-row block at once
  # needs too many registers (measured 6x slower than the e4m3 kernel on the H200).
  if split is not None and (fp4 or bm % split):
    raise ValueError(f"split={split}: e4m3 only, a divisor of the block's {bm} rows")
  rc = 32 if fp4 else (split or bm)
  chunks = [pl.ds(r0, rc) for r0 in range(0, bm, rc)]
  nc = len(chunks) if split else 1  # TMA boxes (and barriers) per block
  out_type = []
  if write_data:
    out_type.append(jax.ShapeDtypeStruct((m, k // 2), jnp.int8) if fp4 else
                    jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn))
  if compute_sf:
    out_type.append(jax.ShapeDtypeStruct((mb, kt * nb), jnp.float32))

  scratch = dict(x_s=plgpu.SMEM((nb, bm, obk), x.dtype, transforms=_untiled(obk, x.shape[1])),
                 bar=plgpu.Barrier(num_arrivals=1, num_barriers=nb * nc))
  if write_data:
    scratch["o_s"] = plgpu.SMEM((nb, bm, obk), jnp.int8 if fp4 else jnp.float8_e4m3fn,
                                 transforms=_untiled(obk, k // 2 if fp4 else k))

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(mb, kt), grid_names=("i", "j"),
                     scratch_types=scratch, interpret=interpret)
  def kernel(*refs, x_s, bar, o_s=None):
    x_g, c_g, *rest = refs
    sfin_g = rest.pop(0) if sf_in is not None else None
    o_g = rest.pop(0) if write_data else None
    sf_g = rest.pop(0) if compute_sf else None
    i, j = lax.axis_index("i"), lax.axis_index("j")
    rows = pl.ds(i * bm, bm)
    if split:
      _split_body(x_g, c_g, sfin_g, o_g, sf_g, x_s, bar, o_s, i, j)
      return

    for s in range(nb):
      plgpu.copy_gmem_to_smem(x_g.at[rows, pl.ds((j * nb + s) * obk, obk)], x_s.at[s], bar.at[s])
    for s in range(nb):
      plgpu.barrier_wait(bar.at[s])
      # The block's amax / sf are scalars; the sf arithmetic (bit casts) runs on splat vectors
      # (one register per thread), as scalar bit casts do not lower.
      if sf_in is not None:
        inv = _ieee.exact_div(1.0, jnp.broadcast_to(sfin_g[i, j * nb + s], (rc,)))
      else:
        a = key_value(functools.reduce(jnp.maximum, [
            jnp.max(jnp.max(abs_key(h, interpret), axis=1), axis=0)
            for c in chunks for h in _load_halves(x_s.at[s, c], layout, fp4)]), interpret)
        sf, inv = ref.scale_factors(jnp.broadcast_to(a, (rc,)), jnp.broadcast_to(c_g[0], (rc,)), fmt, round_sf,
                                    div=_ieee.exact_div)
        if compute_sf:
          sf_g[i, j * nb + s] = jnp.max(gpu_nan(sf, interpret), axis=0)
      if write_data:
        for c in chunks:
          q = [gpu_nan(h * inv[:, None], interpret) for h in _load_halves(x_s.at[s, c], layout, fp4)]
          if fp4:
            o_s.at[s, c][...] = (encode_e2m1(q[0]) | (encode_e2m1(q[1]) << 4)).astype(jnp.int8)
          else:
            o_s.at[s, c][...] = ref.encode_e4m3(q[0]) if sf_in is not None else to_e4m3(q[0], interpret)
    if write_data:
      plgpu.commit_smem()
      for s in range(nb):
        plgpu.copy_smem_to_gmem(o_s.at[s], o_g.at[rows, pl.ds((j * nb + s) * obk, obk)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def _split_body(x_g, c_g, sfin_g, o_g, sf_g, x_s, bar, o_s, i, j):
    """The ``split`` kernel body (e4m3): chunked loads, per-chunk reductions, per-chunk stores."""
    starts = [jnp.maximum(jnp.minimum(i * bm + c * rc, m - rc), i * bm) for c in range(nc)]
    for s in range(nb):
      for c in range(nc):
        plgpu.copy_gmem_to_smem(x_g.at[pl.ds(starts[c], rc), pl.ds((j * nb + s) * obk, obk)], x_s.at[s, chunks[c]],
                                bar.at[s * nc + c])
    for s in range(nb):
      if sf_in is not None:
        inv = _ieee.exact_div(1.0, jnp.broadcast_to(sfin_g[i, j * nb + s], (rc,)))
      else:
        parts = []
        for c in range(nc):
          plgpu.barrier_wait(bar.at[s * nc + c])
          h = plgpu.load(x_s.at[s, chunks[c]], layout=layout).astype(jnp.float32)
          parts.append(jnp.max(jnp.max(abs_key(h, interpret), axis=1), axis=0))
        a = key_value(functools.reduce(jnp.maximum, parts), interpret)
        sf, inv = ref.scale_factors(jnp.broadcast_to(a, (rc,)), jnp.broadcast_to(c_g[0], (rc,)), fmt, round_sf,
                                    div=_ieee.exact_div)
        if compute_sf:
          sf_g[i, j * nb + s] = jnp.max(gpu_nan(sf, interpret), axis=0)
      if write_data:
        for c in range(nc):
          if sf_in is not None:
            plgpu.barrier_wait(bar.at[s * nc + c])
          h = plgpu.load(x_s.at[s, chunks[c]], layout=layout).astype(jnp.float32)
          q = gpu_nan(h * inv[:, None], interpret)
          q = ref.encode_e4m3(q) if sf_in is not None else to_e4m3(q, interpret)
          dst = o_g.at[pl.ds(starts[c], rc), pl.ds((j * nb + s) * obk, obk)]

          def tma_store(c=c, q=q, dst=dst):
            o_s.at[s, chunks[c]][...] = q
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[s, chunks[c]], dst)

          if not direct:
            tma_store()
          else:  # a block wholly inside the array: straight from registers (its chunks are never moved back)
            inside = ((i + 1) * bm <= m) & ((j * nb + s + 1) * obk <= k)

            @pl.when(inside)
            def _(q=q, dst=dst):
              dst[...] = q

            pl.when(jnp.logical_not(inside))(tma_store)
    if write_data:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  consts = jnp.full((1,), ref.MAX_VALUE[fmt], jnp.float32)
  if sf_in is not None:
    sf_in = jnp.pad(sf_in, ((0, 0), (0, kt * nb - kb)), constant_values=1.0)
  outs = list(kernel(*((x, consts) if sf_in is None else (x, consts, sf_in))))
  out = outs.pop(0) if write_data else None
  return out, (outs.pop(0)[:, :kb] if compute_sf else None)


@functools.partial(jax.jit, static_argnames=("block_size", "round_sf", "write_data", "cols", "direct", "interpret"))
def _wide_kernel(x, *, block_size, round_sf, write_data, cols=WIDE_COLS, direct=False, interpret):
  """e4m3, computed sf: ``x`` ``(M, K)`` -> ``(out (M, K) e4m3 | None, sf (Mb, Kb) float32)``; chosen for
  ``bm = 32`` (a 128-row block holds 128 float32 values per thread: timing scripts only).

  A CTA owns one block row and ``g = cols / bk`` blocks (fewer where ``K`` has fewer, a power of two so the
  TMA box never exceeds the array); the box clips at the edges and zero-fills (zeros leave an amax
  unchanged), the store clips. The SMEM buffers have no transforms (row-major, so the 4-D view is a plain
  reshape); interpret mode, which has no ref reshape, reshapes the loaded value instead.

  ``direct`` (:data:`_VARIANT_OVERRIDE` ``("wide_direct", cols)``, timing only): a CTA whose tile lies wholly
  inside the array stores the quantised tile straight from registers to GMEM (8-byte vectors, a warp's
  accesses contiguous), with no SMEM round trip, fence or TMA store to wait for; the edge CTAs keep the
  clipping TMA store.
  """
  m, k = x.shape
  bm, bk = block_size
  mb, kb = ref.cdiv(m, bm), ref.cdiv(k, bk)
  g = max(1, min(cols // bk, 1 << (kb.bit_length() - 1)))
  w, kt = g * bk, ref.cdiv(kb, g)
  lay, _ = group_vectors_layout(g, bk, x.dtype.itemsize)
  vec = min(16 // x.dtype.itemsize, bk)
  view = (bm, g, bk // vec, vec)
  out_type = [jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)] if write_data else []
  out_type.append(jax.ShapeDtypeStruct((mb, kt * g), jnp.float32))
  scratch = dict(x_s=plgpu.SMEM((bm, w), x.dtype), bar=plgpu.Barrier(num_arrivals=1))
  if write_data:
    scratch["o_s"] = plgpu.SMEM((bm, w), jnp.float8_e4m3fn)

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(mb, kt), grid_names=("i", "j"),
                     scratch_types=scratch, interpret=interpret)
  def kernel(x_g, c_g, *rest, x_s, bar, o_s=None):
    sf_g = rest[-1]
    i, j = lax.axis_index("i"), lax.axis_index("j")
    tile = (pl.ds(i * bm, bm), pl.ds(j * w, w))
    plgpu.copy_gmem_to_smem(x_g.at[tile], x_s, bar)
    plgpu.barrier_wait(bar)
    v = plgpu.load(x_s.reshape(*view).at[...], layout=lay) if interpret is None else x_s[...].reshape(view)
    v = v.astype(jnp.float32)
    a = key_value(jnp.max(jnp.max(jnp.max(abs_key(v, interpret), axis=3), axis=2), axis=0), interpret)
    sf, inv = ref.scale_factors(a, jnp.broadcast_to(c_g[0], (g,)), "e4m3", round_sf, div=_ieee.exact_div)
    sf_g[i, pl.ds(j * g, g)] = gpu_nan(sf, interpret)
    if write_data:
      q = to_e4m3(gpu_nan(v * inv[None, :, None, None], interpret), interpret)

      def tma_store():
        if interpret is None:
          o_s.reshape(*view)[...] = q
        else:
          o_s[...] = q.reshape(bm, w)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, rest[0].at[tile])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      if not direct:
        tma_store()
      else:
        inside = ((i + 1) * bm <= m) & ((j + 1) * w <= k)

        @pl.when(inside)
        def _():
          if interpret is None:
            rest[0].at[tile].reshape(*view)[...] = q
          else:
            rest[0][tile] = q.reshape(bm, w)

        pl.when(jnp.logical_not(inside))(tma_store)

  outs = list(kernel(x, jnp.full((1,), ref.MAX_VALUE["e4m3"], jnp.float32)))
  return (outs[0] if write_data else None), outs[-1][:, :kb]


CHUNK_ROWS = 32  # rows per register chunk of the float32 -> e2m1 kernel
KEPT_VALUES = 8192  # float32 -> e2m1: a CTA's values (nb blocks) stay in registers up to this many


@functools.partial(jax.jit, static_argnames=("block_size", "round_sf", "write_data", "compute_sf", "interpret"))
def _fp4_from_f32_kernel(x, sf_in, *, block_size, round_sf, write_data, compute_sf, interpret):
  """float32 ``x`` ``(M, K)`` -> e2m1: as :func:`_kernel`, but the input is read straight from GMEM.

  The pair view ``(M, K/2, 2)`` gives the even and odd columns as two strided loads (strided SMEM
  loads do not lower, and a TMA box cannot be narrower than 16 bytes). A CTA owns one block row and
  ``nb`` blocks (``bm·nb·bk ≤`` :data:`KEPT_VALUES`, kept in registers; a 128x128 block is read twice,
  once for its amax and once to quantise it) in chunks of :data:`CHUNK_ROWS` rows; a chunk past the
  last row is moved back to end there, its rows of the block above are masked out of the amax and land
  in the spare leading rows of the SMEM output buffer, which is TMA-stored clipped at the array edge.
  The last CTA column holds the remaining blocks (the last one possibly narrower).
  """
  m, k = x.shape
  bm, bk = block_size
  nb = max(1, KEPT_VALUES // (bm * bk))
  keep = bm * nb * bk <= KEPT_VALUES
  rc = min(CHUNK_ROWS, bm)
  mb, kb, kt = ref.cdiv(m, bm), ref.cdiv(k, bk), ref.cdiv(k, nb * bk)
  mp = max(m, rc)
  xv = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x  # fewer rows than one chunk (tiny inputs only)
  xv = xv.reshape(mp, k // 2, 2)
  p = bk // 2  # block width in pairs (= output bytes)
  tail = kb - (kt - 1) * nb  # blocks of the last CTA column
  last_w = (k - (kb - 1) * bk) // 2
  out_type = []
  if write_data:
    out_type.append(jax.ShapeDtypeStruct((mp, k // 2), jnp.int8))
  if compute_sf:
    out_type.append(jax.ShapeDtypeStruct((mb, kt * nb), jnp.float32))
  scratch = {}
  if write_data:  # rc spare leading rows per block for the rows of a moved-back chunk that lie above the block
    scratch["o_s"] = plgpu.SMEM((nb, rc + bm, p), jnp.int8, transforms=_untiled(p, k // 2))
    if last_w != p:  # the narrower last block has its own (contiguous) buffer
      scratch["o_t"] = plgpu.SMEM((rc + bm, last_w), jnp.int8, transforms=_untiled(last_w, k // 2))

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(mb, kt), grid_names=("i", "j"),
                     scratch_types=scratch, interpret=interpret)
  def kernel(*refs, o_s=None, o_t=None):
    x_g, c_g, *rest = refs
    sfin_g = rest.pop(0) if sf_in is not None else None
    o_g = rest.pop(0) if write_data else None
    sf_g = rest.pop(0) if compute_sf else None
    i, j = lax.axis_index("i"), lax.axis_index("j")
    starts = [jnp.minimum(i * bm + c * rc, mp - rc) for c in range(bm // rc)]

    def body(widths):
      """Blocks ``j·nb + s`` of widths ``widths[s]`` (pairs)."""
      lays = [row_layout(w, 16)[0] for w in widths]  # one float32 per thread and row segment
      bufs = [o_s.at[s] if w == p else o_t for s, w in enumerate(widths)] if write_data else None

      def load(s, c):
        cols = pl.ds((j * nb + s) * p, widths[s])
        return [plgpu.load(x_g.at[pl.ds(starts[c], rc), cols, h], layout=lays[s], optimized=False) for h in (0, 1)]

      vals = {(s, c): load(s, c) for s in range(len(widths)) for c in range(bm // rc)} if keep else None
      for s, lay in enumerate(lays):
        get = (lambda c: vals[s, c]) if keep else (lambda c: load(s, c))
        # The block's scalars as vectors in the rows' layout (splats without a layout leave the layout
        # inference too many choices: it exceeded Python's recursion limit for 8 blocks per CTA).
        splat = lambda v, lay=lay: plgpu.layout_cast(jnp.broadcast_to(v, (rc,)), lay.reduce(1))
        if sf_in is not None:
          inv = _ieee.exact_div(1.0, splat(sfin_g[i, j * nb + s]))
        else:
          rows = [plgpu.broadcasted_iota(jnp.int32, (rc,), 0, layout=lay.reduce(1)) + st for st in starts]
          a = key_value(functools.reduce(jnp.maximum, [
              jnp.max(jnp.where(r >= i * bm, jnp.max(jnp.maximum(abs_key(e, interpret), abs_key(o, interpret)),
                                                     axis=1), 0.0 if interpret is None else 0), axis=0)
              for r, (e, o) in zip(rows, map(get, range(bm // rc)))]), interpret)
          sf, inv = ref.scale_factors(splat(a), splat(c_g[0]), "e2m1", round_sf, div=_ieee.exact_div)
          if compute_sf:
            sf_g[i, j * nb + s] = jnp.max(gpu_nan(sf, interpret), axis=0)
        if write_data:
          for c in range(bm // rc):
            e, o = get(c)
            byte = (encode_e2m1(gpu_nan(e * inv[:, None], interpret))
                    | (encode_e2m1(gpu_nan(o * inv[:, None], interpret)) << 4))
            bufs[s].at[pl.ds(starts[c] - i * bm + rc, rc)][...] = byte.astype(jnp.int8)
      if write_data:
        plgpu.commit_smem()
        for s, w in enumerate(widths):
          plgpu.copy_smem_to_gmem(bufs[s].at[pl.ds(rc, bm)], o_g.at[pl.ds(i * bm, bm), pl.ds((j * nb + s) * p, w)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    last = (p,) * (tail - 1) + (last_w,)
    if kt == 1:
      body(last)
    else:
      pl.when(j < kt - 1)(lambda: body((p,) * nb))
      pl.when(j == kt - 1)(lambda: body(last))

  consts = jnp.full((1,), ref.FP4_MAX, jnp.float32)
  if sf_in is not None:
    sf_in = jnp.pad(sf_in, ((0, 0), (0, kt * nb - kb)), constant_values=1.0)
  outs = list(kernel(*((xv, consts) if sf_in is None else (xv, consts, sf_in))))
  out = outs.pop(0)[:m] if write_data else None
  return out, (outs.pop(0)[:, :kb] if compute_sf else None)


def _run_kernel(x, fmt, block_size, interpret, *, sf_in=None, round_sf=False, write_data=True, compute_sf=True):
  variant = _variant(x.dtype, fmt, block_size, sf_in is not None, x.shape[1])
  if isinstance(variant, tuple) and variant[0] in ("split", "split_direct"):
    return _kernel(x, sf_in, fmt=fmt, block_size=block_size, round_sf=round_sf, write_data=write_data,
                   compute_sf=compute_sf, split=variant[1], direct=variant[0] == "split_direct",
                   interpret=_config.mosaic_interpret(interpret))
  if variant == "wide" or isinstance(variant, tuple):
    cols = variant[1] if isinstance(variant, tuple) else WIDE_COLS
    direct = isinstance(variant, tuple) and variant[0] == "wide_direct"
    return _wide_kernel(x, block_size=block_size, round_sf=round_sf, write_data=write_data, cols=cols,
                        direct=direct, interpret=_config.mosaic_interpret(interpret))
  f = _fp4_from_f32_kernel if fmt == "e2m1" and x.dtype == jnp.float32 else functools.partial(_kernel, fmt=fmt)
  return f(x, sf_in, block_size=block_size, round_sf=round_sf, write_data=write_data, compute_sf=compute_sf,
           interpret=_config.mosaic_interpret(interpret))


def _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  """Checks the arguments of the per-block casts; returns ``(x, block_size)`` (an array, a tuple)."""
  if isinstance(x, tuple):
    raise ValueError("x must be a plain (M, K) array (no QuantTensor input for per-block casts)")
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  _checks.check_multiple("x", x, 1, 64)
  validate.check_fmt(fmt)
  if len(block_size) != 2 or any(b not in BLOCK_SIDES for b in block_size):
    raise ValueError(f"block_size must be (bm, bk) with bm, bk in {BLOCK_SIDES}, got {block_size}")
  validate.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  return x, tuple(block_size)


def per_block_cast(x, fmt: str, block_size, *, use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                   use_packed_ue8m0: bool = False, implementation: str | None = None) -> QuantTensor:
  """Blockwise cast to FP8 e4m3 or packed FP4 e2m1, one scale per ``bm × bk`` block (quant.md §6.1).

  Args:
    x: ``(M, K)`` bfloat16 / float32 array (or nested list), ``K % 64 == 0``, any ``M``; partial blocks at
      the bottom and right edges hold only the existing elements.
    fmt: ``"e4m3"`` or ``"e2m1"``.
    block_size: ``(bm, bk)``, ``bm, bk`` in ``(32, 128)``.
    use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: output sf layout B / power-of-two sf /
      packed UE8M0 layout C (:mod:`jaxkern.reference.quant`); packed needs the other two.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._dispatch`).

  Returns:
    ``QuantTensor(data, sf)``: ``data`` ``(M, K)`` float8_e4m3fn or ``(M, K/2)`` int8 (column ``2j`` in
    the low nibble); ``sf`` for ``(Mb, Kb) = (ceil(M/bm), ceil(K/bk))`` blocks: layout A ``(Mb, Kb)``
    float32, B ``(Kb, align(Mb, 4))`` float32 or C ``(ceil(Kb/4), align(Mb, 4))`` int32. The kernel writes
    the sf as float32 ``(Mb, Kb)``; XLA formats layouts B / C.

  Raises:
    ValueError: a QuantTensor ``x``, another rank or dtype, ``K % 64 != 0``, another ``fmt`` or block side,
      packed without column-major and ``round_sf``.

  XLA (the reference) instead of a kernel: zero rows only (no ``KernelUnavailableError`` case).

  Non-finite inputs behave per block as in :func:`jaxkern.quant.per_token_cast` (NaN-propagating amax,
  saturating encodings, NaN results the GPU's canonical NaN): kernel (compiled or interpreted) and
  reference give the same bits on every backend.

  Differentiation: not differentiable; ``jax.grad`` / ``jax.jvp`` through it raise
  :class:`jaxkern.NotDifferentiableError`. Apply it to ``jax.lax.stop_gradient(x)``, or wrap it in the
  ``jax.custom_vjp`` you want (e.g. straight-through).
  """
  x, block_size = _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  x = validate.guard("per_block_cast", x)
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
               use_packed_ue8m0=use_packed_ue8m0)

  def kernel(interpret):
    out, sf = _run_kernel(x, fmt, block_size, interpret, round_sf=round_sf)
    return QuantTensor(out, ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0))

  return _dispatch.run("per_block_cast", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast(x, fmt, block_size, **flags), empty=x.shape[0] == 0)


def per_block_cast_with_sf_only(x, fmt: str, block_size, *, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False,
                                implementation: str | None = None) -> jax.Array:
  """The ``sf`` of :func:`per_block_cast`, bit-identical, without writing the data (quant.md §6.2).
  Arguments, layouts, errors, XLA cases and non-finite inputs as :func:`per_block_cast`.

  Differentiation: not differentiable, as :func:`per_block_cast` (raises :class:`jaxkern.NotDifferentiableError`).
  """
  x, block_size = _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  x = validate.guard("per_block_cast_with_sf_only", x)
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
               use_packed_ue8m0=use_packed_ue8m0)

  def kernel(interpret):
    _, sf = _run_kernel(x, fmt, block_size, interpret, round_sf=round_sf, write_data=False)
    return ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)

  return _dispatch.run("per_block_cast_with_sf_only", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast_with_sf_only(x, fmt, block_size, **flags), empty=x.shape[0] == 0)


def per_block_cast_with_precomputed_sf(x, fmt: str, block_size, sf, *, use_tma_aligned_col_major_sf: bool = False,
                                       round_sf: bool = False, use_packed_ue8m0: bool = False,
                                       implementation: str | None = None) -> jax.Array:
  """Quantises ``x`` with a caller-given sf per block (quant.md §6.3).

  ``sf``: float32 layout A ``(ceil(M/bm), ceil(K/bk))``; ``sf_inv = RN(1 / sf)``, ``data = encode(x ·
  sf_inv)`` with the e4m3 clamp to ±448. ``round_sf`` has no effect. Returns ``data`` only: ``(M, K)``
  float8_e4m3fn or ``(M, K/2)`` int8 packed e2m1. Raises ValueError as :func:`per_block_cast`, and for an
  ``sf`` of another shape or dtype or ``use_tma_aligned_col_major_sf`` / ``use_packed_ue8m0`` set. XLA
  instead of the kernel for zero rows only. Non-finite ``x`` encode as in :func:`per_block_cast`; a zero
  or non-finite ``sf`` is outside the contract.

  Differentiation: not differentiable in ``x`` or ``sf``, as :func:`per_block_cast` (raises
  :class:`jaxkern.NotDifferentiableError`).
  """
  x, block_size = _check(x, fmt, block_size, False, False, False)
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    raise ValueError("use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False with a precomputed sf")
  m, k = x.shape
  sf = _checks.as_array("sf", sf)
  validate.check_sf("sf", sf, (ref.cdiv(m, block_size[0]), ref.cdiv(k, block_size[1])), jnp.float32)
  x, sf = validate.guard("per_block_cast_with_precomputed_sf", x, sf)

  def kernel(interpret):
    return _run_kernel(x, fmt, block_size, interpret, sf_in=sf, compute_sf=False)[0]

  return _dispatch.run("per_block_cast_with_precomputed_sf", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast_with_precomputed_sf(x, fmt, block_size, sf), empty=m == 0)


def per_block_cast_lossless(x, fmt: str, x_block_size, out_block_size, *, use_tma_aligned_col_major_sf: bool = False,
                            round_sf: bool = False, use_packed_ue8m0: bool = False,
                            x_use_tma_aligned_col_major_sf: bool = False,
                            implementation: str | None = None) -> QuantTensor:
  """Exact re-quantisation of a packed-e2m1 QuantTensor with power-of-two sf into e4m3 with larger blocks
  (quant.md §6.4): every dequantised value is kept.

  Args:
    x: QuantTensor ``(data, sf)``: int8 / uint8 packed e2m1 ``(M, K/2)`` data (logical ``K % 32 == 0``),
      power-of-two float32 sf in layout A ``(Mb, Kb)`` or B (``x_use_tma_aligned_col_major_sf``), or int32
      packed UE8M0 layout C, for blocks ``x_block_size``.
    fmt: ``"e4m3"``.
    x_block_size, out_block_size: ``(bm, bk)`` of the input and output blocks; each output side a multiple
      of the input side, the widths powers of two.
    use_tma_aligned_col_major_sf, use_packed_ue8m0: output sf layout B / packed UE8M0 layout C (the sf are
      powers of two; ``round_sf`` has no effect).
    x_use_tma_aligned_col_major_sf: a float32 input sf is the layout-B buffer.
    implementation: see :func:`per_block_cast`.

  Returns:
    ``QuantTensor(data (M, K) float8_e4m3fn, sf)`` for blocks ``out_block_size`` in the layout of the flags.

  Raises:
    ValueError: e4m3 data, a logical ``K % 32 != 0``, another ``fmt``, block sizes as above violated, an
      input sf of the wrong shape or dtype, packed without column-major.

  Precondition (not checked inside ``jit``): within one output block the input sf span at most 2^11;
  otherwise the values round or flush in the e4m3 conversion. The block exponents are computed by XLA
  (one value per input block), the data by the e2m1 cast-back row kernel with a saturating e4m3 output.
  XLA (the reference) instead of the kernel: zero rows only.

  Differentiation: not differentiable (its input is quantised data): ``jax.grad`` / ``jax.jvp`` through the
  input sf raise :class:`jaxkern.NotDifferentiableError`; pass it through ``jax.lax.stop_gradient``.
  """
  if not (isinstance(x, tuple) and len(x) == 2):
    raise ValueError("x must be a QuantTensor (data, sf)")
  x = QuantTensor(_checks.as_array("x[0]", x[0]), _checks.as_array("x[1]", x[1]))
  k = validate.check_quant_tensor("x", x, x_block_size, col_major=x_use_tma_aligned_col_major_sf)
  if x.data.dtype == jnp.float8_e4m3fn:
    raise ValueError("x[0] must be packed e2m1 (int8)")
  if k % 32:
    raise ValueError(f"x[0] must have a logical width K % 32 == 0, got K={k}")
  validate.check_fmt(fmt, ("e4m3",))
  validate.check_sf_flags(use_tma_aligned_col_major_sf, True, use_packed_ue8m0)
  if out_block_size is None or len(out_block_size) != 2:
    raise ValueError(f"out_block_size must be a pair of ints, got {out_block_size}")
  x_block_size, out_block_size = tuple(x_block_size), tuple(out_block_size)
  (ibm, ibk), (obm, obk) = x_block_size, out_block_size
  if ibk & (ibk - 1) or obk & (obk - 1) or obm % ibm or obk % ibk:
    raise ValueError(f"out_block_size {out_block_size} must be a multiple of x_block_size {x_block_size} "
                     "with power-of-two widths")
  x = validate.guard("per_block_cast_lossless", x)
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0,
               x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)

  def kernel(interpret):
    return _lossless(x, x_block_size, out_block_size, interpret=_config.mosaic_interpret(interpret), **flags)

  return _dispatch.run("per_block_cast_lossless", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast_lossless(x, fmt, x_block_size, out_block_size, **flags),
                       empty=x.data.shape[0] == 0)


@functools.partial(jax.jit, static_argnames=("x_block_size", "out_block_size", "use_tma_aligned_col_major_sf",
                                             "use_packed_ue8m0", "x_use_tma_aligned_col_major_sf", "interpret"))
def _lossless(x, x_block_size, out_block_size, *, use_tma_aligned_col_major_sf, use_packed_ue8m0,
              x_use_tma_aligned_col_major_sf, interpret):
  """Exponent bookkeeping per block in XLA (:func:`jaxkern.reference.quant.lossless_scales`), then the
  e2m1 row kernel of :mod:`jaxkern.quant._cast_back` multiplies each decoded value by its block's
  power of two and writes e4m3 pairs."""
  q4, sf_in = x
  m, k = q4.shape[0], 2 * q4.shape[1]
  scale, e_out = ref.lossless_scales(sf_in, m, k, x_block_size, out_block_size, x_use_tma_aligned_col_major_sf)
  out = _cast_back_kernel(q4, scale, block_size=(1, x_block_size[1]), out_dtype=jnp.float8_e4m3fn,
                            col_major=False, interpret=interpret)
  out_sf = lax.bitcast_convert_type(e_out << 23, jnp.float32)
  return QuantTensor(out, ref.format_sf(out_sf, use_tma_aligned_col_major_sf, use_packed_ue8m0))

"""Per-block casts (``bm × bk`` blocks, ``bm, bk ∈ {32, 128}``) and the lossless FP4 -> FP8 re-quantisation.

Mosaic GPU kernel for e4m3 and bf16 -> e2m1 (``per_block_cast*``; e4m3 from bf16 32x32 / 128x128 blocks with
computed sf runs the direct kernel below): each CTA owns one block row and ``nb`` block columns (``bm · nb·bk``
elements, ``nb·bk`` = 256 columns for ``bm = 32``, 128 for ``bm = 128``). Each block comes in by its own TMA box
into an untiled SMEM buffer (the box clips at the array edges and zero-fills, so partial blocks and any row count
need no padding), is loaded into registers in :func:`jaxkern._layouts.row_layout` (conflict-free: the buffer is
contiguous), and reduced over both axes to the block's amax; the quantisation re-reads the buffer, writes e4m3 to
an SMEM buffer and TMA stores it (clipped at the edges). The sf is stored per block from the kernel, float32
``(Mb, kt·nb)``; the wrapper cuts the padding columns and formats the layout. Divisions and non-finite inputs
(NaN-propagating maxima, saturating e4m3, canonical NaN) as in :mod:`jaxkern.quant._per_token_cast`.

e2m1 from bf16 reads each pair of columns as one int32 word (a free bitcast of the input; the data
TMA boxes are half as wide) and packs the two nibbles per output byte as in
:mod:`jaxkern.quant._per_token_cast`, with the short encoder :func:`jaxkern.quant._encode.encode_e2m1`.
float32 -> e2m1 has its own kernel (:func:`_fp4_from_f32_kernel`) that reads the even and odd
columns straight from GMEM (strided SMEM loads do not lower) and stores through SMEM and TMA.

e4m3 from bf16 with 32x32 or 128x128 blocks, computed sf (:func:`_direct_kernel`, chosen by :func:`_variant`):
each CTA owns one block row and 128 columns (four 32x32 blocks, one packed sf word) or one 128x128 block,
loaded straight from GMEM into registers (16-byte vectors, in row chunks; TMA only for a partial last block
row), reduced in bf16 (exact) and stored straight from registers; the kernel writes the sf in the requested
layout itself (A, B, C; where a packed word spans CTAs, 128x128 blocks with ``K > 128``, each CTA stores its
byte of the word), so no XLA kernel follows it. 128x128 blocks are launched block row last to first (the
partial last block row, on the TMA path, first) and take the e4m3 maximum as a constant. H200 (2026-11-29, layout
C, bf16, CUPTI, cold L2): 32x32 ``4001x576`` 4.22-4.32 µs (TileKernels 4.20), ``8001x576`` 6.11-6.25 (6.40),
``K >= 2048`` level with the earlier 256-column tiles (``8001x2048`` 15.54, TileKernels 16.11); 128x128, block
rows still in order, ``4001x576`` 4.56-4.61 (4.53), ``8001x2048`` 16.02 (16.54). The choices and their figures:
:data:`DIRECT_COLS`, :data:`CHUNKED_MAX_K`, :func:`_warp_owned_blocks_layout`, the comment above
:func:`_direct_kernel` (the reversed order, 2026-11-30).

``per_block_cast_lossless`` computes the exponents per block in XLA (small: one value per input
block) and moves the data through the packed-e2m1 row kernel of :mod:`jaxkern.quant._cast_back`
with an e4m3 output (decode, multiply by the block's power of two, saturating e4m3 pairs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.mosaic.gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern._layouts import NO_AUTO_BARRIERS, group_vectors_layout, row_layout
from jaxkern.quant import _validate as validate
from jaxkern.quant._encode import encode_e2m1
from jaxkern.quant._cast_back import _kernel as _cast_back_kernel
from jaxkern.quant._nan import abs_key, gpu_nan, key_value
from jaxkern.quant._per_token_cast import to_e4m3
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor

BLOCK_SIDES = (32, 128)


def _blocks_per_cta(block_size) -> int:
  bm, bk = block_size
  return (256 if bm == 32 else 128) // bk


DIRECT_BLOCKS = ((32, 32), (128, 128))  # block sizes "auto" runs on the direct kernel (e4m3, computed sf)
# Columns per CTA of the direct kernel by block rows: 32 -> four 32x32 blocks (one packed sf word), 128 -> one
# 128x128 block. 32x32 tiles of 4 blocks are loaded as four 8-row chunks (the block maxima in-thread across the
# chunks and the vector, then one shuffle per block), layout C's UE8M0 bytes are stored by the warp that owns the
# block (:func:`_store_sf_bytes_per_warp`, no cross-warp sum) and the sf divided by the PTX div.rn.f32. H200,
# 2026-11-29 (runner, CUPTI, cold L2, bf16, layout C, bit-exact on the GPU), µs, eight whole 32x32 blocks a CTA ->
# this form (TileKernels): M=4001 K=576 4.59-4.66 -> 4.22-4.32 (4.20), M=8001 K=576 6.58-6.67 -> 6.11-6.25 (6.40),
# K = 2048 .. 7168 level within the ±2% spread (M=4001 K=2048 9.30 -> 8.80-9.25, M=8001 K=7168 43.49 -> 43.28);
# the same form with 256 columns 4.40 / 6.56 at K=576. Earlier, with whole tiles (M=4001 K=576 / 2048, M=8001
# K=576 / 2048): 4.35 / 9.47 / 6.75 / 15.54 µs with 256 columns, 4.50 / 10.18 / 7.33 / 16.34 with 128. 128x128 one
# block per CTA: within 0.2 µs of the previous kernels (one TMA box per block) on all six shapes, K = 576 .. 7168.
DIRECT_COLS = {32: 128, 128: 128}

# 128x128 blocks with K <= CHUNKED_MAX_K are loaded as row chunks of one 16-byte vector a thread (8 rows of a
# 128-column block): the amax in-thread across the chunks first, the sf computed on one value a thread (one division, the PTX
# div.rn.f32; 16 with whole rows, one per row a thread holds), layout C's byte stored from the thread's own copy (no
# cross-warp reduction), each chunk quantised and stored on its own. Wider K keep whole rows in
# :func:`jaxkern._layouts.row_layout` and :func:`jaxkern._ieee.exact_div`. H200, 2026-11-29 (runner, CUPTI, cold L2,
# bf16, layout C, bit-exact on the GPU), µs, whole rows -> chunks (TileKernels): M=4001 K=576 4.83-4.90 -> 4.56-4.61
# (4.53), M=8001 K=576 6.72-6.74 -> 6.72-6.77 (7.13), M=4001 K=2048 9.66-9.73 -> 9.89-10.13 (a loss), K >= 2560
# level within the spread.
CHUNKED_MAX_K = 1024


# The 32x32 tiles of 4 blocks the direct kernel reads straight from GMEM are held in
# :func:`_warp_owned_blocks_layout`: each warp owns whole blocks, so a block's amax is in-thread work plus warp
# shuffles, with no SMEM exchange and no warpgroup barriers; :func:`jaxkern._layouts.group_vectors_layout` (a warp
# over one row of all 8 blocks, a block's amax across the 4 warps through SMEM between two warpgroup barriers)
# before. H200, 2026-11-29 (runner, CUPTI, cold L2, 20 iterations, bf16, bit-exact on the GPU), µs, group-vectors
# -> warp-owned (TileKernels), with 8 blocks a CTA then: M=4001 K=576 4.42 -> 4.48 (4.2), K=2048 9.74 -> 9.10
# (9.1), K=2560 11.07 -> 10.66 (10.4), K=3072 12.86 -> 12.51 (12.2), K=4096 15.60 -> 14.96 (15.3); M=8001 K=576
# 7.02 -> 6.69 (6.4).
def _warp_owned_blocks_layout(nblk: int, bw: int, itemsize: int):
  """Register layout of a ``(rows, nblk, bw/vec, vec)`` view (``vec`` = 16 bytes; ``nblk`` a multiple of 4 blocks
  of 64 bytes a row, ``rows`` a multiple of 8) in which each warp owns whole blocks (warp ``w`` blocks ``w, w+4,
  ...``), its lanes 8 rows x ``bw/vec`` vectors of a block, so the block maxima need no cross-warp step; a warp
  access covers 8 rows of 64 contiguous bytes."""
  vec = 16 // itemsize
  parts = bw // vec
  lanes_r = 32 // parts
  tiling = mgpu_fa.Tiling(((lanes_r, 4, parts, vec), (lanes_r, 1, parts, vec), (vec,)))
  lay = mgpu_fa.TiledLayout(tiling, (-8,), (-5, -3), -1, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(lay.tiling, lay.warp_dims, lay.lane_dims, lay.vector_dim)


def _variant(x_dtype, fmt, block_size, precomputed) -> str:
  """The kernel for these arguments: ``"direct"`` (:func:`_direct_kernel`) for e4m3 with computed sf,
  :data:`DIRECT_BLOCKS` blocks and a bf16 input (its block maxima are taken in bf16; float32 would need twice the
  registers, not timed), else ``"blocks"`` (:func:`_kernel`, or for float32 -> e2m1 :func:`_fp4_from_f32_kernel`)."""
  if fmt == "e4m3" and not precomputed and jnp.dtype(x_dtype) == jnp.bfloat16 and block_size in DIRECT_BLOCKS:
    return "direct"
  return "blocks"


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


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "round_sf", "write_data", "compute_sf", "interpret"))
def _kernel(x, sf_in, *, fmt, block_size, round_sf, write_data, compute_sf, interpret):
  """``x`` ``(M, K)``; ``sf_in`` precomputed layout-A sf ``(Mb, Kb)`` or None.

  Returns ``(out (M, K) e4m3 or (M, K/2) int8 | None, sf (Mb, Kb) float32 | None)``.
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
  rc = 32 if fp4 else bm
  chunks = [pl.ds(r0, rc) for r0 in range(0, bm, rc)]
  out_type = []
  if write_data:
    out_type.append(jax.ShapeDtypeStruct((m, k // 2), jnp.int8) if fp4 else
                    jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn))
  if compute_sf:
    out_type.append(jax.ShapeDtypeStruct((mb, kt * nb), jnp.float32))

  scratch = dict(x_s=plgpu.SMEM((nb, bm, obk), x.dtype, transforms=_untiled(obk, x.shape[1])),
                 bar=plgpu.Barrier(num_arrivals=1, num_barriers=nb))
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

  # A numpy constant: XLA keeps it as a constant buffer (a jnp.full is a broadcast, one more kernel launch).
  consts = np.full((1,), ref.MAX_VALUE[fmt], np.float32)
  if sf_in is not None:
    sf_in = jnp.pad(sf_in, ((0, 0), (0, kt * nb - kb)), constant_values=1.0)
  outs = list(kernel(*((x, consts) if sf_in is None else (x, consts, sf_in))))
  out = outs.pop(0) if write_data else None
  return out, (outs.pop(0)[:, :kb] if compute_sf else None)


def _abs_key16(h, interpret):
  """``|h|`` of bf16 values in the form whose maximum the direct kernel takes (exact in bf16): ``|h|`` on the GPU
  (``max.NaN.bf16x2``), the sign-cleared int16 pattern in interpret mode (NaN above +inf; see :func:`abs_key`)."""
  return jnp.abs(h) if interpret is None else lax.bitcast_convert_type(h, jnp.int16) & jnp.int16(0x7FFF)


def _key16_float(k, interpret):
  """The float32 value of a maximum of :func:`_abs_key16` keys."""
  return (k if interpret is None else lax.bitcast_convert_type(k, jnp.bfloat16)).astype(jnp.float32)


def _direct_tiles(k, block_size):
  """Column tiles of the direct kernel: ``(g, kt, full, last)``: blocks per CTA (:data:`DIRECT_COLS`, fewer where
  ``K`` has fewer), CTA columns, and the ``(blocks, block width)`` of the full tiles and of the last one. A block
  is partial only where 128-wide blocks (one per CTA) do not divide ``K``: the last tile is then that block
  (32-wide blocks always divide ``K``, a multiple of 64). A CTA holds one whole packed UE8M0 word of layout C
  (4 blocks), the 2 blocks of the last word where ``K % 128 == 64``, or one 128x128 block, whose byte it stores
  (:func:`_store_sf_byte`)."""
  bm, bk = block_size
  kb = ref.cdiv(k, bk)
  g = min(DIRECT_COLS[bm] // bk, kb)
  kt = ref.cdiv(kb, g)
  last_w = k - (kt - 1) * g * bk
  return g, kt, (g, bk), ((last_w // bk, bk) if last_w % bk == 0 else (1, last_w))


def _sf_scalars(sf, red, sf_layout, nvalid, interpret):
  """The scalars the direct kernel stores for the sf vector ``sf`` (float32 ``(n,)`` of ``n > 1`` blocks, layout
  ``red``) of which the first ``nvalid`` are real blocks: one per block (layouts A, B), or for layout C one
  packed UE8M0 word per 4 blocks (byte ``t % 4`` of word ``t // 4``, zero for missing blocks; the sum of the bytes
  shifted into disjoint fields).

  A block's sf is the maximum of the vector with the other blocks at -inf: exact for every sf, including the -0 of
  a NaN block with ``round_sf`` (a one-hot sum adds +0 to it, giving +0) and NaN (``max.NaN`` on the GPU). In
  interpret mode, where XLA's float maxima can drop a NaN, the same on the int32 patterns with the others at the
  smallest int32 (the pattern of -0)."""
  iota = plgpu.broadcasted_iota(jnp.int32, sf.shape, 0, layout=red)
  if sf_layout == "C":
    byte = ((lax.bitcast_convert_type(sf, jnp.int32) >> 23) & 0xFF) << (8 * (iota % 4))
    return [jnp.sum(jnp.where(((iota >> 2) == q) & (iota < nvalid), byte, 0)) for q in range(ref.cdiv(nvalid, 4))]
  if interpret is None:
    return [jnp.max(jnp.where(iota == t, sf, -jnp.inf)) for t in range(nvalid)]
  bits, low = lax.bitcast_convert_type(sf, jnp.int32), np.iinfo(np.int32).min
  return [lax.bitcast_convert_type(jnp.max(jnp.where(iota == t, bits, low)), jnp.float32) for t in range(nvalid)]


def _store_sf(sf_g, vals, *, sf_layout, i, blk0, mb):
  """Stores the scalars ``vals`` of block row ``i`` (from :func:`_sf_scalars`: blocks ``blk0 + t`` for layouts
  A ``(Mb, Kb)`` and B ``(Kb, Mp)``, packed words ``blk0 / 4 + t`` for C ``(ceil(Kb/4), Mp)``); the last block
  row also zeroes the padding rows ``Mb .. Mp`` of B and C."""
  if sf_layout == "A":
    for t, v in enumerate(vals):
      sf_g[i, blk0 + t] = v
    return
  col0 = blk0 // 4 if sf_layout == "C" else blk0
  for t, v in enumerate(vals):
    sf_g[col0 + t, i] = v
  if sf_g.shape[1] > mb:
    @pl.when(i == mb - 1)
    def _():
      for t in range(len(vals)):
        for r in range(mb, sf_g.shape[1]):
          sf_g[col0 + t, r] = jnp.zeros((), sf_g.dtype)


_SPLAT = plgpu.Layout.WG_SPLAT(shape=())  # a scalar operand of inline Mosaic GPU code


def _put_sf_byte(sf_g, w, r, t, byte, interpret, layout=None):
  """Byte ``t`` (0 = least significant) of the int32 word ``sf_g[w, r]`` := the low byte of ``byte`` (an int32
  scalar; on the GPU also a vector in the register layout ``layout`` holding it in every element). On the GPU one
  8-bit store by one thread (of the thread's first register), leaving the word's other bytes (other CTAs') alone;
  in interpret mode, whose grid runs one CTA after another, a read-modify-write of the word."""
  if interpret is not None:
    shift = 8 * t
    sf_g[w, r] = (sf_g[w, r] & ~(jnp.int32(0xFF) << shift)) | ((byte & 0xFF) << shift)
    return

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SPLAT, _SPLAT if layout is None else layout))
  def store(_, ref_, offset, value):
    i8 = ir.IntegerType.get_signless(8)
    addr = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(ref_), [offset.registers.item()], i8)
    v = value.registers.flat[0]
    if isinstance(v.type, ir.VectorType):
      v = vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
    with mgpu.utils.single_thread(mgpu.utils.ThreadSubset.WARPGROUP):
      llvm.store(arith.trunci(i8, v), addr)

  store(sf_g, (w * sf_g.shape[1] + r) * 4 + t, byte)


def _store_sf_bytes_per_warp(sf_g, sf, red, *, i, word0, mb):
  """Layout C from a tile of ``n`` (a multiple of 4) 32x32 blocks in :func:`_warp_owned_blocks_layout` (GPU
  only): the UE8M0 byte of block ``t`` of the float32 sf ``(n,)`` (in ``red``, each warp holding its own blocks)
  becomes byte ``t % 4`` of word ``(word0 + t // 4, i)`` of ``sf_g``, stored by one lane of the warp that holds it
  (8-bit stores, no cross-warp exchange). The last block row also zeroes the padding rows ``Mb .. Mp`` of its
  words."""
  byte = (lax.bitcast_convert_type(sf, jnp.int32) >> 23) & 0xFF
  mp = sf_g.shape[1]

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), red, _SPLAT, _SPLAT))
  def store(_, ref_, b, row, w0):
    i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
    ptr = mgpu.utils.memref_ptr(ref_)
    r, w0v = row.registers.item(), w0.registers.item()
    c = lambda n: arith.constant(i32, n)

    def one(val, idx):
      t = arith.index_cast(i32, idx[0])
      word = arith.addi(w0v, arith.shrui(t, c(2)))
      off = arith.addi(arith.muli(arith.addi(arith.muli(word, c(mp)), r), c(4)), arith.andi(t, c(3)))
      llvm.store(arith.trunci(i8, val), mgpu.utils.getelementptr(ptr, [off], i8))

    with mgpu.utils.single_thread(mgpu.utils.ThreadSubset.WARP):
      b.foreach(one)

  store(sf_g, byte, i, word0)
  if mp > mb:
    @pl.when(i == mb - 1)
    def _():
      for t in range(sf.shape[0] // 4):
        for r in range(mb, mp):
          sf_g[word0 + t, r] = jnp.zeros((), sf_g.dtype)


# Layout C from 128x128 blocks with K > 128 (a packed word spans 4 CTAs): each CTA stores its own UE8M0 byte of
# the word, no XLA packing after the kernel. H200, 2026-11-29 (CUPTI, cold L2, bf16, bit-exact): M=4001 K=576 /
# 2048 4.90 / 9.73 µs, M=8001 6.66 / 16.02 against 5.65 / 10.72 / 7.81 / 16.69 with layout A written by the kernel
# and packed by XLA (TileKernels 4.53 / 9.69 / 7.23 / 16.54).
def _store_sf_byte(sf_g, byte, *, i, j, mb, kb, interpret, layout=None):
  """Layout C from CTAs of one block each: block ``(i, j)``'s UE8M0 ``byte`` (int32 scalar, or a vector in the
  register layout ``layout`` holding it in every element: :func:`_put_sf_byte`) becomes byte ``j % 4``
  of word ``(j // 4, i)`` of the int32 ``(ceil(Kb/4), Mp)`` buffer ``sf_g``. The CTA of the last block column also
  zeroes the padding bytes ``Kb % 4 .. 3`` of its word, and the CTAs of the last block row do both for the padding
  rows ``Mb .. Mp``: every byte of the buffer is written by exactly one CTA."""
  mp = sf_g.shape[1]
  pad = tuple(range(kb % 4, 4)) if kb % 4 else ()
  zero = jnp.int32(0)

  def row(r, b, lay=None):
    _put_sf_byte(sf_g, j // 4, r, j % 4, b, interpret, lay)
    if pad:
      @pl.when(j == kb - 1)
      def _():
        for t in pad:
          _put_sf_byte(sf_g, kb // 4, r, t, zero, interpret)

  row(i, byte, layout)
  if mp > mb:
    @pl.when(i == mb - 1)
    def _():
      for r in range(mb, mp):
        row(r, zero)


# 128x128 blocks: the direct kernel launches the block rows in reverse (grid row ``r`` is block row ``mb - 1 - r``),
# so the CTAs of the partial last block row, which take the slower TMA path, start first instead of forming the
# kernel's tail, and it takes the e4m3 maximum 448 as an in-kernel constant instead of reading it from GMEM. H200,
# 2026-11-30 (runner, CUPTI, cold L2, bf16, layout C), µs, block rows in order with the maximum from GMEM -> reversed
# with the constant: M=4001 K=2048 9.65-9.94 -> 8.80-8.85, K=2560 11.26-11.31 -> 10.53-10.56, K=4096 15.86-16.03 ->
# 14.82-14.88, K=6144 21.25 -> 20.29; M=8001 K=4096 26.98-28.58 -> 25.66-25.84, K=6144 38.30 -> 36.94; the other
# shapes 1-7% faster except M=4001 K=576 (level). 32x32 blocks: the reversed order, the constant and both were
# within the spread of the kernel in row order with the maximum from GMEM, which they keep.
@functools.partial(jax.jit, static_argnames=("block_size", "round_sf", "write_data", "sf_layout", "interpret"))
def _direct_kernel(x, *, block_size, round_sf, write_data, sf_layout, interpret):
  """e4m3 with computed sf from bf16 ``x`` ``(M, K)`` (``M >= 1``): ``(out (M, K) e4m3 | None, sf)`` with the sf in
  ``sf_layout`` ("A", "B" or "C"; B / C padded to ``align(Mb, 4)`` rows with zeros).

  A CTA owns one block row and ``g`` blocks (:func:`_direct_tiles`: :data:`DIRECT_COLS` columns, fewer in the last
  CTA column). A CTA whose block row lies wholly inside the array loads its tile straight from GMEM into
  registers (16-byte vectors) in row chunks (``chunk_rows``): four 32x32 blocks viewed as ``(8, 4, 4, 8)`` chunks
  in :func:`_warp_owned_blocks_layout` (each warp owning whole blocks), two (the last CTA column where
  ``K % 128 == 64``) whole as ``view_of`` says, one 128x128 block as rows in :func:`jaxkern._layouts.row_layout`,
  in chunks of one vector a thread for ``K <=`` :data:`CHUNKED_MAX_K`, else whole. It reduces the block maxima in
  bf16 (exact) and in-thread across the chunks first, computes the sf (``sf_div``), and stores each e4m3 chunk
  straight from registers; the sf go to GMEM as scalars (or one vector for layout A), packed UE8M0 words
  assembled in registers, bytes stored by the warp owning the block (:func:`_store_sf_bytes_per_warp`: tiles of
  four 32x32 blocks, compiled), or byte by byte where a word spans CTAs (:func:`_store_sf_byte`). The CTAs of a
  partial last block row instead bring their tile in by one TMA box (clipped at the array edges, zero-filled) and
  store it through SMEM by a clipped TMA store. 128x128 blocks run their block rows in reverse launch order (grid
  row ``r`` is block row ``mb - 1 - r``: the partial last block row first) and take the e4m3 maximum as an
  in-kernel constant; 32x32 tiles take the block rows in order and read the maximum from the one-element GMEM
  input (which 128x128 kernels are passed but do not read). Interpret mode runs the same chunks, with
  :func:`jaxkern._ieee.exact_div` and layout C's words assembled in registers (:func:`_sf_scalars`): the same bits.
  No automatic warpgroup barriers: no thread reads SMEM another wrote without a ``commit_smem()`` in between.
  """
  m, k = x.shape
  bm, bk = block_size
  mb, kb = ref.cdiv(m, bm), ref.cdiv(k, bk)
  g, kt, full, last = _direct_tiles(k, block_size)
  w = g * bk
  wb = w if kt > 1 else last[0] * last[1]  # width of the TMA box (never wider than the array)
  tma = m % bm != 0
  chunked128 = bm == 128 and k <= CHUNKED_MAX_K  # 128x128 blocks in chunks of one vector a thread
  # The sf divisions as the PTX div.rn.f32 in the compiled 32x32 and chunked 128x128 kernels (the forms measured:
  # DIRECT_COLS, CHUNKED_MAX_K), else exact_div: the same bits (inline PTX has no interpreter).
  ptx_div = interpret is None and (bm == 32 or chunked128)
  out_type = [jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)] if write_data else []
  mp = ref.cdiv(mb, 4) * 4
  out_type.append(jax.ShapeDtypeStruct({"A": (mb, kb), "B": (kb, mp), "C": (ref.cdiv(kb, 4), mp)}[sf_layout],
                                       jnp.int32 if sf_layout == "C" else jnp.float32))
  scratch = {}
  if tma:  # one-block tiles are read as plain rows: a one-row tiling keeps them row-major (see _untiled)
    tr = (lambda width: _untiled(wb, width)) if (full if kt > 1 else last)[0] == 1 else (lambda width: ())
    scratch = dict(x_s=plgpu.SMEM((bm, wb), x.dtype, transforms=tr(k)), bar=plgpu.Barrier(num_arrivals=1))
    if write_data:
      scratch["o_s"] = plgpu.SMEM((bm, wb), jnp.float8_e4m3fn, transforms=tr(k))

  def view_of(nblk, bw, from_gmem):
    """The register view of a tile of ``nblk`` blocks ``bw`` wide and its layout: ``(bm, nblk, bw/vec, vec)``, or
    for one block the plain ``(bm, bw)`` rows (the amax is then a scalar: a one-element vector of the 4-D view
    reduces to a scalar in no lowering). Only 32x32 blocks come several to a tile (:data:`DIRECT_COLS`: 4, or 2
    in the last or only CTA column where ``K % 128 == 64``); a tile of 4 loaded from GMEM (``from_gmem``) is held
    in :func:`_warp_owned_blocks_layout`. Two cases keep :func:`jaxkern._layouts.group_vectors_layout` (a block's
    vectors on consecutive lanes, warps over rows): a tile of 2 blocks (the warp-owned layout's tile is 4 blocks,
    one per warp), and the tile a CTA of a partial last block row loads from SMEM after its TMA box (jax 0.11.2:
    with the warp-owned layout there, Mosaic GPU's layout inference of the kernel does not finish; lowering for an
    H100 on a CPU ran past 2 minutes, against seconds)."""
    if nblk == 1:
      return (bm, bw), row_layout(bw, x.dtype.itemsize)[0]
    vec = min(16 // x.dtype.itemsize, bw)
    view = (bm, nblk, bw // vec, vec)
    if from_gmem and nblk % 4 == 0:
      return view, _warp_owned_blocks_layout(nblk, bw, x.dtype.itemsize)
    return view, group_vectors_layout(nblk, bw, x.dtype.itemsize)[0]

  def chunk_rows(nblk, bw):
    """Rows per register chunk of a tile of ``nblk`` blocks ``bw`` wide loaded from GMEM: 8 for the warp-owned
    layout (one row group of registers each: the block maxima take the chunks and the 8-value vector in-thread,
    then one shuffle per block), the rows of one 16-byte vector a thread for a 128x128 block with
    ``K <=`` :data:`CHUNKED_MAX_K` (one sf division a thread), else all ``bm`` (one chunk)."""
    if nblk % 4 == 0:
      return 8
    if nblk == 1 and chunked128:
      return row_layout(bw, x.dtype.itemsize)[1]
    return bm

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(mb, kt), grid_names=("i", "j"),
                     scratch_types=scratch, compiler_params=NO_AUTO_BARRIERS, interpret=interpret)
  def kernel(x_g, c_g, *rest, x_s=None, bar=None, o_s=None):
    o_g = rest[0] if write_data else None
    sf_g = rest[-1]
    i, j = lax.axis_index("i"), lax.axis_index("j")
    if bm == 128:  # block rows in reverse launch order: the partial last block row (TMA path) first
      i = mb - 1 - i
    rows = pl.ds(i * bm, bm)
    if sf_layout == "C" and g == 1 and kt > 1:  # a packed word spans 4 CTAs: each stores its byte
      store = lambda vals: _store_sf_byte(sf_g, vals[0], i=i, j=j, mb=mb, kb=kb, interpret=interpret)
    else:
      store = functools.partial(_store_sf, sf_g, sf_layout=sf_layout, i=i, blk0=j * g, mb=mb)

    def when(cond, fn):  # fn under a CTA-column condition (None: always)
      fn() if cond is None else pl.when(cond)(fn)

    def sf_div(lay, shape):  # the sf division of float32 ``shape`` arrays in ``lay`` (see ptx_div)
      return _ieee.mosaic_ptx("div.rn.f32", lay, shape) if ptx_div else _ieee.exact_div

    def quantise(vs, lay, nvalid_of):
      """Block maxima, sf (stored) and the e4m3 chunks (or None) of a tile held as the row chunks ``vs`` (each a
      :func:`view_of` view of fewer rows in ``lay``; one chunk: the whole tile); ``nvalid_of``: ``(condition or
      None, real blocks)`` of each CTA column branch (static counts)."""
      chunked = len(vs) > 1
      keys = functools.reduce(jnp.maximum, [_abs_key16(u, interpret) for u in vs])  # in-thread across chunks
      if keys.ndim == 2:  # one block (128x128 only): a scalar amax, the sf as vectors of the rows (splats without
        # ptx_div). A chunk holds one vector of one row a thread: that vector first; whole rows: the rows first
        # (packed maxima in-thread). The e4m3 maximum is a constant here, not the GMEM c_g.
        a = _key16_float(jnp.max(jnp.max(keys, axis=1 if chunked else 0), axis=0), interpret)
        rl, n = lay.reduce(1), keys.shape[0]
        ab, cb = jnp.broadcast_to(a, (n,)), jnp.broadcast_to(jnp.float32(ref.MAX_VALUE["e4m3"]), (n,))
        if ptx_div:  # the inline PTX needs its operands' layout: one value per row a thread holds (1 for a chunk)
          ab, cb = plgpu.layout_cast(ab, rl), plgpu.layout_cast(cb, rl)
        sf, inv = ref.scale_factors(ab, cb, "e4m3", round_sf, div=sf_div(rl, (n,)))
        sf = gpu_nan(sf, interpret)
        byte = (lax.bitcast_convert_type(sf, jnp.int32) >> 23) & 0xFF
        if chunked and interpret is None and sf_layout == "C" and kt > 1:  # every thread holds the byte: stored
          for cond, _ in nvalid_of:                                         # from one thread, no reduction
            when(cond, lambda: _store_sf_byte(sf_g, byte, i=i, j=j, mb=mb, kb=kb, interpret=interpret, layout=rl))
        else:
          vals = [jnp.max(byte if sf_layout == "C" else sf, axis=0)]
          for cond, _ in nvalid_of:
            when(cond, lambda: store(vals))
        scale = inv[:, None]
      else:
        if chunked:  # 8-row chunks of the warp-owned layout: the vector and the rows in-thread first
          a = jnp.max(jnp.max(jnp.max(keys, axis=3), axis=2), axis=0)
          red = lay.reduce(3).reduce(2).reduce(0)
        else:
          a = jnp.max(jnp.max(jnp.max(keys, axis=0), axis=1), axis=1)
          red = lay.reduce(0).reduce(1).reduce(1)
        a = _key16_float(a, interpret)
        nblk = keys.shape[1]
        sf, inv = ref.scale_factors(a, plgpu.layout_cast(jnp.broadcast_to(c_g[0], (nblk,)), red), "e4m3", round_sf,
                                    div=sf_div(red, (nblk,)))
        sf = gpu_nan(sf, interpret)
        for cond, nvalid in nvalid_of:
          if sf_layout == "A" and nvalid == nblk:
            def store_row(nblk=nblk):
              sf_g[i, pl.ds(j * g, nblk)] = sf
            when(cond, store_row)
          elif sf_layout == "C" and chunked and interpret is None:  # warp-owned blocks: each warp its own bytes
            when(cond, lambda: _store_sf_bytes_per_warp(sf_g, sf, red, i=i, word0=j * (g // 4), mb=mb))
          else:
            when(cond, lambda nvalid=nvalid: store(_sf_scalars(sf, red, sf_layout, nvalid, interpret)))
        scale = inv[None, :, None, None]
      if not write_data:
        return None
      return [to_e4m3(gpu_nan(u.astype(jnp.float32) * scale, interpret), interpret) for u in vs]

    def direct(tile):
      view, lay = view_of(*tile, from_gmem=True)
      rc = chunk_rows(*tile)
      cview = (rc,) + view[1:]
      cols_ = pl.ds(j * w, tile[0] * tile[1])
      crows = [pl.ds(i * bm + r0, rc) for r0 in range(0, bm, rc)]
      if interpret is not None:
        vs = [x_g[r, cols_].reshape(cview) for r in crows]
      else:
        vs = [plgpu.load(x_g.at[r, cols_].reshape(*cview), layout=lay, optimized=False) for r in crows]
      qs = quantise(vs, lay, [(None, tile[0])])
      if write_data:  # each chunk on its own
        for r, q in zip(crows, qs):
          if interpret is None and len(view) > 2:
            o_g.at[r, cols_].reshape(*cview)[...] = q
          else:
            o_g[r, cols_] = q.reshape(rc, -1)

    def via_tma():
      tile = full if kt > 1 else last
      view, lay = view_of(*tile, from_gmem=False)
      cols_ = pl.ds(j * w, wb)
      plgpu.copy_gmem_to_smem(x_g.at[rows, cols_], x_s, bar)
      plgpu.barrier_wait(bar)
      if interpret is not None:
        v = x_s[...].reshape(view)
      else:
        v = plgpu.load(x_s.reshape(*view) if len(view) > 2 else x_s, layout=lay)
      nvalid_of = [(None, tile[0])] if kt == 1 or last == full else [(j < kt - 1, g), (j == kt - 1, last[0])]
      q = quantise([v], lay, nvalid_of)
      if write_data:
        if interpret is None and len(view) > 2:
          o_s.reshape(*view)[...] = q[0]
        else:
          o_s[...] = q[0].reshape(bm, wb)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[rows, cols_])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def direct_tiles():
      if kt == 1 or last == full:
        direct(last if kt == 1 else full)
      else:
        pl.when(j < kt - 1)(lambda: direct(full))
        pl.when(j == kt - 1)(lambda: direct(last))

    if tma:
      pl.when((i + 1) * bm <= m)(direct_tiles)
      pl.when((i + 1) * bm > m)(via_tma)
    else:
      direct_tiles()

  outs = list(kernel(x, np.full((1,), ref.MAX_VALUE["e4m3"], np.float32)))  # the maximum: read by 32x32 tiles
  return (outs[0] if write_data else None), outs[-1]

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

  consts = np.full((1,), ref.FP4_MAX, np.float32)  # a constant buffer, no broadcast kernel
  if sf_in is not None:
    sf_in = jnp.pad(sf_in, ((0, 0), (0, kt * nb - kb)), constant_values=1.0)
  outs = list(kernel(*((xv, consts) if sf_in is None else (xv, consts, sf_in))))
  out = outs.pop(0)[:m] if write_data else None
  return out, (outs.pop(0)[:, :kb] if compute_sf else None)


def _run_kernel(x, fmt, block_size, interpret, *, sf_in=None, round_sf=False, write_data=True, compute_sf=True,
                sf_layout="A"):
  """``(out | None, sf | None)`` of the kernel :func:`_variant` picks, the sf in ``sf_layout`` ("A", "B", "C"):
  written so by the direct kernel, formatted by XLA after the others (which write layout A)."""
  mode = _config.mosaic_interpret(interpret)
  if _variant(x.dtype, fmt, block_size, sf_in is not None) == "direct":
    return _direct_kernel(x, block_size=block_size, round_sf=round_sf, write_data=write_data, sf_layout=sf_layout,
                          interpret=mode)
  f = _fp4_from_f32_kernel if fmt == "e2m1" and x.dtype == jnp.float32 else functools.partial(_kernel, fmt=fmt)
  out, sf = f(x, sf_in, block_size=block_size, round_sf=round_sf, write_data=write_data, compute_sf=compute_sf,
              interpret=mode)
  return out, (None if sf is None else _format_sf(sf, sf_layout))


def _sf_layout(use_tma_aligned_col_major_sf, use_packed_ue8m0) -> str:
  """The sf layout of the flags: A (row-major float32), B (column-major float32) or C (packed UE8M0)."""
  return "C" if use_packed_ue8m0 else "B" if use_tma_aligned_col_major_sf else "A"


def _format_sf(sf, sf_layout):
  """Layout-A float32 sf -> ``sf_layout`` (XLA)."""
  return ref.format_sf(sf, sf_layout != "A", sf_layout == "C")


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


def per_block_cast(x: jax.typing.ArrayLike, fmt: str, block_size: tuple[int, int], *,
                   use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False, use_packed_ue8m0: bool = False,
                   implementation: str | None = None) -> QuantTensor:
  """Blockwise cast to FP8 e4m3 or packed FP4 e2m1, one scale per ``bm × bk`` block (docs/quant.md, "Casts").

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
    float32, B ``(Kb, align(Mb, 4))`` float32 or C ``(ceil(Kb/4), align(Mb, 4))`` int32. The e4m3 kernel of
    bf16 32x32 / 128x128 blocks writes every layout itself; the others write float32 ``(Mb, Kb)`` and XLA
    formats layouts B / C.

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
    return QuantTensor(*_run_kernel(x, fmt, block_size, interpret, round_sf=round_sf,
                                    sf_layout=_sf_layout(use_tma_aligned_col_major_sf, use_packed_ue8m0)))

  return _dispatch.run("per_block_cast", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast(x, fmt, block_size, **flags), empty=x.shape[0] == 0)


def per_block_cast_with_sf_only(x: jax.typing.ArrayLike, fmt: str, block_size: tuple[int, int], *,
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False, implementation: str | None = None) -> jax.Array:
  """The ``sf`` of :func:`per_block_cast`, bit-identical, without writing the data (docs/quant.md, "Casts").
  Arguments, layouts, errors, XLA cases and non-finite inputs as :func:`per_block_cast`.

  Differentiation: not differentiable, as :func:`per_block_cast` (raises :class:`jaxkern.NotDifferentiableError`).
  """
  x, block_size = _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  x = validate.guard("per_block_cast_with_sf_only", x)
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
               use_packed_ue8m0=use_packed_ue8m0)

  def kernel(interpret):
    return _run_kernel(x, fmt, block_size, interpret, round_sf=round_sf, write_data=False,
                       sf_layout=_sf_layout(use_tma_aligned_col_major_sf, use_packed_ue8m0))[1]

  return _dispatch.run("per_block_cast_with_sf_only", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast_with_sf_only(x, fmt, block_size, **flags), empty=x.shape[0] == 0)


def per_block_cast_with_precomputed_sf(x: jax.typing.ArrayLike, fmt: str, block_size: tuple[int, int], sf: jax.Array, *,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False, implementation: str | None = None) -> jax.Array:
  """Quantises ``x`` with a caller-given sf per block (docs/quant.md, "Casts").

  ``sf``: float32 layout A ``(ceil(M/bm), ceil(K/bk))``; ``sf_inv = RN(1 / sf)``, ``data = encode(x ·
  sf_inv)`` with the e4m3 clamp to ±448. ``round_sf`` has no effect. Returns ``data`` only: ``(M, K)``
  float8_e4m3fn or ``(M, K/2)`` int8 packed e2m1. Raises ValueError as :func:`per_block_cast`, and for an
  ``sf`` of another shape or dtype or ``use_tma_aligned_col_major_sf`` / ``use_packed_ue8m0`` set. XLA
  instead of the kernel for zero rows only. Non-finite ``x`` encode as in :func:`per_block_cast`.
  Preconditions: every ``sf`` finite and non-zero; a concrete ``sf`` with a zero, inf or NaN raises ``ValueError``,
  a traced one gives unspecified data and ``checkify.checkify(f, errors=checkify.user_checks)`` reports the first
  such scale (docs/usage.md, "Bad values under jit").

  Differentiation: not differentiable in ``x`` or ``sf``, as :func:`per_block_cast` (raises
  :class:`jaxkern.NotDifferentiableError`).
  """
  x, block_size = _check(x, fmt, block_size, False, False, False)
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    raise ValueError("use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False with a precomputed sf")
  m, k = x.shape
  sf = _checks.as_array("sf", sf)
  validate.check_sf("sf", sf, (ref.cdiv(m, block_size[0]), ref.cdiv(k, block_size[1])), jnp.float32)
  _checks.check_and_debug_check("per_block_cast_with_precomputed_sf", "sf", sf, _checks.zero_or_not_finite,
                                "a finite non-zero scale (1 / sf would be inf or 0: the data would look valid)")
  x, sf = validate.guard("per_block_cast_with_precomputed_sf", x, sf)

  def kernel(interpret):
    return _run_kernel(x, fmt, block_size, interpret, sf_in=sf, compute_sf=False)[0]

  return _dispatch.run("per_block_cast_with_precomputed_sf", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast_with_precomputed_sf(x, fmt, block_size, sf), empty=m == 0)


def per_block_cast_lossless(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, x_block_size: tuple[int, int],
                            out_block_size: tuple[int, int], *, use_tma_aligned_col_major_sf: bool = False,
                            round_sf: bool = False, use_packed_ue8m0: bool = False,
                            x_use_tma_aligned_col_major_sf: bool = False,
                            implementation: str | None = None) -> QuantTensor:
  """Exact re-quantisation of a packed-e2m1 QuantTensor with power-of-two sf into e4m3 with larger blocks
  (docs/quant.md, "Casts"): every dequantised value is kept.

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
      input sf of the wrong shape or dtype, packed without column-major, a concrete float32 input sf that is not
      a power of two, a concrete input sf whose spread within an output block is too wide (below).

  Preconditions: a float32 input sf holds positive powers of two (only their exponents are read); within one
  output block the input sf span at most 2^11: with ``Emax`` the largest exponent byte of the block's input sf
  and ``Eout = max(Emax - 6, 0)`` the output's, every input exponent byte ``E >= Eout - 5`` (every input sf at
  least 2^-11 times the largest; any spread where the largest is below 2^-121). A concrete sf that breaks either
  raises ``ValueError``; a traced one gives the same formula's result in kernel and reference (only the exponents
  are read; beyond the spread the values round or flush in the e4m3 conversion, so the result is not exact) and
  is reported under ``checkify.checkify(f, errors=checkify.user_checks)`` (docs/usage.md, "Bad values under
  jit"). The block exponents are computed by XLA (one value per input block), the data by the e2m1 cast-back row kernel with a saturating e4m3 output.
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
  if x.sf.dtype == jnp.float32:  # the logical scales: layout B's padding columns past M/128 hold anything
    mb = validate.cdiv(x.data.shape[0], ibm)
    logical = x.sf[:, :mb] if x_use_tma_aligned_col_major_sf else x.sf
    _checks.check_and_debug_check("per_block_cast_lossless", "x.sf", logical, _checks.not_power_of_two,
                                  "a positive power of two (only its exponent is read)")
  _check_lossless_spread(x.sf, validate.cdiv(x.data.shape[0], ibm), validate.cdiv(k, ibk),
                         (obm // ibm, obk // ibk), x_use_tma_aligned_col_major_sf)
  x = validate.guard("per_block_cast_lossless", x)
  flags = dict(use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0,
               x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)

  def kernel(interpret):
    return _lossless(x, x_block_size, out_block_size, interpret=_config.mosaic_interpret(interpret), **flags)

  return _dispatch.run("per_block_cast_lossless", implementation, kernel=kernel,
                       xla=lambda: ref.per_block_cast_lossless(x, fmt, x_block_size, out_block_size, **flags),
                       empty=x.data.shape[0] == 0)


def _exponent_bytes(sf):
  """The biased exponent field of float32 scales, for numpy and jax arrays alike."""
  if isinstance(sf, np.ndarray):
    return (sf.astype(np.float32).view(np.int32) >> 23) & 0xFF
  return (lax.bitcast_convert_type(sf.astype(jnp.float32), jnp.int32) >> 23) & 0xFF


def _lossless_spread_too_wide(sf, blocks_per_out: tuple[int, int]):
  """Per input block of a logical ``(Mb, Kb)`` float32 sf (numpy or jax): whether its exponent byte ``E`` is below
  ``Eout - 5``, ``Eout = max(Emax - 6, 0)`` with ``Emax`` the largest byte of its output block of
  ``blocks_per_out`` input blocks (docs/quant.md, "Casts"): ``2^(E - Eout)`` would scale an e2m1 value below
  e4m3's exact range."""
  xp = np if isinstance(sf, np.ndarray) else jnp
  e = _exponent_bytes(sf)
  (mb, kb), (r, c) = e.shape, blocks_per_out
  padded = xp.pad(e, ((0, -mb % r), (0, -kb % c)))
  emax = padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c).max(axis=(1, 3))
  e_out = xp.repeat(xp.repeat(xp.maximum(emax - 6, 0), r, axis=0), c, axis=1)[:mb, :kb]
  return e + 5 < e_out


def _check_lossless_spread(sf, mb: int, kb: int, blocks_per_out: tuple[int, int], col_major: bool) -> None:
  """The input sf of one output block span at most 2^11 (``E + 5 >= Eout`` for every input block): a float32 sf
  is checked where it lies (layout A, or B's logical columns), a packed UE8M0 one decoded to layout A."""
  if sf.dtype == jnp.int32:
    name, logical = "x.sf decoded to layout A", ref.sf_to_float(sf, mb, kb)
    bad = lambda v: _lossless_spread_too_wide(v, blocks_per_out)
  elif col_major:
    name, logical = "x.sf", sf[:, :mb]
    bad = lambda v: _lossless_spread_too_wide(v.T, blocks_per_out).T
  else:
    name, logical, bad = "x.sf", sf, lambda v: _lossless_spread_too_wide(v, blocks_per_out)
  _checks.check_and_debug_check("per_block_cast_lossless", name, logical, bad,
                                "a scale at least 2^-11 times the largest of its output block, or any scale when "
                                "that largest is below 2^-121 (the bound of an exact result)")


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

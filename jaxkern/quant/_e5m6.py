"""E5M6 casts: ``per_token_cast_to_e5m6`` and ``cast_back_e5m6`` (docs/quant.md, "Number formats", "Casts",
"Cast-backs").

E5M6 is a 12-bit format, the top 12 bits of an fp16 pattern (the format's recipe: fp16 round toward zero, then the
17-bit drop rule; 8 codes packed big-endian into three uint32 words). On the GPU the kernels use the hardware fp16
conversions through inline PTX at the lane level (``plgpu.inline_mgpu``): the encoder's round-toward-zero
conversion is the recipe's first step, two values per ``cvt.rz.f16x2.f32`` (:func:`_lane_pair_bits`); it saturates
finite magnitudes from 65536 on, where the recipe goes to infinity, and only a NaN row with ``round_sf`` scales
values that far, so those rows take per-value codes that correct it with one compare (:func:`_lane_code`). For bf16
input with ``round_sf`` a row's ``sf_inv`` is a power of two: a row of amax up to 65024 scales its values exactly,
and the recipe's rounding bump of a code is then the bf16 value's lowest mantissa bit (:func:`_lane_pair_bits_exact`,
the bumps of a pair taken from the loaded pair with a rotation and an AND); its other rows (amax above 65024, inf,
NaN) take the per-value codes. The decoder's ``cvt.f32.f16`` decodes a code exactly, for bf16 and float32 output
(:func:`_hw_decode`). Interpret mode cannot run inline PTX: there both are integer bit manipulation on float32
patterns with the same bits (:func:`_encode_code`, :func:`_decode`).

Both Mosaic GPU kernels view a row as groups of 8 columns, ``(M, K/8, 8)``. The encoder reads them in
:func:`jaxkern._layouts.group_layout`: each thread holds whole groups as 16-byte vectors, so the input moves as
vectors straight from GMEM to registers and the position in the group is a compile-time constant. The decoder writes
them in :func:`jaxkern._layouts.group_vectors_layout` (the view ``(M, K/8, parts, vec)``: a float32 group's two
16-byte vectors on neighbouring lanes, so that every vector store of a warp is contiguous; whole 32-byte groups per
thread left the float32 decoder at 0.85-0.99x XLA on an H100). The three words of a group are one value per group
(``layout.reduce``). On the GPU the encoder makes a group's words in one pass over the loaded tile (scaled, coded in
pairs, the words cut from the pair blocks with byte permutations, :func:`_lane_pair_words`) and stores them to SMEM
at once (:func:`_hw_stage_scaled_words`; strided lane-level stores, Mosaic GPU's layout inference takes no strided
SMEM view), so that GMEM sees 16-byte vector stores of the CTA's contiguous words; the per-value codes of a NaN row
become words with shifts and ORs (:func:`_lane_words`). The decoder reads the words as three strided 4-byte GMEM
loads (through SMEM it was 1-4% slower for the float32 output and no faster for bf16; the interpret-mode encoder
stores them so) and cuts the codes out as fp16 pairs (:func:`_lane_half_pairs`). The integer paths of
interpret mode build each word as a sum over the group of its codes' shifted pieces (an in-thread reduction) and
broadcast the words over the group to cut every code out, the selects on the position in the group folding where it
is constant. The row's ``|x|`` maximum (a bf16 row's from the threads' packed bf16 maxima,
:func:`_bf16_row_partials`) gives one sf per row (``num_per_channels == K``, correctly rounded divisions, PTX
``div.rn.f32`` where it lowers, :func:`_sf_div`), written in layout A / B / C by the kernel. The decoder reads one sf
per row (layout A / B float32, or the UE8M0 byte of a packed layout-C word); it touches no SMEM, so it runs without
Pallas's automatic warpgroup barriers (:data:`jaxkern._layouts.NO_AUTO_BARRIERS`). The encoder runs without them too:
its only SMEM is the row maximum's (Mosaic GPU's reduction syncs itself) and the staged words, which the staging pass
syncs once before they are read back (and, where a CTA encodes several blocks, once more before the next block's
words overwrite them). Any row count runs (inputs of fewer rows than one layout block are padded); the last CTA's
rows are moved back to end at the last row, as in :mod:`jaxkern.quant._per_token_cast`.

The encoder takes one block of rows per CTA, except for bfloat16 rows of 7168 columns (:data:`_PREFETCH_MIN_K`,
:data:`_PREFETCH_MAX_K`; ncu, H200, 2026-11-29, bf16 8001 x 7168: 37% of the warps' stalls waited on the row's own
GMEM loads): there the grid is persistent, about three CTAs per SM (:data:`_PREFETCH_CTAS_PER_SM`), each encoding a
run of consecutive blocks and loading the next block into registers before it codes the current one
(:func:`_encode_kernel`).

NVIDIA H200 (2026-11-29, CUPTI, cold L2, median of 10; TileKernels' figures in parentheses): the encoder
(``round_sf``) takes 9.68 / 16.72 µs at 4001 / 8001 x 2048 bf16 (10.10 / 17.54), 29.09 / 55.01 µs at 4001 / 8001 x
7168 bf16 with the register prefetch (29.65 / 54.23; one block per CTA 30.69 / 58.10 in the same run), 13.95 µs at
4001 x 2048 float32 (14.65), 75.20 µs at 8001 x 7168 float32 (76.71) and 4.93 µs at 4001 x 576 bf16 (6.53); before
its automatic barriers went, its values were widened per group inside the rows' branches and the largest value was
loaded before the tile: 11.92 / 18.70, 30.58 / 58.03, 15.12, 76.58 and 5.04 µs. The bf16 rows' exact pair code
(:func:`_lane_pair_bits_exact`; 2026-11-30, one run, before -> after, ``round_sf``): 9.73 -> 9.09 / 16.88 -> 15.42
µs at 4001 / 8001 x 2048, 29.23 -> 28.14 / 55.07 -> 54.29 µs at 4001 / 8001 x 7168 (with the packed layout-C sf
9.84 -> 8.83 / 16.83 -> 15.36, 29.11 -> 27.84 / 55.06 -> 53.44); float32 unchanged. The decoder to bf16 takes 3.78
/ 5.36 µs at 4001 / 8001 x 576 (3.81 / 5.86), to float32 4.37 µs at 4001 x 576 (6.59; with a layout-C sf 4.32,
6.66) and 81.25 µs at 8001 x 7168 (119.18).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, scf, vector

from jaxkern import _autodiff, _checks, _config, _dispatch, _ieee
from jaxkern._layouts import NO_AUTO_BARRIERS, flat_chunks, flat_layout, group_layout, group_vectors_layout
from jaxkern.quant import _tiling as tiling
from jaxkern.quant import _validate as validate
from jaxkern.quant._sf_read import _sf_decode, _sf_raw
from jaxkern.quant._nan import abs_key, gpu_nan, key_value
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor


# Columns of the 96-bit big-endian stream of a group (docs/quant.md, "Number formats"): code ``j`` holds bits
# ``[12j, 12j + 12)`` from the top, i.e. bits ``o = 12j % 32`` on of word ``12j // 32``, running into the next word
# when ``o > 20``.
_CODE_BITS = 12


def _encode_code(v):
  """float32 -> E5M6 code (int32), the same bits as :func:`jaxkern.reference.quant.encode_e5m6` with fewer
  integer operations (the integer path of the kernels, interpret mode): the fp16-normal range's round-toward-zero
  code is the float32 pattern's top bits ``(|u| >> 17) - (112 << 6)``, the fp16-subnormal range shifts the
  implicit-one mantissa right by ``130 - e`` (clamped to 31: a shift by 32 or more is undefined in the
  GPU's LLVM IR; anything from 24 on gives 0, as below 2^-24), inf / overflow is 0x7C0 and NaN 0x7FF before
  the rounding step of the recipe (``+1`` where ``(code & 1) + (u & 0x1FFFF) > 0x10000``, sign included)."""
  u = lax.bitcast_convert_type(v, jnp.int32)
  a = u & 0x7FFFFFFF
  e = a >> 23
  normal = (a >> 17) - (112 << 6)
  subnormal = lax.shift_right_logical(0x800000 | (a & 0x7FFFFF), jnp.minimum(130 - e, 31))
  special = jnp.where(a > 0x7F800000, 0x7FF, 0x7C0)
  t = (lax.shift_right_logical(u, 20) & 0x800) | jnp.where(e >= 143, special, jnp.where(e >= 113, normal, subnormal))
  return jnp.where((t & 1) + (u & 0x1FFFF) > 0x10000, t + 1, t) & 0xFFF


def _pack_words(codes, j):
  """``(rows, groups, 8)`` codes and the iota ``j`` along the group -> the group's three int32 words
  (``(rows, groups)`` each): word ``w`` is the sum (an OR: the pieces' bits are disjoint) over ``j`` of the
  part of code ``j`` that falls into it. ``j`` is constant per register element, so the selects fold."""
  words = []
  for w in range(3):
    piece = jnp.zeros_like(codes)
    for c in range(8):
      o = _CODE_BITS * c - 32 * w  # the code's first bit relative to the word's top bit
      if -_CODE_BITS < o < 32:
        part = codes << (32 - _CODE_BITS - o) if o <= 32 - _CODE_BITS else lax.shift_right_logical(codes, o - 20)
        piece = jnp.where(j == c, part, piece)
    words.append(jnp.sum(piece, axis=2))
  return words


def _unpack_codes(words, j):
  """The inverse of :func:`_pack_words`: three broadcasts of a group's words -> its codes, ``j`` the position
  in the group (constant per vector element; the part of it that is a lane property stays a select)."""
  srl = lax.shift_right_logical
  codes = jnp.zeros_like(words[0])
  for c in range(8):
    w, o = divmod(_CODE_BITS * c, 32)
    t = srl(words[w] << o, 32 - _CODE_BITS)
    if o > 32 - _CODE_BITS:
      t = t | srl(words[w + 1], 64 - _CODE_BITS - o)
    codes = jnp.where(j == c, t, codes)
  return codes


def _i32(v: int):
  """An i32 constant; ``v`` may be given as an unsigned 32-bit pattern."""
  return arith.constant(ir.IntegerType.get_signless(32), v - (1 << 32) if v >= 1 << 31 else v)


def _lane_code(f):
  """One float32 scalar (an MLIR value; NaN only the canonical one) -> its E5M6 code (i32): the hardware's
  round-toward-zero fp16 pattern ``h`` (``cvt.rz.f16x2.f32`` with a zero high half), ``t = h >> 4``, one more where
  ``65536 <= |f| < inf`` (round toward zero saturates those to 65504, 0x7BFF, where the recipe's integer fp16 step
  gives infinity, 0x7C00), plus the carry of ``(u & 0x1FFFF) + (t & 1) + 0xFFFF`` out of bit 16 (the recipe's
  ``(t & 1) + (u & 0x1FFFF) > 0x10000``). Equal to :func:`_encode_code` for every such input: scaled values stay
  below 65024·(1 + 2^-23) for a finite row maximum, but with ``round_sf`` a NaN row gets ``sf_inv = -2^127`` (the
  power-of-two step on the NaN pattern), so its products are huge or infinite; the canonical NaN converts to
  0x7FFF, the recipe's NaN pattern, and no code needs the final ``& 0xFFF`` (only a negative NaN's would)."""
  i32 = ir.IntegerType.get_signless(32)
  zero = arith.constant(ir.F32Type.get(), 0.0)  # the high half: a 32-bit result with no zero-extension
  h = llvm.inline_asm(i32, [f, zero], "cvt.rz.f16x2.f32 $0, $2, $1;", "=r,f,f")
  u = arith.bitcast(i32, f)
  # 65536 <= |f| < inf: 2|u| - 2·0x47800000 (mod 2^32) below 2·(0x7F800000 - 0x47800000), unsigned.
  finite_over = arith.cmpi(arith.CmpIPredicate.ult, arith.addi(arith.shli(u, _i32(1)), _i32(0x71000000)),
                           _i32(0x70000000))
  t = arith.addi(arith.shrui(h, _i32(4)), arith.extui(i32, finite_over))
  low = arith.andi(u, _i32(0x1FFFF))
  carry = arith.shrui(arith.addi(arith.addi(low, arith.andi(t, _i32(1))), _i32(0xFFFF)), _i32(17))
  return arith.addi(t, carry)


def _lane_words(codes):
  """Eight codes (i32 MLIR values) -> the three words of their 96-bit big-endian stream, as
  :func:`_pack_words` (docs/quant.md, "Number formats")."""
  words = []
  for w in range(3):
    word = None
    for c, t in enumerate(codes):
      o = _CODE_BITS * c - 32 * w  # as in :func:`_pack_words`
      if -_CODE_BITS < o < 32:
        part = arith.shli(t, _i32(20 - o)) if o < 20 else t if o == 20 else arith.shrui(t, _i32(o - 20))
        word = part if word is None else arith.ori(word, part)
    words.append(word)
  return words


def _lane_pair_bits(fa, fb):
  """Two float32 scalars (MLIR values; NaN only the canonical one; no finite magnitude from 65536 on, where the
  hardware's round toward zero saturates) -> ``code_a << 20 | code_b << 8`` (i32; bits 0-7 are left over from the
  fp16 patterns), the pair's 24 bits of the stream: one ``cvt.rz.f16x2.f32`` for both values (``h_a`` in the high
  half), the codes ``h >> 4`` moved into place with a mask and a shift, plus the recipe's bumps as in
  :func:`_lane_code`, added where their code sits (a code below 0xFFF carries into no neighbour)."""
  i32 = ir.IntegerType.get_signless(32)
  p = llvm.inline_asm(i32, [fa, fb], "cvt.rz.f16x2.f32 $0, $1, $2;", "=r,f,f")
  base = arith.ori(arith.andi(p, _i32(0xFFF00000)), arith.andi(arith.shli(p, _i32(4)), _i32(0xFFFFF)))

  def bump(f, code_bit):  # ((u & 0x1FFFF) + (t & 1) + 0xFFFF) >> 17, t's lowest bit at ``code_bit`` of p
    odd = arith.andi(arith.shrui(p, _i32(code_bit)), _i32(1))
    low = arith.andi(arith.bitcast(i32, f), _i32(0x1FFFF))
    return arith.shrui(arith.addi(arith.addi(low, odd), _i32(0xFFFF)), _i32(17))

  return arith.addi(arith.addi(base, arith.shli(bump(fa, 20), _i32(20))), arith.shli(bump(fb, 4), _i32(8)))


def _lane_pair_bits_exact(pair, scale):
  """As :func:`_lane_pair_bits` (the same 24 bits) for a bf16 pair (i32: value ``2c`` in the low half, ``2c + 1``
  in the high half, as loaded) times ``scale``, a power of two ``2^k`` with ``k >= 0`` (the rows of amax up to 65024
  with ``round_sf``; ``k <= 29`` from the amax clamp): the products are exact and at most 65024. The float32 pattern
  ``u`` of such a product has its low 16 bits zero, so the recipe's ``r = u & 0x1FFFF`` is 0 or 0x10000 (bit 16 of
  ``u``) and its bump ``(t & 1) + r > 0x10000`` is ``(t & 1) & (u >> 16)``; and where ``t`` is odd (``|v| >=
  2^-20``, a normal product of a normal bf16 value) bit 16 of the product's pattern is bit 16 of the bf16 value's
  float32 pattern, its mantissa's lowest bit: bit 0 of ``pair`` for the first value, bit 16 for the second. One
  rotation by 12 moves both onto the codes' lowest bits in the conversion's pair (bits 20 and 4), one three-way AND
  keeps the odd ones, and the bumps go in before the low code is moved up (no code here is 0xFFF, so neither
  carries into its neighbour): a rotation, two ANDs and an add for both bumps, where :func:`_lane_pair_bits` takes
  about a dozen operations."""
  i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
  fa = arith.mulf(arith.bitcast(f32, arith.shli(pair, _i32(16))), scale)
  fb = arith.mulf(arith.bitcast(f32, arith.andi(pair, _i32(0xFFFF0000))), scale)
  p = llvm.inline_asm(i32, [fa, fb], "cvt.rz.f16x2.f32 $0, $1, $2;", "=r,f,f")
  rot = arith.ori(arith.shrui(pair, _i32(12)), arith.shli(pair, _i32(20)))  # a funnel shift (shf.r.wrap)
  z = arith.addi(p, arith.andi(arith.andi(rot, p), _i32(0x00100010)))
  return arith.ori(arith.andi(z, _i32(0xFFF00000)), arith.andi(arith.shli(z, _i32(4)), _i32(0xFFFFF)))


def _prmt(a, b, selector: int):
  """``prmt.b32``: byte ``i`` of the result is byte ``selector``'s nibble ``i`` of ``b:a`` (a's bytes 0-3)."""
  i32 = ir.IntegerType.get_signless(32)
  return llvm.inline_asm(i32, [a, b], f"prmt.b32 $0, $1, $2, {selector:#06x};", "=r,r,r")


def _lane_pair_words(z):
  """A group's four pair blocks (:func:`_lane_pair_bits`, codes ``2i``, ``2i + 1``) -> its three words: each word
  is four of the blocks' top three bytes in stream order (one byte permutation each)."""
  return _prmt(z[0], z[1], 0x3217), _prmt(z[1], z[2], 0x2176), _prmt(z[2], z[3], 0x1765)


def _lane_values(reg):
  """One register of a loaded tile (``vector<n x bf16>`` or ``vector<n x f32>``) -> its n float32 scalars; a bf16
  pair's low half is the even element (its bits shifted up), the high half the odd one (the low half cleared)."""
  i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
  vt = ir.VectorType(reg.type)
  n = vt.shape[0]
  at = lambda v, e: vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
  if vt.element_type == f32:
    return [at(reg, e) for e in range(n)]
  pairs = vector.bitcast(ir.VectorType.get((n // 2,), i32), reg)
  out = []
  for e in range(n // 2):
    p = at(pairs, e)
    out += [arith.bitcast(f32, arith.shli(p, _i32(16))), arith.bitcast(f32, arith.andi(p, _i32(0xFFFF0000)))]
  return out


def _thread_offset(layout, shape):
  """The calling thread's linear offset in ``shape`` (i32) under a tiled layout: :func:`_register_offsets` are
  relative to it (as in :meth:`TiledLayout.thread_idxs`)."""
  i32 = ir.IntegerType.get_signless(32)
  strides = layout.tiling.tile_strides(tuple(mgpu.utils.get_contiguous_strides(shape)))
  dyn = [arith.constant(i32, s) for s in strides[-layout.tiled_tiling_rank:]]
  return arith.addi(mgpu.utils.dyn_dot(layout.warp_indices(), dyn), mgpu.utils.dyn_dot(layout.lane_indices(), dyn))


def _register_offsets(layout, shape):
  """``{register index: linear offset in shape}`` of a tiled layout's registers, relative to the thread's own
  (dynamic) offset, as :meth:`TiledLayout.thread_idxs` numbers them."""
  strides = layout.tiling.tile_strides(tuple(int(s) for s in np.cumprod((1,) + tuple(shape[:0:-1]))[::-1]))
  return {idx: sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(layout.registers_shape(shape))}


def _hw_stage_scaled_words(xr, inv, w_s, lay, round_sf):
  """The encoder's pass from the loaded tile to the staged words (Mosaic GPU only): a tile ``(rows, groups, 8)``
  (bf16 / float32, in ``lay``, :func:`jaxkern._layouts.group_layout`) and its rows' ``sf_inv`` broadcast to ``(rows,
  groups)`` (in ``lay.reduce(2)``) -> each group's three words stored into the SMEM buffer ``w_s`` (``rows·groups·3``
  int32, the GMEM order) as soon as they are made, then a warpgroup sync. Per group: the values widened and scaled, the
  codes two at a time (:func:`_lane_pair_bits`) and the words by byte permutations (:func:`_lane_pair_words`), so
  that only the loaded tile stays live. Products from 65536 on (finite) arise only in a NaN row with ``round_sf``
  (``sf_inv = -2^127``; an inf row's is ``-inf``): with ``round_sf`` a thread takes, per row, the per-value codes
  of :func:`_lane_code` (which carry the saturation on to infinity) where the row's ``sf_inv`` is negative. For
  bf16 with ``round_sf`` a row whose ``sf_inv`` is a power of two from 1 on (pattern from 0x3F800000 on: every row
  of amax up to 65024) takes :func:`_lane_pair_bits_exact` on the loaded pairs instead (its products are the bf16
  values shifted exactly), and every other row (amax above 65024, inf, NaN) the per-value codes."""
  word_lay = lay.reduce(2)
  rows, groups = xr.shape[:2]
  # The exact pair code against :func:`_lane_pair_bits` for these rows (H200, 2026-11-30, CUPTI, cold L2, bf16,
  # round_sf / packed): 4001 x 2048 9.73 -> 9.09 / 9.84 -> 8.83 µs, 8001 x 2048 16.88 -> 15.42 / 16.83 -> 15.36,
  # 4001 x 7168 29.23 -> 28.14 / 29.11 -> 27.84, 8001 x 7168 55.07 -> 54.29 / 55.06 -> 53.44.
  exact = round_sf and xr.dtype == jnp.bfloat16

  @plgpu.inline_mgpu(arg_types=(lay, word_lay, plgpu.RefType()))
  def stage(_, a, s, ref):
    src, dst = lay.to_mgpu(), word_lay.to_mgpu()
    i32 = ir.IntegerType.get_signless(32)
    parts = {}  # group offset -> [(position in the group of the register's first value, register)]
    for idx, off in _register_offsets(src, a.shape).items():
      parts.setdefault(off // 8, []).append((off % 8, a.registers[idx]))

    def widened(off):
      """The group's eight float32 scalars, widened where the row's branch codes them. Against all values widened
      up front, before the rows' branches (H200, 2026-11-29, bf16 round_sf, with the other encoder changes of
      that day off): 4001 x 2048 11.44 against 11.92 µs, 51 against 55 registers; 4001 x 7168 30.99 against
      30.58, 122 against 127 registers."""
      values = {}
      for pos, reg in parts[off]:
        for e, v in enumerate(_lane_values(reg)):
          values[pos + e] = v
      return [values[c] for c in range(8)]

    base = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(ref),
                                    [arith.muli(_thread_offset(dst, (rows, groups)), _i32(3))], i32)
    by_row = {}  # the thread's rows -> [(register index, group offset)]
    for idx, off in _register_offsets(dst, (rows, groups)).items():
      by_row.setdefault(off // groups, []).append((idx, off))

    def bf16_pairs(off):
      """The group's four bf16 pairs as loaded (i32; pair ``c``: values ``2c`` low, ``2c + 1`` high)."""
      pairs = {}
      for pos, reg in parts[off]:
        n = ir.VectorType(reg.type).shape[0] // 2
        vp = vector.bitcast(ir.VectorType.get((n,), i32), reg)
        for e in range(n):
          pairs[pos // 2 + e] = vector.extract(vp, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
      return [pairs[c] for c in range(4)]

    def emit(regs, scale, code):
      """The rows' groups coded by ``code``: "exact" (:func:`_lane_pair_bits_exact`), "pairs"
      (:func:`_lane_pair_bits`) or "values" (:func:`_lane_code`)."""
      for _, off in regs:
        if code == "exact":
          words = _lane_pair_words([_lane_pair_bits_exact(q, scale) for q in bf16_pairs(off)])
        else:
          f = [arith.mulf(v, scale) for v in widened(off)]
          if code == "pairs":
            words = _lane_pair_words([_lane_pair_bits(f[c], f[c + 1]) for c in range(0, 8, 2)])
          else:
            words = _lane_words([_lane_code(v) for v in f])
        for w, word in enumerate(words):
          llvm.store(word, mgpu.utils.getelementptr(base, [3 * off + w], i32))

    for regs in by_row.values():
      scale = vector.extract(s.registers[regs[0][0]], dynamic_position=[],
                             static_position=ir.DenseI64ArrayAttr.get([0]))
      if not round_sf:
        emit(regs, scale, "pairs")
        continue
      if exact:  # sf_inv >= 1 (NaN / inf rows: negative patterns)
        pred, bound, then, other = arith.CmpIPredicate.sge, 0x3F800000, "exact", "values"
      else:  # sf_inv < 0: a NaN or inf row
        pred, bound, then, other = arith.CmpIPredicate.slt, 0, "values", "pairs"
      branch = scf.IfOp(arith.cmpi(pred, arith.bitcast(i32, scale), _i32(bound)), has_else=True)
      with ir.InsertionPoint(branch.then_block):
        emit(regs, scale, then)
        scf.yield_([])
      with ir.InsertionPoint(branch.else_block):
        emit(regs, scale, other)
        scf.yield_([])
    mgpu.utils.warpgroup_barrier()

  stage(xr, inv, w_s)


def _bf16_row_partials(xr, lay):
  """A bf16 tile ``(rows, groups, 8)`` in ``lay`` -> ``(rows, groups)`` float32 in ``lay.reduce(2)``, each entry the
  NaN-propagating ``|x|`` maximum of what its thread holds of the row (the row's maximum is their maximum).
  Lane level, on the packed pairs: the sign cleared with an AND, ``max.NaN.bf16x2`` across the thread's
  registers, then the halves (Mosaic GPU's own reduction maxes every value of a vector one by one; this is
  about half the instructions). A NaN gives the bf16 NaN 0x7FFF, a float32 NaN."""
  word_lay = lay.reduce(2)
  rows, groups = xr.shape[:2]
  out = plgpu.ShapeDtypeStruct((rows, groups), jnp.float32, layout=word_lay)

  @plgpu.inline_mgpu(arg_types=(lay,), return_type=out)
  def partials(_, a):
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    src, dst = lay.to_mgpu(), word_lay.to_mgpu()

    def vmax(p, q):
      return llvm.inline_asm(i32, [p, q], "max.NaN.bf16x2 $0, $1, $2;", "=r,r,r")

    acc = {}  # row -> packed pairs (i32)
    for idx, off in _register_offsets(src, a.shape).items():
      reg = a.registers[idx]
      n = ir.VectorType(reg.type).shape[0] // 2
      pairs = vector.bitcast(ir.VectorType.get((n,), i32), reg)
      pairs = [arith.andi(vector.extract(pairs, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e])),
                          _i32(0x7FFF7FFF)) for e in range(n)]
      row = off // (groups * 8)
      acc[row] = pairs if row not in acc else [vmax(p, q) for p, q in zip(acc[row], pairs)]
    best = {}
    for row, pairs in acc.items():
      while len(pairs) > 1:
        pairs = [vmax(p, q) for p, q in zip(pairs[::2], pairs[1::2])] + pairs[len(pairs) // 2 * 2:]
      (p,) = pairs
      p = vmax(p, arith.shrui(p, _i32(16)))  # the high value against the low one, in the low half
      best[row] = arith.bitcast(f32, arith.shli(p, _i32(16)))
    regs = np.empty(dst.registers_shape((rows, groups)), object)
    for idx, off in _register_offsets(dst, (rows, groups)).items():
      regs[idx] = vector.broadcast(ir.VectorType.get((1,), f32), best[off // groups])
    return mgpu.FragmentedArray(_registers=regs, _layout=dst, _is_signed=None)

  return partials(xr)


def _tile(m: int, k: int, unit: int):
  """Rows per CTA and CTAs for ``m`` rows (at least ``unit``) of ``k`` float32-sized values: about
  :data:`jaxkern.quant._tiling.THREAD_BYTES` (128) float32-sized bytes per thread. For the encoder, H200,
  2026-11-29, bf16 4001 x 2048 round_sf (2 rows per CTA): 9.68 µs against 10.66 at 256 bytes (4 rows, 69
  registers) and 11.42 at 64 (1 row); 8001 x 2048 16.72 against 17.90 at 256; float32 4001 x 2048 13.95 against
  14.38 at 256."""
  rt = tiling.tile_rows(m, k, 4, unit)
  return rt, pl.cdiv(m, rt)


def _pad_rows(a, rows: int):
  return jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1)) if rows > a.shape[0] else a


def _sf_out_type(r: int, col_major: bool, packed: bool):
  """The kernel's sf output for ``r`` rows: layout A ``(1, r)`` float32 (the bytes of ``(r, 1)``), B ``(1,
  align(r, 4))`` float32 or C ``(1, align(r, 4))`` int32 (UE8M0 byte in the low byte: one block per row)."""
  cols = ref.cdiv(r, 4) * 4 if col_major else r
  return jax.ShapeDtypeStruct((1, cols), jnp.int32 if packed else jnp.float32)


def _row_amax(xr, lay, interpret):
  """The rows' NaN-propagating ``|x|`` maximum (float32) of a loaded ``(rows, groups, 8)`` tile in ``lay``: a bf16
  tile on the GPU from the threads' bf16 maxima (:func:`_bf16_row_partials`; exact, the widening is monotone),
  else on :func:`abs_key` keys of the float32 values."""
  if interpret is None and xr.dtype == jnp.bfloat16:
    return jnp.max(_bf16_row_partials(xr, lay), axis=1)
  key = abs_key(xr.astype(jnp.float32), interpret)
  return key_value(jnp.max(jnp.max(key, axis=2), axis=1), interpret)


def _sf_div(lay, rt: int, interpret):
  """The correctly rounded division of the rows' scale factors (``(rt,)`` arrays in ``lay.reduce(2).reduce(1)``):
  on the GPU PTX ``div.rn.f32`` (IEEE, specials included), in interpret mode and for one row per CTA
  :func:`jaxkern._ieee.exact_div` (the same quotients). ``div.rn.f32`` against ``exact_div``, H200, 2026-11-29:
  the bf16 encoder 4001 / 8001 x 2048 at 12.37 / 18.45 µs against 12.64 / 20.11."""
  # Not a variant but a lowering constraint: a one-row array through inline PTX fails Mosaic GPU's lowering (a
  # missing layout attribute), so one-row CTAs keep ``exact_div``.
  if interpret is not None or rt == 1:
    return _ieee.exact_div
  return _ieee.mosaic_ptx("div.rn.f32", lay.reduce(2).reduce(1), (rt,))


# The encoder's register prefetch (:func:`_prefetch_blocks_per_cta`) runs for bfloat16 rows of at least this many
# columns. Against one block per CTA in the same run (H200, 2026-11-29, CUPTI, cold L2, whole grid), bf16 x 7168:
# 4001 rows 30.69 -> 29.09 µs (round_sf; packed 30.77 -> 29.07), 8001 rows 58.10 -> 55.01 (packed 58.34 -> 55.10).
# Slower elsewhere: bf16 x 2048 by 16-22% (8001 rows 16.80 -> 19.49, 4001 9.73 -> 11.74), float32 x 7168 by 21-25%
# (8001 rows 76.46 -> 92.64), float32 x 2048 by 8-13%; mixed at 576 columns (bf16 8001 rows 8.46 -> 7.42, 4001
# 4.93 -> 5.06). Blocks prefetched into SMEM slots by bulk copies (2 or 3 blocks ahead, 3 or 4 CTAs per SM) were
# slower than one block per CTA at bf16 x 7168 (8001 rows 58.13 -> 64.88 with 2 slots, 4 CTAs per SM).
_PREFETCH_MIN_K = 7168
# and at most this many: the second live tile grows with the row (167 registers per thread at 7168 columns, below);
# wider rows, not measured, keep one block per CTA rather than risk spills.
_PREFETCH_MAX_K = 7168
# CTAs per SM that the prefetch grid is sized for: with the second tile live the encoder takes 167 registers per
# thread (ncu, H200, 2026-11-29, bf16 8001 x 7168; 122 without it), so three 128-thread CTAs fill an SM's 64K
# registers and the whole grid is resident at once.
_PREFETCH_CTAS_PER_SM = 3


def _prefetch_blocks_per_cta(num_blocks: int, dtype, k: int):
  """Row blocks per CTA of the encoder's persistent grid for ``num_blocks`` blocks of ``k`` columns of ``dtype``
  (:data:`_PREFETCH_CTAS_PER_SM` CTAs per SM), or None for one block per CTA: outside bfloat16 with
  :data:`_PREFETCH_MIN_K` ``<= k <=`` :data:`_PREFETCH_MAX_K`, and where the grid would give each CTA one block
  anyway (nothing to prefetch)."""
  if dtype != jnp.bfloat16 or not _PREFETCH_MIN_K <= k <= _PREFETCH_MAX_K:
    return None
  per_cta = pl.cdiv(num_blocks, _config.num_sms() * _PREFETCH_CTAS_PER_SM)
  return per_cta if per_cta > 1 else None


def _warpgroup_sync():
  """A barrier of the calling warpgroup (Mosaic GPU only)."""
  plgpu.inline_mgpu()(lambda _: mgpu.utils.warpgroup_barrier())()


@functools.partial(jax.jit, static_argnames=("round_sf", "col_major", "packed", "interpret"))
def _encode_kernel(x, *, round_sf, col_major, packed, interpret):
  """``x`` ``(M, K)`` bf16 / float32 -> ``(packed (M, 3K/2) uint8, sf in layout A / B / C)``.

  The rows go in blocks of ``rt`` (:func:`_tile`), one block per CTA, the last one moved back to end at the last
  row. For bfloat16 with ``K`` from :data:`_PREFETCH_MIN_K` to :data:`_PREFETCH_MAX_K` (and more blocks than the
  prefetch grid's CTAs) the grid is persistent instead (:func:`_prefetch_blocks_per_cta`): each CTA encodes a run
  of consecutive blocks (the last run moved back to end at the last block, over blocks its neighbour encodes too,
  with the same bits) and loads the next block into registers before it codes the current one (the run's last
  block is loaded twice)."""
  m, k = x.shape
  g = k // 8
  # A long row's groups over the lanes and then the warps (group_layout; K=2048: all four warps). Each row on the
  # lanes of one warp only (its maximum by shuffles, no SMEM) was slower at K=2048 (H200, 2026-11-29, bf16
  # round_sf, 4001 / 8001 rows: 12.61 / 21.81 µs against 9.68 / 16.72; 138 registers and 16% occupancy against 51
  # and 45%).
  lay, unit = group_layout(g, 8, x.dtype.itemsize)
  xv = _pad_rows(x.reshape(m, g, 8), unit)
  r = xv.shape[0]
  rt, num_blocks = _tile(r, k, unit)
  per_cta = _prefetch_blocks_per_cta(num_blocks, x.dtype, k)
  num_ctas = num_blocks if per_cta is None else pl.cdiv(num_blocks, per_cta)
  sf_type = _sf_out_type(r, col_major, packed)
  lane_level = interpret is None  # lane-level codes and words, staged in SMEM (Mosaic GPU only)
  words_type = jax.ShapeDtypeStruct((r * g * 3,) if lane_level else (r, g, 3), jnp.int32)
  scratch = (plgpu.SMEM((rt * g * 3,), jnp.int32),) if lane_level else ()

  @functools.partial(plgpu.kernel, out_type=(words_type, sf_type), scratch_types=scratch, grid=(num_ctas,),
                     grid_names=("i",), interpret=interpret, compiler_params=NO_AUTO_BARRIERS)
  def kernel(x_g, c_g, o_g, sf_g, *w_s):
    # The format's largest value loaded before the tile rather than after the row maximum (H200, 2026-11-29, bf16
    # 4001 x 2048 round_sf, the other encoder changes of that day off: 9.81 against 11.92 µs).
    max_value = c_g[0]

    def load(row0):
      return plgpu.load(x_g.at[pl.ds(row0, rt)], layout=lay, optimized=False)

    def zero_sf_padding():  # layout B / C columns past the last row, by the last CTA
      if sf_type.shape[1] > r:
        @pl.when(lax.axis_index("i") == num_ctas - 1)
        def _():
          for c in range(r, sf_type.shape[1]):
            sf_g[0, c] = jnp.zeros((), sf_type.dtype)

    def encode(xr, row0, *, pad_sf, before_staging=None):
      """The block of ``rt`` rows from ``row0``, loaded as ``xr``: its sf (and with ``pad_sf`` the sf padding) and
      its words; ``before_staging`` runs after the row maximum, before the words are staged."""
      rows = pl.ds(row0, rt)
      amax = _row_amax(xr, lay, interpret)
      if before_staging is not None:
        before_staging()
      sf, inv = ref.scale_factors(amax, max_value, "e5m6", round_sf, div=_sf_div(lay, rt, interpret))
      sf = gpu_nan(sf, interpret)
      sf_g[0, rows] = (lax.bitcast_convert_type(sf, jnp.int32) >> 23) & 0xFF if packed else sf
      if pad_sf:
        zero_sf_padding()
      if not lane_level:  # interpret mode: the integer recipe, strided 4-byte word stores
        codes = _encode_code(gpu_nan(xr.astype(jnp.float32) * inv[:, None, None], interpret))
        for w, word in enumerate(_pack_words(codes, plgpu.broadcasted_iota(jnp.int32, (rt, g, 8), 2, layout=lay))):
          o_g[rows, pl.ds(0, g), w] = word
        return
      (words_s,) = w_s
      # One pass from the loaded tile to the staged words: against the scaled tile coded per value, then staged
      # (H200, 2026-11-29), bf16 8001 x 2048 18.45 against 21.73 µs, 8001 x 7168 57.98 against 63.14 µs, 55 against
      # 78 registers per thread at 2048 columns.
      _hw_stage_scaled_words(xr, lax.broadcast_in_dim(inv, (rt, g), (0,)), words_s, lay, round_sf)
      for off, n, vec in flat_chunks(rt * g * 3, 4):
        o_g[pl.ds(row0 * (g * 3) + off, n)] = plgpu.load(words_s.at[pl.ds(off, n)], layout=flat_layout(vec),
                                                         optimized=False)

    if per_cta is None:
      row0 = jnp.minimum(lax.axis_index("i") * rt, r - rt)
      encode(load(row0), row0, pad_sf=True)
      return
    first = jnp.minimum(lax.axis_index("i") * per_cta, num_blocks - per_cta)

    def row_of(j):
      return jnp.minimum((first + j) * rt, r - rt)

    def staged_words_read():
      """Every thread past the copy-out of the previous block's staged words before this block's are staged (a
      row maximum within one warp syncs nothing)."""
      if lane_level:
        _warpgroup_sync()

    def step(j, xr):
      upcoming = load(row_of(jnp.minimum(j + 1, per_cta - 1)))  # issued before this block is coded
      encode(xr, row_of(j), pad_sf=False, before_staging=staged_words_read)
      return upcoming

    lax.fori_loop(0, per_cta, step, load(row_of(0)))
    zero_sf_padding()

  # The largest value as a one-element host constant, loaded in the kernel (not folded in interpret mode).
  words, sf = kernel(xv, np.full((1,), ref.E5M6_MAX, np.float32))
  data = lax.bitcast_convert_type(words.reshape(r, g * 3)[:m], jnp.uint8).reshape(m, 3 * k // 2)
  if r == m:
    return data, sf if col_major else sf.reshape(m, 1)
  sf = sf[0, :m]  # fewer rows than one layout block: padded rows dropped, column-major padding re-zeroed
  return data, sf.reshape(m, 1) if not col_major else jnp.pad(sf, (0, ref.cdiv(m, 4) * 4 - m)).reshape(1, -1)


def _decode(t):
  """E5M6 codes (int32) -> float32 with integer operations: normal and inf / NaN codes as the float32
  pattern ``sign | E << 23 | m << 17`` (``E = e + 112``, 255 for ``e = 31``), subnormal ones ``m · 2^-20``."""
  e = (t >> 6) & 0x1F
  m = t & 0x3F
  normal = (jnp.where(e == 31, 255, e + 112) << 23) | (m << 17)
  subnormal = lax.bitcast_convert_type(m.astype(jnp.float32) * jnp.float32(2.0**-20), jnp.int32)
  return lax.bitcast_convert_type(((t & 0x800) << 20) | jnp.where(e == 0, subnormal, normal), jnp.float32)


def _fshl(hi, lo, n: int):
  """The top 32 bits of the 64-bit ``hi:lo`` shifted left by ``n`` (a funnel shift, ``shf.l``)."""
  return arith.ori(arith.shli(hi, _i32(n)), arith.shrui(lo, _i32(32 - n)))


def _lane_half_pairs(w0, w1, w2):
  """A group's three words (i32 MLIR values) -> its eight codes as fp16 patterns ``t << 4``, two per i32: codes
  ``2i`` in the high half, ``2i + 1`` in the low half (two or three shifts and one AND-OR per pair)."""
  hi, lo = _i32(0xFFF00000 - (1 << 32)), _i32(0xFFF0)

  def pair(a, b):  # (a & 0xFFF00000) | (b & 0xFFF0)
    return arith.ori(arith.andi(a, hi), arith.andi(b, lo))

  srl, shl = arith.shrui, arith.shli
  return (pair(w0, srl(w0, _i32(4))), pair(_fshl(w0, w1, 24), srl(w1, _i32(12))),
          pair(shl(w1, _i32(16)), _fshl(w1, w2, 12)), pair(shl(w2, _i32(8)), shl(w2, _i32(4))))


def _hw_decode(words, scale, lay, out_dtype, part=None):
  """Three word arrays ``(rows, groups)`` and the rows' sf broadcast to ``(rows, groups)`` (all in ``lay.reduce(3)
  .reduce(2)``) -> ``RN(decode(code) · sf)`` as ``(rows, groups, parts, vec)`` ``out_dtype`` in ``lay``
  (:func:`jaxkern._layouts.group_vectors_layout`), at the lane level: a code is the top 12 bits of an fp16
  pattern, so the hardware conversion ``cvt.f32.f16`` decodes it exactly (subnormals, inf and NaN included;
  :func:`_decode`'s values), two codes per i32 (:func:`_lane_half_pairs`). bf16: one 16-byte vector per group,
  the float32 products rounded once. float32: two vectors of 4 per group on neighbouring lanes, each lane taking
  the two pairs of its half (``part``, the iota along ``parts`` in ``lay``, selects them). The float32 product's
  NaN is the GPU's canonical one. Mosaic GPU only."""
  word_lay = lay.reduce(3).reduce(2)
  rows, groups = scale.shape
  vec = min(16 // jnp.dtype(out_dtype).itemsize, 8)
  shape = (rows, groups, 8 // vec, vec)
  out = plgpu.ShapeDtypeStruct(shape, out_dtype, layout=lay)
  split = part is not None

  def decode(_, w0, w1, w2, sf, *part_arr):
    src, dst = word_lay.to_mgpu(), lay.to_mgpu()
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    f16x2, f32x2 = ir.VectorType.get((2,), ir.F16Type.get()), ir.VectorType.get((2,), f32)
    out_el = mgpu.utils.dtype_to_ir_type(jnp.dtype(out_dtype))
    first = lambda reg: vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
    at = {off: idx for idx, off in _register_offsets(src, (rows, groups)).items()}
    regs = np.empty(dst.registers_shape(shape), object)
    for idx, off in _register_offsets(dst, shape).items():
      g = at[off // 8]
      s = vector.broadcast(f32x2, first(sf.registers[g]))
      pairs = _lane_half_pairs(*(first(w.registers[g]) for w in (w0, w1, w2)))
      if split:  # this lane's half of the group: pairs 0, 1 or 2, 3
        upper = arith.cmpi(arith.CmpIPredicate.ne, first(part_arr[0].registers[idx]), _i32(0))
        pairs = [arith.select(upper, pairs[2 + i], pairs[i]) for i in range(2)]
      parts = []
      for p in pairs:
        v = arith.mulf(arith.extf(f32x2, vector.bitcast(f16x2, vector.broadcast(ir.VectorType.get((1,), i32), p))), s)
        v = vector.shuffle(v, v, [1, 0])  # the high half holds the even code
        parts.append(v if out_el == f32 else arith.truncf(ir.VectorType.get((2,), out_el), v))
      while len(parts) > 1:
        parts = [vector.shuffle(a, b, list(range(2 * ir.VectorType(a.type).shape[0])))
                 for a, b in zip(parts[::2], parts[1::2])]
      regs[idx] = parts[0]
    return mgpu.FragmentedArray(_registers=regs, _layout=dst, _is_signed=None)

  arg_types = (word_lay,) * 4 + ((lay,) if split else ())
  return plgpu.inline_mgpu(arg_types=arg_types, return_type=out)(decode)(*words, scale, *((part,) if split else ()))


@functools.partial(jax.jit, static_argnames=("out_dtype", "col_major", "interpret"))
def _decode_kernel(q, sf, *, out_dtype, col_major, interpret):
  """``q`` ``(M, 3K/2)`` uint8 with one sf per row (layout A ``(M, 1)``, B ``(1, Mp)``, C ``(1, Mp)`` int32)
  -> ``(M, K)`` ``out_dtype``."""
  m, n = q.shape
  k, g = 2 * n // 3, n // 12
  lay, unit = group_vectors_layout(g, 8, jnp.dtype(out_dtype).itemsize)
  vec = min(16 // jnp.dtype(out_dtype).itemsize, 8)
  shape = (g, 8 // vec, vec)
  words = _pad_rows(lax.bitcast_convert_type(q.reshape(m, g * 3, 4), jnp.int32).reshape(m, g, 3), unit)
  r = words.shape[0]
  mode = "packed" if sf.dtype == jnp.int32 else "rows"
  sf = sf if col_major or mode == "packed" else sf.reshape(1, m)
  sf = jnp.pad(sf, ((0, 0), (0, max(0, r - sf.shape[1]))))
  # The default bytes per thread: 64 or 256 moved the bf16 decoder of 4001 / 8001 x 576 by no more than noise
  # (3.74-3.81 / 5.33-5.36 µs, H200, 2026-11-29).
  rt, num_ctas = _tile(r, k, unit)
  word_lay = lay.reduce(3).reduce(2)
  # The hardware decode on the GPU for both outputs: to float32 against the integer decode (H200, 2026-11-29)
  # 4001 x 576 4.37 against 7.02 µs, 8001 x 7168 81.25 against 88.54 µs.
  hardware = interpret is None

  # No SMEM in this kernel: Pallas's automatic barriers would only add syncs (off: bf16 4001x576 4.14 -> 3.87 µs,
  # H200, 2026-11-28).
  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((r, *shape), out_dtype), grid=(num_ctas,),
                     grid_names=("i",), interpret=interpret, compiler_params=NO_AUTO_BARRIERS)
  def kernel(w_g, sf_g, o_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, r - rt), rt)
    scale = _sf_decode(_sf_raw(sf_g, mode, 0, rows, word_lay.reduce(1)), mode, 0)
    w = [plgpu.load(w_g.at[rows, pl.ds(0, g), i], layout=word_lay, optimized=False) for i in range(3)]
    if hardware:
      part = plgpu.broadcasted_iota(jnp.int32, (rt, *shape), 2, layout=lay) if vec < 8 else None
      o_g[rows] = _hw_decode(w, lax.broadcast_in_dim(scale, (rt, g), (0,)), lay, out_dtype, part)
      return
    w = [lax.broadcast_in_dim(wi, (rt, *shape), (0, 1)) for wi in w]
    j = sum(plgpu.broadcasted_iota(jnp.int32, (rt, *shape), d, layout=lay) * f for d, f in ((2, vec), (3, 1)))
    o_g[rows] = gpu_nan(_decode(_unpack_codes(w, j)) * scale[:, None, None, None], interpret).astype(out_dtype)

  return kernel(words, sf)[:m].reshape(m, k)


def _check_cast(x, num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  x = _checks.as_array("x", x)
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  _checks.check_multiple("x", x, 1, 8)
  if num_per_channels != x.shape[1]:
    raise ValueError(f"num_per_channels must equal K={x.shape[1]} (one sf per row), got {num_per_channels}")
  validate.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  return x


def per_token_cast_to_e5m6(x: jax.typing.ArrayLike, num_per_channels: int, *,
                           use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                           use_packed_ue8m0: bool = False, implementation: str | None = None) -> QuantTensor:
  """Row-wise cast to packed 12-bit E5M6, one scale per row (docs/quant.md, "Casts"); also reached as
  ``per_token_cast(x, "e5m6", K, ...)``.

  Args:
    x: ``(M, K)`` bfloat16 / float32 array (or nested list), ``K % 8 == 0``.
    num_per_channels: must equal ``K``.
    use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: output sf layout B / power-of-two sf /
      packed UE8M0 layout C (:mod:`jaxkern.reference.quant`); packed needs the other two.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``QuantTensor(data, sf)``: ``data`` ``(M, 3K/2)`` uint8, the little-endian bytes of three uint32 words
    per 8 columns holding their E5M6 codes (``s eeeee mmmmmm``, bias 15) big-endian; ``sf`` (max value 65024,
    clamp minimum 1e-4) layout A ``(M, 1)`` float32, B ``(1, align(M, 4))`` float32 or C ``(1, align(M, 4))``
    int32. Codes are the format's recipe bit for bit (docs/quant.md, "Number formats"): fp16 round toward
    zero, then ``+1`` where ``(code & 1) + (low 17 bits of x · sf_inv) > 0x10000`` (round to nearest even
    above 2^-14 relative to 65024·sf, the recipe's own rule below).

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
  _checks.check_shape("x[1] (sf)", sf, want, f" for blocks {tuple(x_block_size)}")
  return QuantTensor(q, sf), k


def cast_back_e5m6(x: QuantTensor | tuple[jax.Array, jax.Array], fmt: str, x_block_size: tuple[int, int], *,
                   x_use_tma_aligned_col_major_sf: bool = False, implementation: str | None = None) -> jax.Array:
  """Dequantises packed E5M6 ``(q, sf)`` (docs/quant.md, "Cast-backs"): ``RN(decode(code) · sf)`` in float32, then one
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

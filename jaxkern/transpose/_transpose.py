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

2-D 8-bit transposes skip the widening (all but those of 64 rows, below one tile): the array is
viewed as 16-bit words, each holding two neighbouring bytes of a row, and the two row parities as
separate planes, so that a 2x2 block of bytes is two words, one per plane. Swapping bytes between
the planes (shifts and masks) transposes every 2x2 block, and a 16-bit transpose of each plane
moves the blocks. Where neither of the two kernels below takes the array (below 8 MB in interpret
mode; N below 256 above their sizes), this runs one CTA per tile of 128 rows x 64 bytes
(:func:`_pair_tile_kernel`, :data:`_PAIR_TILE`).

On a GPU, 2-D 8-bit transposes of up to :data:`SMEM_TRANSPOSE_MAX_ELEMENTS` (4032x3072) take a
kernel without TMA (:func:`_smem_transpose_kernel`, one CTA of 128 threads per tile of 64 or 128
bytes each way): each thread loads 4-byte words of 4 input rows, transposes every 4x4 byte block in
registers with 8 byte permutes (PTX ``prmt``) and stores the words into an SMEM tile whose words are
XOR-swizzled by row (no bank conflicts); after one barrier the output rows are written in 16-byte
chunks. It is lane-level code
(``plgpu.inline_mgpu``), which interpret mode cannot run: there these arrays keep the other kernels.

Large 2-D transposes of 8-bit data (from 8 MB; on a GPU above :data:`SMEM_TRANSPOSE_MAX_ELEMENTS`)
and of mid-sized 16-bit data (12-64 MiB) take a persistent kernel instead (:func:`_ring_kernel`):
one CTA per SM walks its tiles with a ring of 5 TMA loads in flight and double-buffered TMA stores,
on the same byte-pair words for 8-bit data (it needs M >= 128 and N >= 256 there).
H200, µs (one CTA per tile, 8-bit bytes widened / ring): e4m3 8064x7168 30.2 / 29.9 (90.3% of copy),
8064x4096 18.0 / 16.9, 4032x7168 16.8 / 15.6, 8064x2048 10.1 / 9.2; bf16 4032x2048 9.6 / 9.3,
4032x4096 17.3 / 16.9, 8064x2048 17.4 / 17.1. Larger 16-bit arrays (8064x7168: 58.4 / 59.3) and
small ones (576 columns) run faster one CTA per tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.mosaic.gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm

from jaxkern import _checks, _config, _dispatch
from jaxkern._layouts import NO_AUTO_BARRIERS
from jaxkern.reference import transpose as ref

ALIGNMENT = 64  # both transposed dimensions must be multiples of this
_LARGE_BYTES = 32 << 20  # input size above which the tiling favours bandwidth over latency


def _tiling(b: int, m: int, n: int, itemsize: int) -> tuple[int, int, str]:
  """Tile ``(BM, BN)`` and grid order, chosen from measurements on an H200.

  Tiles are 128 wide where the dimension allows it (at most 32 KiB per tile), except
  for small 16/32-bit arrays, which are latency-bound and run fastest with the most
  CTAs (64x64). Large arrays walk the output's rows first, which keeps DRAM pages open.
  """
  small = b * m * n * itemsize <= _LARGE_BYTES
  if small and itemsize > 1:
    return 64, 64, "bij"
  bm = 128 if m % 128 == 0 else 64
  bn = 128 if n % 128 == 0 and itemsize <= 2 else 64
  return bm, bn, "bij" if small else "bji"


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def _batched_transpose_kernel(x: jax.Array, interpret=None, tiling=None) -> jax.Array:
  b, m, n = x.shape
  bm, bn, order = tiling or _tiling(b, m, n, x.dtype.itemsize)
  widen = x.dtype.itemsize == 1
  load_t = b == 1 and x.dtype.itemsize == 2 and (bm, bn) == (64, 64)
  sizes = {"b": b, "i": m // bm, "j": n // bn}

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((b, n, m), x.dtype),
      grid=tuple(sizes[a] for a in order),
      grid_names=tuple(order),
      scratch_types=dict(x_s=plgpu.SMEM((bm, bn), x.dtype), o_s=plgpu.SMEM((bn, bm), x.dtype),
                         bar=plgpu.Barrier(num_arrivals=1)),
      # x_s is read and o_s written once, and commit_smem() syncs before the TMA store (H200,
      # 4032x576 bf16: 4.10-4.16 us without the automatic barriers, 4.13-4.22 with).
      compiler_params=NO_AUTO_BARRIERS,
      interpret=interpret,
  )
  def kernel(x_g, o_g, x_s, o_s, bar):
    bi, i, j = lax.axis_index("b"), lax.axis_index("i"), lax.axis_index("j")
    src = x_g.at[bi, pl.ds(i * bm, bm), pl.ds(j * bn, bn)]
    dst = o_g.at[bi, pl.ds(j * bn, bn), pl.ds(i * bm, bm)]
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
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return kernel(x)


_RING_BYTES = {1: (8_000_000, None), 2: (12 << 20, 64 << 20)}  # 2-D sizes (bytes) taking the ring kernel
_RING_TILE = {1: (64, 128), 2: (128, 128)}  # words per tile (per plane for 8-bit data): 32 KB
_RING_STAGES = 5  # input tiles in flight per CTA; with 2 output buffers 224 KB of SMEM


def _use_ring(x) -> bool:
  if x.dtype.itemsize not in _RING_TILE:
    return False
  (m, n), (lo, hi), (bw, cw) = x.shape, _RING_BYTES[x.dtype.itemsize], _RING_TILE[x.dtype.itemsize]
  nbytes, pair = x.size * x.dtype.itemsize, 2 if x.dtype.itemsize == 1 else 1
  return lo <= nbytes and (hi is None or nbytes <= hi) and m >= pair * bw and n >= pair * cw


@functools.partial(jax.jit, static_argnames=("interpret",))
def _ring_kernel(x: jax.Array, interpret=None) -> jax.Array:
  """Persistent 2-D ``(M, N) -> (N, M)`` for 8- and 16-bit data (see the module docstring).

  The kernel transposes ``P`` planes of 16-bit words, ``w`` ``(R, P, C) -> (C, P, R)``. 16-bit data is
  one plane, ``x`` itself. 8-bit data is seen as 2x2 byte blocks: ``w`` int16 ``(M/2, 2, N/2)``,
  ``w[r, k, c]`` holding bytes ``x[2r+k, 2c]`` (low) and ``x[2r+k, 2c+1]``; from planes ``w0 = w[:, 0]``,
  ``w1 = w[:, 1]`` the output words ``y[c, k', r]`` (bytes ``x[2r, 2c+k']`` and ``x[2r+1, 2c+k']``) are
  ``t0 = lo(w0) | lo(w1) << 8`` and ``t1 = hi(w0) | hi(w1) << 8`` transposed.

  A tile is ``bw x cw`` words of each plane (one TMA copy per plane), loaded in the WGMMA layout,
  re-laid out to WGMMA_TRANSPOSED and stored through transposed views of an SMEM buffer, written back
  with one TMA copy per plane. The last row / column tile is moved back to end at the edge (it
  rewrites some words with the same values). CTA ``c`` takes tiles ``c, c + C, ...`` (column tiles
  fastest), with ``_RING_STAGES - 1`` tile loads ahead of the one it transposes and the previous
  tile's stores in flight.
  """
  m, n = x.shape
  if pairs := x.dtype.itemsize == 1:
    w = _byte_pair_words(x)
  else:
    w = x.reshape(m, 1, n)
  r, planes, c = w.shape
  (bw, cw), stages = _RING_TILE[x.dtype.itemsize], _RING_STAGES
  gj = pl.cdiv(c, cw)
  tiles = pl.cdiv(r, bw) * gj
  ctas = min(tiles, _config.num_sms())

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((c, planes, r), w.dtype),
      grid=(ctas,),
      grid_names=("c",),
      scratch_types=dict(x_s=plgpu.SMEM((stages, planes, bw, cw), w.dtype),
                         o_s=plgpu.SMEM((2, planes, cw, bw), w.dtype),
                         bar=plgpu.Barrier(num_arrivals=planes, num_barriers=stages)),
      interpret=interpret,
  )
  def kernel(w_g, o_g, x_s, o_s, bar):
    cta = lax.axis_index("c")
    count = (tiles - cta + ctas - 1) // ctas  # tiles of this CTA

    def window(t):
      tile = cta + t * ctas
      i, j = tile // gj, tile % gj
      return pl.ds(jnp.minimum(i * bw, r - bw), bw), pl.ds(jnp.minimum(j * cw, c - cw), cw)

    def fetch(t):
      @pl.when(t < count)
      def _():
        rows, cols = window(t)
        for k in range(planes):
          plgpu.copy_gmem_to_smem(w_g.at[rows, k, cols], x_s.at[t % stages, k], bar.at[t % stages])

    for t in range(stages - 1):
      fetch(t)

    @pl.loop(0, count)
    def _(t):
      fetch(t + stages - 1)
      plgpu.barrier_wait(bar.at[t % stages])
      v = [plgpu.load(x_s.at[t % stages, k], layout=plgpu.Layout.WGMMA) for k in range(planes)]
      if pairs:
        v = _swap_pair_bytes(*v)
      plgpu.wait_smem_to_gmem(planes, wait_read_only=True)  # the stores of tile t - 2 have read o_s[t % 2]
      for k, vk in enumerate(v):
        o_s.at[t % 2, k].T[...] = plgpu.layout_cast(vk, plgpu.Layout.WGMMA_TRANSPOSED)
      plgpu.commit_smem()
      rows, cols = window(t)
      for k in range(planes):
        plgpu.copy_smem_to_gmem(o_s.at[t % 2, k], o_g.at[cols, k, rows])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  y = kernel(w)
  if not pairs:
    return y.reshape(n, m)
  return _bytes_of_pair_words(y, x.dtype)


def _byte_pair_words(x):
  """8-bit ``(M, N)`` as int16 words ``(M/2, 2, N/2)``: ``w[r, k, c]`` holds ``x[2r+k, 2c]`` (low byte) and
  ``x[2r+k, 2c+1]`` (a bitcast, no copy)."""
  m, n = x.shape
  w = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint8).reshape(m, n // 2, 2), jnp.int16)
  return w.reshape(m // 2, 2, n // 2)


def _bytes_of_pair_words(y, dtype):
  """The transposed words ``(N/2, 2, M/2)`` back as ``(N, M)`` bytes of ``dtype`` (a bitcast)."""
  n2, _, m2 = y.shape
  y = lax.bitcast_convert_type(y.reshape(2 * n2, m2), jnp.uint8).reshape(2 * n2, 2 * m2)
  return lax.bitcast_convert_type(y, dtype)


def _swap_pair_bytes(w0, w1):
  """Transposes every 2x2 byte block held by the words ``w0`` (even row) and ``w1`` (odd row):
  ``(lo(w0) | lo(w1) << 8, hi(w0) | hi(w1) << 8)``."""
  return ((w0 & 0xFF) | lax.shift_left(w1, jnp.int16(8)),
          lax.shift_right_logical(w0, jnp.int16(8)) | (w1 & jnp.int16(-256)))


# Words per tile (per plane) of the one-tile byte-pair kernel: 64x32 words are 128 rows x 64 bytes (8 KB).
# H200, 2026-11-29 (CUPTI, cold L2, median of 20, two passes), e4m3, µs, 64x32 / 64x16 words / the one-tile
# kernel widening bytes: 8064x576 4.45 / 4.54-4.62 / 5.02 (TileKernels 4.46); 4032x576 3.33 / 3.30 / 3.47 (3.16).
_PAIR_TILE = (64, 32)


def _use_pair_tiles(x) -> bool:
  """2-D 8-bit data of at least one tile each way (every M but 64; N is at least 64) take
  :func:`_pair_tile_kernel` (when neither :func:`_smem_transpose_kernel` nor the ring kernel takes them)."""
  (m, n), (bw, cw) = x.shape, _PAIR_TILE
  return x.dtype.itemsize == 1 and m >= 2 * bw and n >= 2 * cw


@functools.partial(jax.jit, static_argnames=("interpret",))
def _pair_tile_kernel(x: jax.Array, interpret=None) -> jax.Array:
  """2-D 8-bit ``(M, N) -> (N, M)`` one CTA per tile, on the byte-pair words of :func:`_ring_kernel`
  (no widening: 2 planes of 16-bit words, bytes swapped between them, each plane transposed with the
  16-bit relayout). A tile is ``bw x cw`` words of each plane (:data:`_PAIR_TILE`); the last row / column
  tile is moved back to end at the edge (e.g. 2016 word rows at M = 4032: 31.5 tiles of 64)."""
  w = _byte_pair_words(x)
  r, planes, c = w.shape
  bw, cw = _PAIR_TILE

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((c, planes, r), w.dtype),
      grid=(pl.cdiv(r, bw), pl.cdiv(c, cw)),
      grid_names=("i", "j"),
      scratch_types=dict(x_s=plgpu.SMEM((planes, bw, cw), w.dtype), o_s=plgpu.SMEM((planes, cw, bw), w.dtype),
                         bar=plgpu.Barrier(num_arrivals=planes)),
      compiler_params=NO_AUTO_BARRIERS,  # x_s read and o_s written once, as the one-tile kernel
      interpret=interpret,
  )
  def kernel(w_g, o_g, x_s, o_s, bar):
    i, j = lax.axis_index("i"), lax.axis_index("j")
    rows = pl.ds(jnp.minimum(i * bw, r - bw), bw)
    cols = pl.ds(jnp.minimum(j * cw, c - cw), cw)
    for k in range(planes):
      plgpu.copy_gmem_to_smem(w_g.at[rows, k, cols], x_s.at[k], bar)
    plgpu.barrier_wait(bar)
    v = _swap_pair_bytes(*[plgpu.load(x_s.at[k], layout=plgpu.Layout.WGMMA) for k in range(planes)])
    for k, vk in enumerate(v):
      o_s.at[k].T[...] = plgpu.layout_cast(vk, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    for k in range(planes):
      plgpu.copy_smem_to_gmem(o_s.at[k], o_g.at[cols, k, rows])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _bytes_of_pair_words(kernel(w), x.dtype)


# 2-D 8-bit transposes of up to this many elements run :func:`_smem_transpose_kernel` on a GPU, larger ones the
# kernels above. H200, 2026-11-30 (benchmark runner, CUPTI, cold L2, one call), e4m3, µs, kernels above / smem
# kernel: 4032x576 3.36 / 2.98, 8064x576 4.54 / 4.40, 4032x2048 6.72 / 5.97, 4032x2560 7.94 / 7.17, 4032x3072
# 8.69 / 8.37; slower from 4032x4096 (9.84 / 10.72) and 8064x2048 (9.50 / 9.89), and at every larger shape. These
# smem figures are of its earlier padded SMEM tile with plain loads; its swizzled tile with L2::256B loads, timed
# the same day up to 4032x3072 only, is faster at each of the five shapes (:func:`_smem_transpose_kernel`).
SMEM_TRANSPOSE_MAX_ELEMENTS = 4032 * 3072
# Tiles (bytes, input rows x columns) of the smem kernel: 64x64 below this size (the ring kernel's 8-bit
# threshold), from it 128 along each dimension that is a multiple of 128. Timed above (H200, 2026-11-30): 64x64
# at 4032x576 and 8064x576, 64x128 at 4032x2048, 4032x2560 and 4032x3072.
_SMEM_TRANSPOSE_WIDE_BYTES = 8_000_000


def _use_smem_transpose(x) -> bool:
  """2-D 8-bit arrays of up to :data:`SMEM_TRANSPOSE_MAX_ELEMENTS` take :func:`_smem_transpose_kernel` (on a GPU;
  interpret mode cannot run it)."""
  return x.dtype.itemsize == 1 and x.size <= SMEM_TRANSPOSE_MAX_ELEMENTS


def _smem_transpose_tile(m: int, n: int) -> tuple[int, int]:
  """The CTA tile ``(BR, BC)`` in bytes (input rows, input columns) for an ``(m, n)`` array."""
  wide = m * n >= _SMEM_TRANSPOSE_WIDE_BYTES
  return (128 if wide and m % 128 == 0 else 64), (128 if wide and n % 128 == 0 else 64)


def _log2(v: int) -> int:
  assert v > 0 and v & (v - 1) == 0, v
  return v.bit_length() - 1


def _transpose4(ops, w):
  """Words ``w[j]`` (byte ``k`` = element ``(j, k)`` of a 4x4 byte block) -> the block's transposed words."""
  a_lo, a_hi = ops.prmt(w[0], w[1], 0x5140), ops.prmt(w[0], w[1], 0x7362)  # (w0.0 w1.0 w0.1 w1.1), (.2, .3)
  b_lo, b_hi = ops.prmt(w[2], w[3], 0x5140), ops.prmt(w[2], w[3], 0x7362)
  return [ops.prmt(a_lo, b_lo, 0x5410), ops.prmt(a_lo, b_lo, 0x7632),
          ops.prmt(a_hi, b_hi, 0x5410), ops.prmt(a_hi, b_hi, 0x7632)]


def _smem_row_swizzle(row, tile):
  """The XOR applied to the word indices of row ``row`` of the smem kernel's SMEM tile (``tile``: ``(BR, BC)``).

  XOR-linear in ``row``, so every SMEM access of a thread is its base address XOR a constant
  (:func:`_smem_transpose_program`). The swizzle depends on the tile: each was picked among eight XOR-linear
  candidates (shifts of the row XOR its low bits) by counting the banks of warp 0's accesses, and none of them is
  conflict-free at both the 64x64 and the 64x128 tile. With these, each warp's 32 stores (phase 1) and 32 loads
  (phase 2) hit 32 different banks at the 64x64, 64x128 and 128x128 tiles; the padded tile they replace (4 bytes
  per row) had 2-way conflicts at 64x64 (both phases) and 4-way on the phase-1 stores at 64x128, the wide shapes'
  tile. At 128x64 (not timed) no candidate is conflict-free; this one is 2-way at worst.
  """
  if tile[1] == 64:
    return (row >> 1) & 31
  return ((row >> 2) ^ (row & (2 if tile[0] == 64 else 3))) & 31


def _smem_transpose_program(ops, m, n, bi, bj, tid):
  """One thread's program (a generator; it yields at the CTA barrier) of CTA ``(bi, bj)`` (row tile, column
  tile) of :func:`_smem_transpose_kernel`: ``ops`` gives the memory accesses (byte offsets; ``x`` is ``(m, n)``,
  the output ``(n, m)``, the SMEM tile flat) and byte permutes, on ints (a test's emulator) or lane-level MLIR
  values (the kernel). ``bi, bj, tid`` support ``+ * >> & ^``.

  Phase 1: the lanes run along the input rows' 4-byte columns (coalesced loads); each thread loads ``nb``
  4x4 byte blocks (2 per 64x64 bytes of the tile), transposes them and stores their words into the output tile in
  SMEM: ``BC`` rows of ``BR`` bytes, word ``c`` of row ``R`` at word ``(R * BR / 4) ^ c ^ H(R)``
  (:func:`_smem_row_swizzle`, no padding). A thread's rows and words are its own part XOR a constant (no carries),
  so each of its accesses is its base address XOR a constant. Phase 2, after the barrier: 16-byte chunks of the
  output rows, the lanes along the row, each chunk read as 4 words.
  """
  BR, BC = _smem_transpose_tile(m, n)
  nb = BR * BC // (16 * 128)
  cpr = BC // 4
  bc, brb = tid & (cpr - 1), tid >> _log2(cpr)
  step = 4 * (128 // cpr)  # input rows between a thread's blocks
  xin = (((bi * BR) + (brb * 4)) * n) + ((bj * BC) + (bc * 4))
  row = lambda R: (R * (BR // 4)) ^ _smem_row_swizzle(R, (BR, BC))  # SMEM word of word 0 of the tile's row R
  sbase = (row(bc * 4) ^ brb) * 4  # the thread's rows bc * 4 + k, words brb + s * step / 4
  w = [[ops.gload(xin + (s * step + j) * n) for j in range(4)] for s in range(nb)]
  for s in range(nb):
    for k, o in enumerate(_transpose4(ops, w[s])):
      ops.sts(sbase ^ ((row(k) ^ (s * (step // 4))) * 4), o)
  yield
  cq = BR // 16
  q, r = tid & (cq - 1), tid >> _log2(cq)
  rstep = 128 // cq
  obase = (((bj * BC) + r) * m) + ((bi * BR) + (q * 16))
  lbase = (row(r) ^ (q * 4)) * 4  # the thread's rows r + s * rstep, words q * 4 + e
  for s in range(nb):
    ops.gstore(obase + s * rstep * m, [ops.lds(lbase ^ ((row(s * rstep) ^ e) * 4)) for e in range(4)])


class _Idx:
  """An i32 MLIR value with ``+ * >> & ^`` against ints or other ``_Idx``."""

  def __init__(self, v):
    self.v = v

  @staticmethod
  def _val(o):
    return o.v if isinstance(o, _Idx) else arith.constant(ir.IntegerType.get_signless(32), o)

  def __add__(self, o):
    return self if isinstance(o, int) and o == 0 else _Idx(arith.addi(self.v, self._val(o)))

  __radd__ = __add__

  def __mul__(self, o):
    return self if isinstance(o, int) and o == 1 else _Idx(arith.muli(self.v, self._val(o)))

  __rmul__ = __mul__

  def __rshift__(self, o):
    return self if o == 0 else _Idx(arith.shrui(self.v, self._val(o)))

  def __and__(self, o):
    return _Idx(arith.andi(self.v, self._val(o)))

  def __xor__(self, o):
    return _Idx(arith.xori(self.v, self._val(o)))


class _LaneOps:
  """:func:`_smem_transpose_program`'s memory accesses and byte permutes as lane-level MLIR (inline PTX)."""

  def __init__(self, x_ptr, o_ptr, s_ptr):
    self.x, self.o, self.s = x_ptr, o_ptr, s_ptr
    self.i8, self.i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)

  def _at(self, ptr, off):
    return mgpu.utils.getelementptr(ptr, [off.v if isinstance(off, _Idx) else off], self.i8)

  def gload(self, off):
    # L2::256B: the L2 may fetch the 256 bytes around each access, which the neighbouring 64-byte column tiles
    # share (launched one after the other: Mosaic launches the last grid dimension fastest)
    return mgpu.utils.inline_ptx("ld.global.nc.L2::256B.b32 $0, [$1];", self._at(self.x, off), result_types=self.i32)

  def gstore(self, off, words):
    assert len(words) == 4, words
    mgpu.utils.inline_ptx("st.global.v4.b32 [$0], {$1, $2, $3, $4};", self._at(self.o, off), *words,
                          has_side_effects=True)

  def sts(self, off, word):
    llvm.store(word, self._at(self.s, off), alignment=4)

  def lds(self, off):
    return llvm.load(self.i32, self._at(self.s, off), alignment=4)

  def prmt(self, a, b, sel):
    return mgpu.utils.inline_ptx(f"prmt.b32 $0, $1, $2, {sel:#x};", a, b, result_types=self.i32)


_SPLAT = plgpu.Layout.WG_SPLAT(shape=())


@jax.jit
def _smem_transpose_kernel(x: jax.Array) -> jax.Array:
  """2-D 8-bit ``(M, N) -> (N, M)`` on 32-bit words, one CTA (128 threads) per tile (:func:`_smem_transpose_tile`),
  no TMA: each thread loads 4-byte words (``ld.global.nc.L2::256B``), transposes 4x4 byte blocks in registers with
  8 byte permutes (PTX ``prmt``) and stores them into an SMEM tile without padding, its words XOR-swizzled by row
  (:func:`_smem_row_swizzle`, no bank conflicts); after one barrier the output rows are written in 16-byte chunks
  (:func:`_smem_transpose_program`). Lane-level code (``plgpu.inline_mgpu``): GPU only, no interpret mode.

  H200, 2026-11-30 (CUPTI, cold L2, median of 30, two passes), e4m3, µs, padded SMEM tile and plain loads / this
  kernel: 4032x576 2.94-2.95 / 2.83-2.85 (TileKernels 3.16), 8064x576 4.38-4.42 / 4.21-4.26, 4032x2048 5.82 / 5.79,
  4032x2560 7.22-7.23 / 6.69-6.75, 4032x3072 8.38-8.43 / 8.26-8.29. Benchmark runner (one call): 4032x576 2.85,
  8064x576 4.13, 4032x2048 5.60, 4032x2560 6.67, 4032x3072 8.18.
  """
  m, n = x.shape
  BR, BC = _smem_transpose_tile(m, n)

  @functools.partial(
      plgpu.kernel,
      out_type=jax.ShapeDtypeStruct((n, m), x.dtype),
      grid=(m // BR, n // BC),
      grid_names=("i", "j"),
      scratch_types=[plgpu.SMEM((BC * BR,), jnp.uint8)],
      compiler_params=NO_AUTO_BARRIERS,
  )
  def kernel(x_g, o_g, o_s):
    refs = (x_g, o_g, o_s)

    @plgpu.inline_mgpu(arg_types=(tuple(plgpu.RefType() for _ in refs), _SPLAT, _SPLAT))
    def body(_, refs, bi, bj):
      ops = _LaneOps(*[mgpu.utils.memref_ptr(r) for r in refs])
      i32 = ir.IntegerType.get_signless(32)
      tid = _Idx(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)))
      for _ in _smem_transpose_program(ops, m, n, _Idx(bi.registers.item()), _Idx(bj.registers.item()), tid):
        mgpu.utils.warpgroup_barrier()

    body(refs, lax.axis_index("i"), lax.axis_index("j"))

  return kernel(x)


def _check(name: str, x, ndim: int):
  x = _checks.as_array(name, x)
  _checks.check_rank(name, x, ndim)
  if x.dtype.itemsize not in (1, 2, 4):
    raise ValueError(f"{name} must have a 1-, 2- or 4-byte dtype, got {x.dtype}")
  _checks.check_multiple(name, x, -2, ALIGNMENT)
  _checks.check_multiple(name, x, -1, ALIGNMENT)
  return x


def _unsupported(x) -> str | None:
  """Why the kernels cannot transpose ``x``, or None."""
  if x.dtype == jnp.bool_:
    return "bool data (no 1-bit element type in Mosaic GPU; transpose x.view(jnp.uint8) for the kernel)"
  return None


def batched_transpose(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """Swaps the last two axes: ``(B, M, N) -> (B, N, M)``, bit-exact.

  Args:
    x: ``(B, M, N)`` array (or nested list) of any 1-, 2- or 4-byte dtype (float8_e4m3fn, bfloat16,
      float32, ints, bool, ...); ``M`` and ``N`` multiples of 64.
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``
      (see :mod:`jaxkern._config`).

  Returns:
    ``(B, N, M)`` array with ``out[b, j, i] = x[b, i, j]``.

  Raises:
    ValueError: ``x`` of another rank or itemsize, or ``M`` / ``N`` not multiples of 64.
    KernelUnavailableError: ``implementation="pallas"`` / ``"interpret"`` with bool data.

  XLA instead of a kernel: bool data and zero-size arrays (``"auto"`` everywhere else runs the
  kernel: it is at least as fast as XLA's transpose on every benchmark shape but ``(4032 | 8064, 576)``
  bf16, 0.97-0.99x, see benchmarks/NOTES.md).

  Differentiable (custom_vjp): the cotangent is transposed back by the same implementation; integer data has
  no derivative.
  """
  x = _check("x", x, 3)
  return _differentiable(_batched_transpose, x, _config.get_implementation(implementation))


def _batched_transpose(x, implementation: str):
  return _dispatch.run(
      "batched_transpose", implementation,
      kernel=lambda interpret: _batched_transpose_kernel(x, interpret=_config.mosaic_interpret(interpret)),
      xla=lambda: ref.batched_transpose(x), unsupported=_unsupported(x), empty=x.size == 0)


def transpose(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """2-D transpose ``(M, N) -> (N, M)``, bit-exact; arguments, errors and XLA cases as
  :func:`batched_transpose` (with ``x`` of rank 2).

  On a GPU, 8-bit arrays of up to 4032x3072 elements (:data:`SMEM_TRANSPOSE_MAX_ELEMENTS`) run a kernel that
  transposes 4x4 byte blocks in registers and writes them through a swizzled SMEM tile (no TMA); larger 8-bit
  arrays and 16-bit arrays of 12-64 MiB run the persistent ring kernel. Interpret mode cannot run the first
  kernel: there 8-bit arrays from 8 MB run the ring kernel. 8-bit arrays that neither takes (N below 256 for
  the ring kernel) run the one-tile kernel on byte pairs (no widening) if they have at least 128 rows; every
  other array the one-tile kernel (module docstring).

  Differentiable (custom_vjp): the cotangent is transposed back by the same implementation; integer data has
  no derivative.
  """
  x = _check("x", x, 2)
  return _differentiable(_transpose, x, _config.get_implementation(implementation))


def _transpose(x, implementation: str):
  def kernel(interpret):
    if not interpret and _use_smem_transpose(x):
      return _smem_transpose_kernel(x)
    if _use_ring(x):
      return _ring_kernel(x, interpret=_config.mosaic_interpret(interpret))
    if _use_pair_tiles(x):
      return _pair_tile_kernel(x, interpret=_config.mosaic_interpret(interpret))
    return _batched_transpose_kernel(x[None], interpret=_config.mosaic_interpret(interpret))[0]

  return _dispatch.run("transpose", implementation, kernel=kernel, xla=lambda: ref.transpose(x),
                       unsupported=_unsupported(x), empty=x.size == 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 2))
def _transposed(op, x, implementation: str):
  return op(x, implementation)


def _transposed_fwd(op, x, implementation):
  return op(x, implementation), None


def _transposed_bwd(op, implementation, _, dy):
  return (op(dy, implementation),)  # the cotangent of a transpose is transposed back, by the same path


_transposed.defvjp(_transposed_fwd, _transposed_bwd)


def _differentiable(op, x, implementation: str):
  """``op(x, implementation)``, differentiable for floating-point ``x`` (integer data has no derivative)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return _transposed(op, x, implementation)
  return op(x, implementation)

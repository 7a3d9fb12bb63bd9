"""Fused SwiGLU forward and per-channel e4m3 cast (docs/quant.md, "Fused SwiGLU").

Mosaic GPU kernel (:func:`_kernel`): two warpgroups (256 threads) per CTA, each owning its own rows of the CTA's
columns (:func:`_tile`): 64 columns and 64 rows per warpgroup (a 128 x 64 CTA: at npt 32 two whole groups per
warpgroup, at npt 128 the one group split over the two), except at npt 32 without the transpose: 32 rows per
warpgroup (one group each), or, where :data:`_WIDE_COLS` divides ``h``, 256 columns and 16 rows per warpgroup (one
32-row group split over the two), 32 rows per warpgroup (one group each) where also ``h >=``
:data:`_WIDE_ROWS32_MIN_H`. Each warpgroup TMA-loads its gate tile ``x[rows, c·j : c·j + c]`` and value tile
``x[rows, h + c·j : h + c·j + c]`` into SMEM (the whole tile on one barrier at npt 32 with 64 columns; 32-row chunks
at npt 128 and 8-row steps with 256 columns on a barrier each, so that a chunk's activation starts when its rows
arrive) and reads both in the rows of :func:`jaxkern._layouts.row_layout`, so each value meets its partner in one
thread, which computes the float32 activation (optional clamp, ``e = exp(-l)``, ``d = 1 + e``, ``g = l / d``
correctly rounded, with and without the transpose, by :func:`jaxkern.quant._swiglu.guarded_div` (div.rn.f32's
Newton fast path with one range check and branch per register vector, as the per-token kernel; div.rn.f32's bits;
:func:`jaxkern._ieee.newton_div` in interpret mode), ``act = g · r``), rounds it to bf16 and stores it over the gate
tile in SMEM (with the transpose 128-byte swizzled, so the WGMMA-layout reads below are free of bank conflicts; each
thread overwrites only what it read), keeping the elementwise maximum of ``|act|`` of each group in its registers.

Column maxima and scale factors: each thread writes its elementwise maxima to SMEM (``(warpgroup, group, layout
rows, columns)``), then one thread per column reduces them; where a group spans both warpgroups (npt 128, and the
256-column tiles of 16 rows per warpgroup) it reads both warpgroups' maxima after an mbarrier that every thread of
both arrives at (both compute the scale factors, warpgroup 0 stores them). Not Mosaic GPU's reductions: a cross-warp
reduction goes through the kernel's one SMEM reduction scratch (``reduction_scratch_bytes``), the same address for
both warpgroups, and could not merge across them anyway. The scale factors follow
:func:`jaxkern.quant.per_channel_cast_and_transpose`, the divisions by PTX ``div.rn.f32`` with the e4m3 maximum a
constant in registers (:func:`_sf_div`; in interpret mode :func:`jaxkern._ieee.exact_div`, the same bits, with the
maximum a one-element kernel operand). The second pass reads
the bf16 activation back from SMEM and casts it: without the transpose in steps of :data:`_CAST_VALUES` values per
thread in the row layout, stored straight to GMEM; otherwise the warpgroup's 64-row block in the WGMMA layout,
re-laid out to WGMMA_TRANSPOSED as bf16 (one shuffle per two values), cast into SMEM and TMA-stored as ``(h, M)``. No
automatic warpgroup barriers: a thread overwrites only SMEM it read itself, ``commit_smem()`` separates every SMEM
write from other threads' reads, and the one exchange across warpgroups waits on its mbarrier.

NVIDIA H200 (CUPTI, cold L2, 2026-11-29), µs, against one warpgroup per CTA before (TileKernels in brackets), h=576:
npt 128 M=4096 without the transpose 9.55 -> 8.37 (8.33), M=8064 12.62 -> 11.50 (11.20) / transposed 13.01 -> 12.19
(12.32); npt 32 transposed M=4096 9.30 -> 9.10 (9.67), M=8064 13.12 -> 12.34 (12.26), without the transpose M=4096
8.93 -> 7.33 (8.46), M=8064 13.01 -> 11.63 (11.59). npt 32 transposed M=8064 h=2048 34.82 -> 29.81 (34.05), h=7168
108.43 -> 90.32 (100.64). npt 32 without the transpose, 256 columns: M=4096 h=2048 17.18 -> 16.40 (16.44), M=8064
h=7168 87.22 -> 84.83 (81.11), then 82.94 with 32 rows per warpgroup (from h = :data:`_WIDE_ROWS32_MIN_H` on). ncu
of the one-warpgroup kernel (npt 128, M=8064 h=576 without the transpose): 14.8 achieved warps per SM, no eligible
warp in 54% of cycles (latency-bound); TileKernels runs 256 threads per CTA.
The swish quotient by :func:`jaxkern.quant._swiglu.guarded_div` instead of PTX ``div.rn.f32`` on every value
(H200, CUPTI, cold L2, 2026-11-30, µs, bit-exact on the GPU): without the transpose npt 32 M=8064 h=7168 82.78 ->
78.56, M=4096 h=7168 44.93 -> 43.38, M=4096 h=2048 16.42 -> 15.70, M=8064 h=576 11.65 -> 11.39; npt 128 M=4096
h=576 8.35 -> 7.78, M=8064 h=576 11.42 -> 10.83, M=4096 h=7168 45.73 -> 44.51, M=8064 h=7168 85.54 -> 84.29 (no
shape slower by more than 0.3%); with the transpose (another call) npt 32 M=8064 h=7168 90.22 -> 89.71, M=8064
h=576 12.27 -> 11.55, npt 128 M=8064 h=7168 91.74 -> 87.25, M=4096 h=576 9.02 -> 8.61.
Earlier steps (H200, 2026-11-29, one warpgroup per CTA): 64-row CTAs at npt 32 instead of 128 rows (M=8064 h=576
15.5 / 16.1 -> 12.7 / 13.5 without / with the transpose, h=7168 transposed 116.3 -> 108.6), the 32-row chunks on a
barrier each at npt 128 (M=8064 h=576 13.3 -> 12.7 without the transpose), 32 x 256 tiles without the transpose at
npt 32 (h=7168 105.5 -> 86.5; 32 x 128: 86.8), and the scale-factor divisions by ``div.rn.f32`` instead of
:func:`jaxkern._ieee.exact_div` (a search around an approximate quotient, with the e4m3 maximum an ``(n,)`` operand
that XLA turned into a broadcast kernel of 0.7-1.0 µs before every call: npt 32 h=7168 122.7 -> 115.4 transposed).
The kernel before these (the per-channel cast's with a SwiGLU prologue, 128-column tiles) took 184.0 / 150.0 µs at
npt 32 h=7168 (H200, 2026-11-28). Measured slower on the same card: 128-column tiles with 64 rows, loads straight from
GMEM instead of TMA (144.4 vs 128.6 µs without the transpose, both with the activation kept in registers), the
transpose on the e4m3 bytes after the cast (134.8 vs 122.7), automatic warpgroup barriers, and keeping the activation
in registers between the passes without the transpose (128.6 vs 111.2). A 64-byte swizzle of the e4m3 output tiles
measured a tie; so did, with 64-row CTAs at npt 32, a barrier per 32-row chunk with each group cast and stored before
the next is read (2026-11-29, within 3.5% either way).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config, _dispatch, _ieee
from jaxkern._layouts import NO_AUTO_BARRIERS, row_layout
from jaxkern.quant import _per_channel_cast as pcc
from jaxkern.quant import _validate as validate
from jaxkern.quant._swiglu import _SWISH_FAST_LIMIT, _silu_times, guarded_div
from jaxkern.quant._tiling import BM
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor

_WARPGROUPS = 2  # per CTA (TileKernels' 256 threads; figures in the module docstring)
_COLS = 64  # columns per CTA (128 measured slower on an H200, 2026-11-28; module docstring)
# Columns per CTA without the transpose at npt 32 where they divide h (TileKernels' tile there), 16 rows per warpgroup
# (one 32-row group over both), each 8-row step on a TMA barrier of its own. H200, CUPTI, cold L2, 2026-11-29, µs,
# TileKernels in brackets: M=8064 h=7168 84.8 (81.1) against 87.2 with one warpgroup per 32 x 256 CTA, M=4096
# h=2048 16.4 (16.4) against 17.2. Earlier that day, one warpgroup per CTA: h=7168 32 x 256 86.5, 32 x 128 86.8,
# 128 x 64 105.5; one barrier per tile instead of 8-row steps: M=4096 h=2048 18.4 against 17.4.
_WIDE_COLS = 256
_WIDE_ROWS = 16  # rows per warpgroup with :data:`_WIDE_COLS` columns below :data:`_WIDE_ROWS32_MIN_H`
# From this h on, 32 rows per warpgroup with :data:`_WIDE_COLS` columns (a 64 x 256 CTA, one whole 32-row group per
# warpgroup, no mbarrier between the two). H200, CUPTI, cold L2, 2026-11-29, µs, 16 -> 32 rows per warpgroup
# (TileKernels in brackets), bit-exact against the 16-row form and the reference on the GPU: M=8064 h=7168 84.90 ->
# 82.94 (81.11; another run 85.26 -> 83.39), M=4096 h=7168 45.31 -> 44.98; slower at h=2048: M=4096 16.46 -> 17.10,
# M=8064 27.92 -> 28.18. The hidden sizes between 2048 and 7168 were not timed. In the same runs (M=8064 h=7168,
# M=4096 h=7168, M=8064 h=2048) no faster than the 16-row form: the e4m3 rows cast into SMEM and TMA-stored, and CTAs
# looping over up to 4 consecutive 32 x 256 tiles with two SMEM slots (the next tile's TMA loads issued while the
# current one is computed).
_WIDE_ROWS32_MIN_H = 4096
_WIDE_STEP_ROWS = 8  # rows per TMA barrier with :data:`_WIDE_COLS` columns
_CHUNK = 32  # rows per TMA barrier at npt 128
_CAST_VALUES = 16  # values per thread in each step of the cast without the transpose


def _act_rows(load, clamp, layout, interpret):
  """The SwiGLU activation (:func:`jaxkern.quant._swiglu._silu_times`) of the gate and value rows
  that ``load(0)`` / ``load(1)`` return in ``layout``, rounded to bf16: the swish quotient by
  :func:`jaxkern.quant._swiglu.guarded_div` (module docstring), in interpret mode :func:`jaxkern._ieee.newton_div`
  (the same bits)."""
  left, right = (load(half).astype(jnp.float32) for half in (0, 1))
  div = _ieee.newton_div if interpret else guarded_div(layout, left.shape, _SWISH_FAST_LIMIT)
  return _silu_times(left, right, clamp, False, div)[0].astype(jnp.bfloat16)


def _inv_rows(inv_s, npt, c, layout):
  """``(64, c)`` float32 ``sf_inv`` of a warpgroup's 64 rows in ``layout`` (WGMMA or WGMMA_TRANSPOSED, whose warps
  both own 16-row strips) from its ``inv_s`` ``(groups, c)``: one group (of 128), or two of 32 (warps 0-1 / 2-3)."""
  col = layout.reduce(0)
  if npt == 128:
    return jnp.broadcast_to(plgpu.load(inv_s.at[0], layout=col)[None, :], (BM, c))
  top = plgpu.broadcasted_iota(jnp.int32, (BM, c), 0, layout=layout) < 32
  return jnp.where(top, plgpu.load(inv_s.at[0], layout=col)[None, :], plgpu.load(inv_s.at[1], layout=col)[None, :])


def _sf_div(layout, n, interpret):
  """The correctly rounded division of ``(n,)`` scale-factor operands held in ``layout``: PTX ``div.rn.f32``, in
  interpret mode (no PTX there) :func:`jaxkern._ieee.exact_div` (the same bits)."""
  return _ieee.exact_div if interpret else _ieee.mosaic_ptx("div.rn.f32", layout, (n,))


def _max_inputs(interpret):
  """The kernel operands holding the e4m3 maximum: none on the GPU (a constant in registers, no XLA kernel before
  the call); in interpret mode the one-element operand of :func:`jaxkern.quant._per_channel_cast._max_operand`
  (:func:`jaxkern._ieee.exact_div` needs a divisor that XLA cannot fold)."""
  return (pcc._max_operand(),) if interpret else ()


def _max_value(c_g, n, layout):
  """The e4m3 maximum for :func:`jaxkern.reference.quant.scale_factors`: the float when there is no operand, else
  an ``(n,)`` vector in ``layout`` from the one-element operand ``c_g``."""
  return ref.FP8_MAX if c_g is None else pcc._max_vector(c_g, n, layout)


def _max_of(parts, interpret):
  """Elementwise NaN-propagating maximum of non-negative bf16 arrays of one shape (bit patterns compared in
  interpret mode, as :func:`jaxkern.quant._per_channel_cast._column_max`)."""
  if not interpret:
    return functools.reduce(jnp.maximum, parts)
  ints = [lax.bitcast_convert_type(p, jnp.int16) for p in parts]
  return lax.bitcast_convert_type(functools.reduce(jnp.maximum, ints), jnp.bfloat16)


def _tile(h: int, npt: int, transpose_out: bool) -> tuple[int, int, int]:
  """``(rows per warpgroup, columns per CTA, rows per TMA barrier)`` of :func:`_kernel`.

  Without the transpose at npt 32, where :data:`_WIDE_COLS` divides ``h``: 16 rows x 256 columns in 8-row steps
  (32 rows from ``h =`` :data:`_WIDE_ROWS32_MIN_H` on).
  Otherwise :data:`_COLS` columns and 64 rows per warpgroup, except 32 (one group) at npt 32 without the transpose:
  H200, CUPTI, cold L2, 2026-11-29, h=576, µs (TileKernels in brackets), M=4096 7.33 against 8.64 with 64 rows
  (8.46), M=8064 11.63 against 11.89 (11.59). At npt 128 each 32-row chunk on a barrier of its own (the activation
  of a chunk starts when its rows arrive; with one warpgroup per CTA, M=8064 h=576 12.7 / 13.1 µs without / with
  the transpose against 13.3 / 13.8 for the whole tile), at npt 32 the whole tile (a barrier per chunk measured
  within 3.5% either way there)."""
  if npt == 32 and not transpose_out and h % _WIDE_COLS == 0:
    return (2 * _WIDE_ROWS if h >= _WIDE_ROWS32_MIN_H else _WIDE_ROWS), _WIDE_COLS, _WIDE_STEP_ROWS
  rows = 32 if npt == 32 and not transpose_out else BM
  return rows, _COLS, _CHUNK if npt == 128 else rows


def _stage_rows(x_g, x_s, y_s, bars, bar0, row0, col0, k: int, rows: int) -> None:
  """Starts the TMA copies of the gate and value tiles whose first row is ``row0`` and first (gate) column ``col0``
  (``x_s``'s shape each, the halves ``k`` columns apart) into ``x_s`` / ``y_s`` in chunks of ``rows`` rows, chunk
  ``q`` of both arriving on ``bars.at[bar0 + q]``."""
  r, c = x_s.shape
  for q in range(r // rows):
    for half, t in enumerate((x_s, y_s)):
      plgpu.copy_gmem_to_smem(x_g.at[pl.ds(row0 + q * rows, rows), pl.ds(half * k + col0, c)],
                              t.at[pl.ds(q * rows, rows)], bars.at[bar0 + q])


@functools.partial(jax.jit, static_argnames=("tile", "npt", "round_sf", "transpose_out", "clamp", "interpret"))
def _kernel(x, *, tile, npt, round_sf, transpose_out, clamp, interpret):
  """``x`` bf16 ``(M, 2h)`` -> ``(data (h, M) e4m3, or (M, h) without transpose_out, sf (M/npt, h) float32)``.

  Two warpgroups per CTA of ``2·wg_rows`` rows and ``c`` columns, ``tile = (wg_rows, c, barrier_rows)`` (the op
  passes :func:`_tile` of the shape), each owning ``wg_rows`` rows: its own TMA loads (``barrier_rows`` rows per
  barrier), the activation in steps of the row layout's rows (one vector per thread), stored over the gate tile, its
  column maxima kept per thread (elementwise) and written to SMEM, then reduced one column per thread; where a group
  spans both warpgroups (``wg_rows < npt``) after an mbarrier that every thread of both arrives at (both compute the
  scale factors, warpgroup 0 stores them). Then the cast of the warpgroup's rows: without the transpose straight to
  GMEM; with it the 64-row block in the WGMMA layout, re-laid out transposed, cast into SMEM and TMA-stored."""
  m, k = x.shape[0], x.shape[1] // 2
  wg_rows, c, barrier_rows = tile
  cta_rows = _WARPGROUPS * wg_rows
  split_group = wg_rows < npt  # one group over both warpgroups
  assert (cta_rows == npt) if split_group else wg_rows % npt == 0
  assert not transpose_out or wg_rows == BM
  wg_groups = 1 if split_group else wg_rows // npt  # groups per warpgroup
  group_rows = wg_rows if split_group else npt  # rows of a group in one warpgroup
  lay, lay_rows = row_layout(c, x.dtype.itemsize)
  cast_rows = _CAST_VALUES * 128 // c
  per_thread = pcc._per_thread(c)
  # conflict-free WGMMA reads
  act_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if transpose_out else ()
  n_wg = _WARPGROUPS
  scratch = dict(x_s=plgpu.SMEM((n_wg, wg_rows, c), x.dtype, transforms=act_transforms),
                 y_s=plgpu.SMEM((n_wg, wg_rows, c), x.dtype),
                 p_s=plgpu.SMEM((n_wg, wg_groups, lay_rows, c), jnp.bfloat16),  # per-thread maxima
                 inv_s=plgpu.SMEM((n_wg, wg_groups, c), jnp.float32),
                 bar=plgpu.Barrier(num_arrivals=2, num_barriers=n_wg * (wg_rows // barrier_rows)))
  if split_group:
    scratch["merged"] = plgpu.Barrier(num_arrivals=n_wg)
  if transpose_out:
    out_type = jax.ShapeDtypeStruct((k, m), jnp.float8_e4m3fn)
    scratch["o_s"] = plgpu.SMEM((n_wg, c, BM), jnp.float8_e4m3fn)
  else:
    out_type = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
  interpret = _config.mosaic_interpret(interpret)

  @functools.partial(
      plgpu.kernel, grid=(k // c, m // cta_rows), grid_names=("j", "i"), num_threads=n_wg, thread_name="wg",
      interpret=interpret, out_type=(out_type, jax.ShapeDtypeStruct((m // npt, k), jnp.float32)),
      scratch_types=scratch, compiler_params=NO_AUTO_BARRIERS)
  def kernel(x_g, *gmem, x_s, y_s, p_s, inv_s, bar, merged=None, o_s=None):
    c_g, o_g, sf_g = gmem if len(gmem) == 3 else (None, *gmem)
    i, j, w = lax.axis_index("i"), lax.axis_index("j"), lax.axis_index("wg")
    cols = pl.ds(j * c, c)
    row0 = i * cta_rows + w * wg_rows  # this warpgroup's first row
    xw, yw, wg_bars = x_s.at[w], y_s.at[w], wg_rows // barrier_rows
    _stage_rows(x_g, xw, yw, bar, w * wg_bars, row0, j * c, k, barrier_rows)
    maxv = _max_value(c_g, c, per_thread)

    for g in range(wg_groups):  # activation, stored over the gate rows this thread read; per-thread maxima
      part = None
      for r0 in range(g * group_rows, (g + 1) * group_rows, lay_rows):
        if r0 % barrier_rows == 0:  # the first rows on this barrier
          plgpu.barrier_wait(bar.at[w * wg_bars + r0 // barrier_rows])
        act = _act_rows(lambda half, r0=r0: plgpu.load((xw, yw)[half].at[pl.ds(r0, lay_rows)], layout=lay), clamp,
                        lay, interpret)
        xw[pl.ds(r0, lay_rows)] = act
        part = jnp.abs(act) if part is None else _max_of([part, jnp.abs(act)], interpret)
      p_s.at[w, g][...] = part
    plgpu.commit_smem()
    if split_group:  # the other warpgroup's maxima of the group too
      plgpu.barrier_arrive(merged)
      plgpu.barrier_wait(merged)
    for g in range(wg_groups):  # one column per thread
      sources = [p_s.at[v, 0] for v in range(n_wg)] if split_group else [p_s.at[w, g]]
      amax = _max_of([plgpu.load(s.at[p], layout=per_thread) for s in sources for p in range(lay_rows)], interpret)
      sf, inv = ref.scale_factors(amax.astype(jnp.float32), maxv, "e4m3", round_sf,
                                  div=_sf_div(per_thread, c, interpret))
      if split_group:
        @pl.when(w == 0)
        def _():
          sf_g[i, cols] = sf
      else:
        sf_g[i * (cta_rows // npt) + w * wg_groups + g, cols] = sf
      inv_s.at[w, g][...] = inv
    plgpu.commit_smem()
    if transpose_out:
      v = plgpu.layout_cast(plgpu.load(xw, layout=plgpu.Layout.WGMMA), plgpu.Layout.WGMMA_TRANSPOSED)
      inv = _inv_rows(inv_s.at[w], npt, c, plgpu.Layout.WGMMA_TRANSPOSED)
      o_s.at[w].T[...] = pcc._e4m3(v.astype(jnp.float32) * inv, interpret)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s.at[w], o_g.at[cols, pl.ds(row0, BM)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    else:  # row steps from SMEM straight to GMEM
      for g in range(wg_groups):
        inv = plgpu.load(inv_s.at[w, g], layout=lay.reduce(0), optimized=False)[None, :]
        for h in range(g * group_rows, (g + 1) * group_rows, cast_rows):
          v = plgpu.load(xw.at[pl.ds(h, cast_rows)], layout=lay)
          o_g[pl.ds(row0 + h, cast_rows), cols] = pcc._e4m3(v.astype(jnp.float32) * inv, interpret)

  return kernel(x, *_max_inputs(interpret))


def _check(x, fmt, num_per_tokens):
  x = _checks.as_array("x", x)
  validate.check_fmt(fmt, ("e4m3",))
  if num_per_tokens not in (32, 128):
    raise ValueError(f"num_per_tokens must be 32 or 128, got {num_per_tokens}")
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16,))
  _checks.check_multiple("x", x, 0, 128)
  if x.shape[1] % 128:
    raise ValueError(f"x must have 2h columns with h % 64 == 0, got x.shape {tuple(x.shape)}")
  return x


def swiglu_forward_and_per_channel_cast_and_transpose(x: jax.typing.ArrayLike, fmt: str, num_per_tokens: int, *,
                                                      round_sf: bool = False, without_transpose: bool = False,
                                                      swiglu_clamp_value: float | None = None,
                                                      implementation: str | None = None) -> QuantTensor:
  """SwiGLU forward of ``x = [left | right]``, rounded to bf16, fused with a per-channel e4m3 cast whose data come
  back transposed.

  Per element (float32, each step one IEEE rounding): with a clamp ``C``, ``l = min(left, C)``,
  ``r = clip(right, -C, C)``; ``act = (l / (1 + exp(-l))) · r``; ``b = bf16(act)`` (round to nearest even). Then
  one scale per column and block of ``num_per_tokens`` rows, as :func:`jaxkern.quant.per_channel_cast_and_transpose`
  of ``b``: ``sf = max(amax, 1e-4) / 448`` (or its power of two up with ``round_sf``), ``data = e4m3(b · sf_inv)``.

  Args:
    x: ``(M, 2h)`` bfloat16, ``M % 128 == 0``, ``h % 64 == 0``; ``left = x[:, :h]`` (gate),
      ``right = x[:, h:]`` (value).
    fmt: ``"e4m3"``.
    num_per_tokens: 32 or 128 (rows per scale).
    round_sf: power-of-two scales (``2^ceil(log2(amax/448))``).
    without_transpose: return the data ``(M, h)`` instead of ``(h, M)``.
    swiglu_clamp_value: the clamp ``C`` (a float, taken as float32) or None. The clamp is applied in float32
      (upstream clamps the bf16 inputs; the same for every ``C`` exactly representable in bf16, such as the tested
      10.0 and 0.5).
    implementation: ``"auto"`` (default), ``"pallas"``, ``"interpret"``, ``"xla"`` or ``"reference"``.

  Returns:
    ``QuantTensor(data (h, M) float8_e4m3fn, or (M, h) with without_transpose, sf (M/num_per_tokens, h) float32)``
    (sf row-major, never transposed).

  Raises:
    ValueError (naming the argument): another rank or dtype (float32 included), ``M % 128 != 0``,
      ``h % 64 != 0``, ``fmt != "e4m3"``, ``num_per_tokens`` not 32 / 128, a non-array ``x``.

  Mosaic GPU kernel (:mod:`jaxkern.quant._swiglu_per_channel`): two warpgroups (256 threads) per CTA of 128 rows x
  64 columns (64 x 64 at npt 32 without the transpose; 32 x 256 there where 256 divides ``h``, 64 x 256 where also
  ``h >= 4096``), each warpgroup with its own rows; a group's column maxima split over both warpgroups are merged
  through SMEM after an mbarrier. XLA (the reference) instead of the kernel: only zero-size arrays (``M = 0`` gives
  data ``(h, 0)`` / ``(0, h)`` and sf ``(0, h)``).

  Numerics: bit-identical to :func:`jaxkern.reference.quant.swiglu_forward_and_per_channel_cast_and_transpose` run on
  the same backend (``exp`` differs between XLA's CPU and CUDA's ``expf``, which the GPU kernel and XLA on GPU
  share). Non-finite values (inputs, or products that overflow) are outside the contract.

  Differentiation: not differentiable; ``jax.grad`` through it raises :class:`jaxkern.NotDifferentiableError`.
  """
  x = validate.guard("swiglu_forward_and_per_channel_cast_and_transpose", _check(x, fmt, num_per_tokens))
  clamp = None if swiglu_clamp_value is None else float(np.float32(swiglu_clamp_value))

  def kernel(interpret):
    transpose_out = not without_transpose
    return QuantTensor(*_kernel(x, tile=_tile(x.shape[1] // 2, num_per_tokens, transpose_out), npt=num_per_tokens,
                                round_sf=round_sf, transpose_out=transpose_out, clamp=clamp, interpret=interpret))

  def reference():
    return ref.swiglu_forward_and_per_channel_cast_and_transpose(
        x, fmt, num_per_tokens, round_sf=round_sf, without_transpose=without_transpose, swiglu_clamp_value=clamp)

  return _dispatch.run("swiglu_forward_and_per_channel_cast_and_transpose", implementation, kernel=kernel,
                       xla=reference, empty=x.size == 0)

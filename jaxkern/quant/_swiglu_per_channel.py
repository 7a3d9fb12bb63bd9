"""Fused SwiGLU forward and per-channel e4m3 cast (docs/quant.md, "Fused SwiGLU").

Mosaic GPU kernel (:func:`_kernel`), one warpgroup per CTA of 64 columns and :data:`_ROWS` rows (64 at
``num_per_tokens`` 32: two groups; 128 at 128: one group). The gate tile ``x[rows, 64j:64j+64]`` and the value tile
``x[rows, h+64j:h+64j+64]`` are TMA-loaded into SMEM (:func:`_rows_per_barrier`: at npt 32 the whole tile on one
barrier, at npt 128 in 32-row chunks on a barrier each, so that a chunk's activation starts when its rows arrive) and
read in 32-row chunks in the same :func:`jaxkern._layouts.row_layout`, so each value meets its partner in one thread,
which computes the float32 activation (optional clamp, ``e = exp(-l)``, ``d = 1 + e``, ``g = l / d`` correctly rounded
by PTX ``div.rn.f32`` (:func:`jaxkern.quant._swiglu.rn_div`; :func:`jaxkern._ieee.newton_div` in interpret mode),
``act = g · r``), rounds it to bf16 and stores it over the gate tile in SMEM (128-byte swizzled, so the WGMMA-layout
reads below are free of bank conflicts; each thread overwrites only what it read). The column maxima of each group of
``num_per_tokens`` rows (elementwise over the chunks, then one reduction) give the scale factors, computed one column
per thread through SMEM as :func:`jaxkern.quant.per_channel_cast_and_transpose` computes them, the divisions by PTX
``div.rn.f32`` with the e4m3 maximum a constant in registers (:func:`_sf_div`; in interpret mode
:func:`jaxkern._ieee.exact_div`, the same bits, with the maximum a one-element kernel operand). The second pass reads
the bf16 activation back from SMEM and casts it: with ``without_transpose`` in 32-row chunks in the row layout, stored
straight to GMEM; otherwise in 64-row blocks in the WGMMA layout, re-laid out to WGMMA_TRANSPOSED as bf16 (one shuffle
per two values), cast into SMEM and TMA-stored as ``(h, M)``. No automatic warpgroup barriers: a thread overwrites only
SMEM it read itself, and ``commit_smem()`` separates every SMEM write from other threads' reads. Without the transpose
at npt 32, where :data:`_WIDE_COLS` divides ``h``, :func:`_kernel_wide` instead: 32-row x 256-column tiles, one group
per CTA, TMA-loaded in 8-row steps on a barrier each, whose column maxima are in-thread up to one cross-warp step.

NVIDIA H200 (CUPTI, cold L2, 2026-11-29), µs (TileKernels in brackets), M=8064: npt32 h=7168 108.6 transposed (100.6)
and 87.6 without the transpose (81.1); npt32 h=2048 transposed 34.8 (34.1); h=576 npt32 13.5 / 12.7 (12.3 / 11.6)
transposed / without the transpose, npt128 13.1 / 12.7 (12.3 / 11.2); M=4096: h=576 npt32 9.3 / 8.9 (9.7 / 8.5), npt128
without the transpose 9.2 (8.3); h=2048 npt32 without the transpose 17.4 (16.4). Before the 64-row CTAs at npt 32 and
the chunked staging (:data:`_ROWS`, :func:`_rows_per_barrier`): npt32 h=7168 116.3 transposed, h=576 16.1 / 15.5; npt128
h=7168 90.4 (105.6) / 87.4 (85.3) (not re-measured since). The scale-factor divisions by :func:`jaxkern._ieee.exact_div`
before (a search around an approximate quotient, with the e4m3 maximum an ``(n,)`` operand that XLA turned into a
broadcast kernel of 0.7-1.0 µs before every call) took 122.7 / 112.9 at npt32 h=7168 and 93.7 / 90.3 at npt128; the
128-row x 64-column kernel without the transpose at npt32 105.5 against 86.5 for the 32 x 256 tiles (32 x 128: 86.8).
ncu of that earlier kernel at npt32 h=7168 without the transpose: 112.4 µs, DRAM 53.8%, SM busy 64%, IPC 2.65, 72.7 M
instructions, 71 registers, 8.76 warp cycles per issued instruction. Earlier (H200, 2026-11-28): npt128 h=2048 32.3
(35.5) / 34.3 (30.2), npt32 h=2048 transposed 41.7 (34.0); the previous kernel (the per-channel cast's with a SwiGLU
prologue, 128-column tiles) took 184.0 / 150.0 µs at npt32 h=7168. Measured slower on the same card: 128-column tiles in
:func:`_kernel` (everywhere), loads straight from GMEM instead of TMA (144.4 vs 128.6 µs without the transpose, both
with the activation kept in registers), the transpose on the e4m3 bytes after the cast (134.8 vs 122.7), automatic
warpgroup barriers, and keeping the activation in registers between the passes without the transpose (128.6 vs 111.2). A
64-byte swizzle of the e4m3 output tiles measured a tie; so did, with 64-row CTAs at npt 32, a barrier per 32-row chunk
with each group cast and stored before the next is read (2026-11-29, within 3.5% either way).
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
from jaxkern.quant._swiglu import _silu_times, rn_div
from jaxkern.quant._tiling import BM
from jaxkern.reference import quant as ref
from jaxkern.types import QuantTensor

# Rows per CTA of :func:`_kernel` by num_per_tokens: one group of 128, or two of 32. H200, CUPTI, cold L2, 2026-11-29,
# µs, 64 against 128 rows at npt 32 (twice the CTAs, half the work per warp; TileKernels in brackets): M=8064 h=576
# 12.7 / 13.5 without / with the transpose against 15.5 / 16.1 (11.6 / 12.3), M=4096 h=576 8.9 / 9.3 against
# 11.4 / 11.8 (8.5 / 9.7), M=8064 transposed h=2048 34.8 against 39.0 (34.1), h=7168 108.6 against 116.3 (100.6).
# At npt 128 without the transpose, 32-column CTAs (the same halving) were mixed at h=576: 9.0 against 9.5 at
# M=4096, 13.5 against 13.3 at M=8064.
_ROWS = {32: 64, 128: 128}
_CHUNK = 32  # rows per register load in the row layout
_COLS = 64  # columns per CTA (128 measured slower on an H200, 2026-11-28; module docstring)
# Columns per CTA of :func:`_kernel_wide` (32-row tiles, one group per CTA), which runs npt 32 without the transpose
# where it divides h. H200, 2026-11-29, M=8064 h=7168: 86.5 µs against 86.8 with 128 columns and 105.5 for
# :func:`_kernel` (TileKernels 81.1); h=2048 29.6 (29.3).
_WIDE_COLS = 256
_WIDE_STEP_VALUES = 16  # values per thread in each activation / cast step of :func:`_kernel_wide`


def _act_rows(load, clamp, layout, interpret):
  """The SwiGLU activation (:func:`jaxkern.quant._swiglu._silu_times`) of the gate and value rows
  that ``load(0)`` / ``load(1)`` return in ``layout``, rounded to bf16."""
  left, right = (load(half).astype(jnp.float32) for half in (0, 1))
  div = _ieee.newton_div if interpret else functools.partial(rn_div, layout=layout)
  return _silu_times(left, right, clamp, False, div)[0].astype(jnp.bfloat16)


def _inv_rows(inv_s, npt, block, c, layout):
  """``(64, c)`` float32 ``sf_inv`` of the rows ``64·block .. 64·block + 63`` in ``layout`` (WGMMA or
  WGMMA_TRANSPOSED, whose warps both own 16-row strips): one group of 128, or two of 32 (warps 0-1 / 2-3)."""
  col = layout.reduce(0)
  if npt == 128:
    return jnp.broadcast_to(plgpu.load(inv_s.at[0], layout=col)[None, :], (BM, c))
  top = plgpu.broadcasted_iota(jnp.int32, (BM, c), 0, layout=layout) < 32
  return jnp.where(top, plgpu.load(inv_s.at[2 * block], layout=col)[None, :],
                   plgpu.load(inv_s.at[2 * block + 1], layout=col)[None, :])


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


def _rows_per_barrier(npt: int, r: int, chunk: int) -> int:
  """Rows of :func:`_kernel`'s gate and value tiles that arrive on one TMA barrier: at npt 128 one 32-row chunk
  (the activation of a chunk starts when its rows arrive; H200, CUPTI, cold L2, 2026-11-29, h=576: M=8064 12.7 /
  13.1 µs without / with the transpose against 13.3 / 13.8 for the whole tile, M=4096 without the transpose 9.2
  against 9.5); at npt 32 the whole 64-row tile (a barrier per chunk, each group cast and stored before the next
  is read, measured within 3.5% either way there; a barrier per chunk gained at most 3.2% with 128-row CTAs)."""
  return chunk if npt == 128 else r


def _stage_rows(x_g, x_s, y_s, bars, i, j, r: int, c: int, k: int, rows: int) -> None:
  """Starts the TMA copies of row block ``i``'s gate and value tiles of column block ``j`` (``r x c`` each, the
  halves ``k`` columns apart) into ``x_s`` / ``y_s`` in chunks of ``rows`` rows, chunk ``q`` of both arriving on
  ``bars.at[q]``."""
  for q in range(r // rows):
    for half, t in enumerate((x_s, y_s)):
      plgpu.copy_gmem_to_smem(x_g.at[pl.ds(i * r + q * rows, rows), pl.ds(half * k + j * c, c)],
                              t.at[pl.ds(q * rows, rows)], bars.at[q])


@functools.partial(jax.jit, static_argnames=("npt", "round_sf", "transpose_out", "clamp", "interpret"))
def _kernel(x, *, npt, round_sf, transpose_out, clamp, interpret):
  """``x`` bf16 ``(M, 2h)`` -> ``(data (h, M) e4m3, or (M, h) without transpose_out, sf (M/npt, h) float32)``.

  One CTA (one warpgroup) per :data:`_ROWS` rows (64 at npt 32, 128 at npt 128) and :data:`_COLS` columns, gate
  and value tiles TMA-loaded into SMEM (:func:`_rows_per_barrier` rows on each barrier): the activation of 32-row
  chunks in :func:`jaxkern._layouts.row_layout` (gate and value vectors meet in one thread), its column maxima per
  group (elementwise, then one reduction), the scale factors one column per thread (:func:`_sf_div`) through SMEM,
  then the cast of the activation, stored over the gate tile in the first pass: without the transpose rows straight
  to GMEM; with it 64-row blocks in the WGMMA layout, re-laid out transposed, cast into SMEM and TMA-stored."""
  m, k = x.shape[0], x.shape[1] // 2
  r, c = _ROWS[npt], _COLS
  groups, chunk = r // npt, min(_CHUNK, npt)
  staged = _rows_per_barrier(npt, r, chunk)
  lay = row_layout(c, x.dtype.itemsize)[0]
  per_thread = pcc._per_thread(c)
  act_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # conflict-free WGMMA reads
  scratch = dict(x_s=plgpu.SMEM((r, c), x.dtype, transforms=act_transforms), y_s=plgpu.SMEM((r, c), x.dtype),
                 a_s=plgpu.SMEM((groups, c), jnp.float32), inv_s=plgpu.SMEM((groups, c), jnp.float32),
                 bar=plgpu.Barrier(num_arrivals=2, num_barriers=r // staged))
  if transpose_out:
    out_type = jax.ShapeDtypeStruct((k, m), jnp.float8_e4m3fn)
    scratch["o_s"] = plgpu.SMEM((r // BM, c, BM), jnp.float8_e4m3fn)
  else:
    out_type = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
  interpret = _config.mosaic_interpret(interpret)

  @functools.partial(
      plgpu.kernel, grid=(k // c, m // r), grid_names=("j", "i"), interpret=interpret,
      out_type=(out_type, jax.ShapeDtypeStruct((m // npt, k), jnp.float32)), scratch_types=scratch,
      compiler_params=NO_AUTO_BARRIERS)
  def kernel(x_g, *gmem, x_s, y_s, a_s, inv_s, bar, o_s=None):
    c_g, o_g, sf_g = gmem if len(gmem) == 3 else (None, *gmem)
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * c, c)
    _stage_rows(x_g, x_s, y_s, bar, i, j, r, c, k, staged)
    maxv = _max_value(c_g, c, per_thread)

    def act_chunk(r0):
      if r0 % staged == 0:  # the first chunk on this barrier
        plgpu.barrier_wait(bar.at[r0 // staged])
      act = _act_rows(lambda half: plgpu.load((x_s, y_s)[half].at[pl.ds(r0, chunk)], layout=lay), clamp, lay,
                      interpret)
      x_s[pl.ds(r0, chunk)] = act  # over the gate rows this thread read
      return act

    # Column maxima of each group (exact in bf16): elementwise over row chunks, then one reduction.
    for g in range(groups):
      parts = [act_chunk(g * npt + h) for h in range(0, npt, chunk)]
      a_s[g] = pcc._column_max([jnp.abs(p) for p in parts], interpret).astype(jnp.float32)
    plgpu.commit_smem()
    for g in range(groups):  # one column per thread
      sf, inv = ref.scale_factors(plgpu.load(a_s.at[g], layout=per_thread), maxv, "e4m3", round_sf,
                                  div=_sf_div(per_thread, c, interpret))
      sf_g[groups * i + g, cols] = sf
      inv_s[g] = inv
    plgpu.commit_smem()
    if transpose_out:
      for block in range(r // BM):
        v = plgpu.layout_cast(plgpu.load(x_s.at[pl.ds(block * BM, BM)], layout=plgpu.Layout.WGMMA),
                              plgpu.Layout.WGMMA_TRANSPOSED)
        inv = _inv_rows(inv_s, npt, block, c, plgpu.Layout.WGMMA_TRANSPOSED)
        o_s.at[block].T[...] = pcc._e4m3(v.astype(jnp.float32) * inv, interpret)
      plgpu.commit_smem()
      for block in range(r // BM):
        plgpu.copy_smem_to_gmem(o_s.at[block], o_g.at[cols, pl.ds(i * r + block * BM, BM)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    else:  # row chunks from SMEM straight to GMEM
      for g in range(groups):
        inv = plgpu.load(inv_s.at[g], layout=lay.reduce(0), optimized=False)[None, :]
        for h in range(g * npt, (g + 1) * npt, chunk):
          v = plgpu.load(x_s.at[pl.ds(h, chunk)], layout=lay)
          o_g[pl.ds(i * r + h, chunk), cols] = pcc._e4m3(v.astype(jnp.float32) * inv, interpret)

  return kernel(x, *_max_inputs(interpret))


def _runs_wide(h: int, npt: int, without_transpose: bool) -> bool:
  """Whether :func:`_kernel_wide` serves the call (npt 32 without the transpose, :data:`_WIDE_COLS` dividing h)."""
  return without_transpose and npt == 32 and h % _WIDE_COLS == 0


@functools.partial(jax.jit, static_argnames=("round_sf", "clamp", "interpret"))
def _kernel_wide(x, *, round_sf, clamp, interpret):
  """``x`` bf16 ``(M, 2h)`` -> ``(data (M, h) e4m3, sf (M/32, h) float32)``: npt 32 without the transpose,
  ``h % 256 == 0``.

  One CTA (one warpgroup) per 32 rows (one group) and :data:`_WIDE_COLS` (256) columns, gate and value tiles
  TMA-loaded into SMEM, each step's rows on a TMA barrier of their own (as :func:`_kernel` at npt 128; H200, CUPTI,
  cold L2, 2026-11-29: M=4096 h=2048 17.4 µs against 18.4 with the whole tile on one barrier, M=8064 h=7168 87.6
  both), and read in steps of :data:`_WIDE_STEP_VALUES` values per thread in
  :func:`jaxkern._layouts.row_layout` (a warp covers whole 256-column rows, so a column spans 4 threads, one per
  warp: its maximum is in-thread, then one cross-warp step). The activation is stored over the gate tile; the scale
  factors one column per thread through SMEM; then the cast of the stored activation, stored straight to GMEM. No
  automatic warpgroup barriers (as :func:`_kernel`)."""
  m, k = x.shape[0], x.shape[1] // 2
  r, c = 32, _WIDE_COLS
  lay = row_layout(c, x.dtype.itemsize)[0]
  step = _WIDE_STEP_VALUES * 128 // c  # rows per step
  per_thread = pcc._per_thread(c)
  scratch = dict(x_s=plgpu.SMEM((r, c), x.dtype), y_s=plgpu.SMEM((r, c), x.dtype),
                 a_s=plgpu.SMEM((c,), jnp.float32), inv_s=plgpu.SMEM((c,), jnp.float32),
                 bar=plgpu.Barrier(num_arrivals=2, num_barriers=r // step))
  interpret = _config.mosaic_interpret(interpret)
  sf_div = _sf_div(per_thread, c, interpret)

  @functools.partial(
      plgpu.kernel, grid=(k // c, m // r), grid_names=("j", "i"), interpret=interpret,
      out_type=(jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((m // r, k), jnp.float32)),
      scratch_types=scratch, compiler_params=NO_AUTO_BARRIERS)
  def kernel(x_g, *gmem, x_s, y_s, a_s, inv_s, bar):
    c_g, o_g, sf_g = gmem if len(gmem) == 3 else (None, *gmem)
    i, j = lax.axis_index("i"), lax.axis_index("j")
    cols = pl.ds(j * c, c)
    _stage_rows(x_g, x_s, y_s, bar, i, j, r, c, k, step)
    maxv = _max_value(c_g, c, per_thread)
    parts = []
    for r0 in range(0, r, step):
      plgpu.barrier_wait(bar.at[r0 // step])
      act = _act_rows(lambda half, r0=r0: plgpu.load((x_s, y_s)[half].at[pl.ds(r0, step)], layout=lay), clamp, lay,
                      interpret)
      x_s[pl.ds(r0, step)] = act  # over the gate rows this thread read
      parts.append(jnp.abs(act))
    a_s[...] = pcc._column_max(parts, interpret).astype(jnp.float32)
    plgpu.commit_smem()
    sf, inv = ref.scale_factors(plgpu.load(a_s, layout=per_thread), maxv, "e4m3", round_sf, div=sf_div)
    sf_g[i, cols] = sf
    inv_s[...] = inv
    plgpu.commit_smem()
    inv = plgpu.load(inv_s, layout=lay.reduce(0), optimized=False)[None, :]
    for r0 in range(0, r, step):
      v = plgpu.load(x_s.at[pl.ds(r0, step)], layout=lay)
      o_g[pl.ds(i * r + r0, step), cols] = pcc._e4m3(v.astype(jnp.float32) * inv, interpret)

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

  Mosaic GPU kernel (:mod:`jaxkern.quant._swiglu_per_channel`). XLA
  (the reference) instead of the kernel: only zero-size arrays (``M = 0`` gives data ``(h, 0)`` / ``(0, h)`` and
  sf ``(0, h)``).

  Numerics: bit-identical to :func:`jaxkern.reference.quant.swiglu_forward_and_per_channel_cast_and_transpose` run on
  the same backend (``exp`` differs between XLA's CPU and CUDA's ``expf``, which the GPU kernel and XLA on GPU
  share). Non-finite values (inputs, or products that overflow) are outside the contract.

  Differentiation: not differentiable; ``jax.grad`` through it raises :class:`jaxkern.NotDifferentiableError`.
  """
  x = validate.guard("swiglu_forward_and_per_channel_cast_and_transpose", _check(x, fmt, num_per_tokens))
  clamp = None if swiglu_clamp_value is None else float(np.float32(swiglu_clamp_value))

  def kernel(interpret):
    if _runs_wide(x.shape[1] // 2, num_per_tokens, without_transpose):
      return QuantTensor(*_kernel_wide(x, round_sf=round_sf, clamp=clamp, interpret=interpret))
    return QuantTensor(*_kernel(x, npt=num_per_tokens, round_sf=round_sf, transpose_out=not without_transpose,
                                clamp=clamp, interpret=interpret))

  def reference():
    return ref.swiglu_forward_and_per_channel_cast_and_transpose(
        x, fmt, num_per_tokens, round_sf=round_sf, without_transpose=without_transpose, swiglu_clamp_value=clamp)

  return _dispatch.run("swiglu_forward_and_per_channel_cast_and_transpose", implementation, kernel=kernel,
                       xla=reference, empty=x.size == 0)

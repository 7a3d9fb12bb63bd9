"""SwiGLU backward kernel for 32-column scale groups (quant.md §8.3): the row-block kernel.

Used by :func:`jaxkern.quant.swiglu_backward_and_per_token_cast` for every ``num_per_channels`` other than
:data:`jaxkern.quant._swiglu_backward.GROUPED_NPC` (see that module for why, and for what the kernel computes).
Straight GMEM -> registers -> GMEM, no SMEM or TMA. Each CTA takes a block of rows sized by
:func:`jaxkern.quant._tiling.tile_rows` (the last block shifted back to end at the last row; the overlap is written
twice with equal values) and a chunk of :data:`CHUNK_COLS` gate columns (grid axis ``g``), walked one scale group
at a time: the first group peeled, the others unrolled up to :data:`UNROLL_GROUPS` or in a ``fori_loop``. All
arrays of a group share one :func:`jaxkern._layouts.row_layout` (``npc`` wide, 8-element vectors, at most
:data:`jaxkern.quant._per_token_cast.SEGMENT_LANES` lanes per row; 32-column groups get 4 lanes and 32-row layout
blocks). Both divisions of the swish and those of the scale factors are :func:`jaxkern._ieee.newton_div` /
:func:`jaxkern._ieee.exact_div` (correctly rounded, compiled and in interpret mode alike); ``x·(1 - s) + 1`` is a
multiply whose only use is an add (fused into ``fma.rn.f32`` by LLVM, as in the grouped kernel). The per-row sums
``Σ g · act`` are reduced per group and added up over the chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _ieee
from jaxkern._layouts import row_layout
from jaxkern.quant import _tiling as tiling
from jaxkern.quant._per_token_cast import SEGMENT_LANES, abs_key, gpu_nan, key_value, to_e4m3
from jaxkern.reference import quant as ref

CHUNK_COLS = 512  # gate columns per CTA (16 groups of 32): the forward's chunk width
UNROLL_GROUPS = 4  # groups per chunk written out in Python; more run in a fori_loop


def layout(npc):
  """``(layout, rows per layout block)`` of one group: bf16 (the widest stored type) sets 8-element vectors."""
  return row_layout(npc, 2, SEGMENT_LANES)


def output_types(r, h, nseg, num_chunks):
  """The backward kernels' outputs for ``r`` rows, ``h`` gate columns in ``nseg`` groups and ``num_chunks`` column
  chunks: ``out``, ``x_grad``, ``x_grad_q``, ``x_grad_sf`` (layout A) and the row sums of each chunk."""
  return (jax.ShapeDtypeStruct((r, h), jnp.bfloat16), jax.ShapeDtypeStruct((r, 2 * h), jnp.bfloat16),
          jax.ShapeDtypeStruct((r, 2 * h), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((r, 2 * nseg), jnp.float32),
          jax.ShapeDtypeStruct((num_chunks, r), jnp.float32))


def backward_kernel(q, sf, grad, weight, *, npc, round_sf, clamp, interpret):
  """``q`` ``(R, 2h)`` e4m3, ``sf`` ``(R, 2h/npc)`` float32, ``grad`` ``(R, h)`` bf16, ``weight`` ``(1, R)``
  float32 (``R`` at least one layout block) -> ``(out (R, h) bf16, x_grad (R, 2h) bf16, x_grad_q (R, 2h) e4m3,
  x_grad_sf (R, 2h/npc) float32 (layout A), row sums (chunks, R) float32)``."""
  r, h = grad.shape
  nseg = h // npc  # groups per half
  chunk = min(max(1, CHUNK_COLS // npc), nseg)
  num_chunks = ref.cdiv(nseg, chunk)
  lay, unit = layout(npc)
  vec = lay.reduce(1)
  rt = tiling.tile_rows(r, 2 * chunk * npc, 2, unit)
  num_ctas = pl.cdiv(r, rt)
  out_type = output_types(r, h, nseg, num_chunks)
  c = None if clamp is None else float(np.float32(clamp))

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(num_chunks, num_ctas), grid_names=("g", "i"),
                     interpret=interpret)
  def kernel(q_g, sf_g, g_g, w_g, c_g, out_g, xg_g, xq_g, xsf_g, dot_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, r - rt), rt)
    maxv = c_g[0]

    def load(ref_, col):
      return plgpu.load(ref_.at[rows, pl.ds(col, npc)], layout=lay, optimized=False).astype(jnp.float32)

    def cast(v):
      """Per-token e4m3 cast of one float32 group: ``(data, sf)``."""
      amax = key_value(jnp.max(abs_key(v, interpret), axis=1), interpret)
      s, inv = ref.scale_factors(amax, maxv, "e4m3", round_sf, div=_ieee.exact_div)
      return to_e4m3(gpu_nan(v * inv[:, None], interpret), interpret), gpu_nan(s, interpret)

    def group(j, w):
      """Group ``j`` of each half (columns ``j·npc`` and ``h + j·npc``): stores its outputs, returns its row sums."""
      col = j * npc
      sx = plgpu.load(sf_g.at[rows, j], layout=vec, optimized=False)
      sy = plgpu.load(sf_g.at[rows, nseg + j], layout=vec, optimized=False)
      xv = load(q_g, col) * sx[:, None]
      yv = load(q_g, h + col) * sy[:, None]
      g = load(g_g, col)
      if c is not None:
        cx, cyu, cyl = xv > c, yv > c, yv < -c
        xv = jnp.where(cx, c, xv)
        yv = jnp.where(cyu, c, jnp.where(cyl, -c, yv))
      d = 1.0 + jnp.exp(-xv)
      act = _ieee.newton_div(xv, d) * yv  # d = 1 + exp(-x) >= 1
      s = _ieee.newton_div(jnp.ones_like(d), d)
      gw = (g * w) * s
      dx = (gw * yv) * (xv * (1.0 - s) + 1.0)  # fma: the multiply's only use is the add (module docstring)
      dy = gw * xv
      if c is not None:
        dx = jnp.where(cx, 0.0, dx)
        dy = jnp.where(cyu | cyl, 0.0, dy)
      out_g[rows, pl.ds(col, npc)] = (act * w).astype(jnp.bfloat16)
      for half, v in ((0, dx), (1, dy)):
        cols = pl.ds(half * h + col, npc)
        xg_g[rows, cols] = v.astype(jnp.bfloat16)
        data, s_out = cast(v)
        xq_g[rows, cols] = data
        xsf_g[rows, half * nseg + j] = s_out
      return jnp.sum(g * act, axis=1)

    def body(chunk_index, nlocal):
      """Groups ``chunk_index·chunk + t`` of each half for ``t < nlocal`` (static): unrolled up to
      :data:`UNROLL_GROUPS`, else the first one peeled (its row sums give the loop carry its layout) and the others
      in a ``fori_loop`` (16 unrolled groups of 32 columns made a module that took over a minute to lower)."""
      seg0 = chunk_index * chunk
      w = plgpu.load(w_g.at[0, rows], layout=vec, optimized=False)[:, None]
      total = group(seg0, w)
      if nlocal <= UNROLL_GROUPS:
        for t in range(1, nlocal):
          total = total + group(seg0 + t, w)
      else:
        total = lax.fori_loop(1, nlocal, lambda t, acc: acc + group(seg0 + t, w), total)
      dot_g[chunk_index, rows] = total

    tiling.over_chunks(body, lax.axis_index("g"), nseg, chunk)

  # The largest e4m3 value as a one-element host constant, loaded by the kernel (not folded in interpret mode).
  consts = np.full((1,), ref.FP8_MAX, np.float32)
  return kernel(q, sf, grad, weight, consts)

"""SwiGLU backward kernel for 32-column scale groups (docs/quant.md, "Fused SwiGLU"): the step kernel.

Used by :func:`jaxkern.quant.swiglu_backward_and_per_token_cast` for every ``num_per_channels`` other than
:data:`jaxkern.quant._swiglu_backward.GROUPED_NPC` (see that module for what the kernels compute and for the
timings). It is the grouped kernel of :mod:`jaxkern.quant._swiglu_backward` with 32-wide groups taken
:data:`STEP_GROUPS` at a time: straight GMEM -> registers -> GMEM, no SMEM or TMA, each CTA on one layout block of
rows (the last block shifted back to end at the last row; the overlap is written twice with equal values) and
:data:`STEP_CHUNK_COLS` gate columns (grid axis ``g``), walked one step per iteration of a loop with the next
step's inputs loaded one iteration ahead.

A step of 4 groups is 128 columns of a row on 16 lanes, 8 values per thread and array (the grouped kernel's
128-wide group), viewed as ``(rows, 4, 4, 8)``: a group's four 8-element vectors on four consecutive lanes
(:func:`jaxkern._layouts.group_vectors_layout`), so that a group's abs-max takes two warp shuffles, and its sf
(loaded as ``(rows, 4)`` from layout A, stored likewise) is held by its four lanes; a layout block is 8 rows.
Group counts ``h / 32`` that 4 does not divide take steps of 2 groups (16-row blocks) or 1 (a plain
``(rows, 32)`` view on 4 lanes, 32-row blocks). The divisions are the PTX ``div.rn.f32`` / ``rcp.rn.f32``
(in interpret mode :func:`jaxkern._ieee.newton_div` / :func:`jaxkern._ieee.exact_div`, the same values;
:func:`jaxkern._ieee.mosaic_swish_divisions`); ``x·(1 - s) + 1`` is a multiply whose only use is an add (fused
into ``fma.rn.f32`` by LLVM, as in the grouped kernel); no automatic warpgroup barriers (no thread reads what
another wrote).
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
from jaxkern._layouts import NO_AUTO_BARRIERS, group_vectors_layout, row_layout
from jaxkern.quant import _tiling as tiling
from jaxkern.quant._nan import abs_key, gpu_nan, key_value
from jaxkern.quant._per_token_cast import to_e4m3
from jaxkern.reference import quant as ref

# Groups per step (at most; the largest power of two dividing ``h / npc`` up to it): 4 groups of 32 are 128 columns
# on 16 lanes, 8 values per thread and array, as the grouped kernel's 128-wide groups.
STEP_GROUPS = 4
STEP_CHUNK_COLS = 2048  # gate columns per CTA, as the grouped kernel's CHUNK_COLS



def swiglu_grads(xv, yv, g, w, c, swish):
  """The element-wise SwiGLU backward of both backward kernels, float32: the clamp (``c`` or None) of the gate
  ``xv`` and the up value ``yv``, then ``act = silu(x)·y``, ``dx``, ``dy`` for the row weight ``w`` and the output
  gradient ``g``; ``swish(x, 1 + exp(-x))`` gives ``x / (1 + exp(-x))`` and ``1 / (1 + exp(-x))``."""
  if c is not None:
    cx, cy = xv > c, jnp.abs(yv) > c  # |y| > C: y > C or y < -C (finite inputs)
    xv = jnp.where(cx, c, xv)
    yv = jnp.minimum(jnp.maximum(yv, -c), c)
  q, s = swish(xv, 1.0 + jnp.exp(-xv))
  act = q * yv
  gw = (g * w) * s
  dx = (gw * yv) * (xv * (1.0 - s) + 1.0)  # fma: the multiply's only use is the add (module docstring)
  dy = gw * xv
  if c is not None:
    dx = jnp.where(cx, 0.0, dx)
    dy = jnp.where(cy, 0.0, dy)
  return act, dx, dy

def output_types(r, h, nseg, num_chunks):
  """The backward kernels' outputs for ``r`` rows, ``h`` gate columns in ``nseg`` groups and ``num_chunks`` column
  chunks: ``out``, ``x_grad``, ``x_grad_q``, ``x_grad_sf`` (layout A) and the row sums of each chunk."""
  return (jax.ShapeDtypeStruct((r, h), jnp.bfloat16), jax.ShapeDtypeStruct((r, 2 * h), jnp.bfloat16),
          jax.ShapeDtypeStruct((r, 2 * h), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((r, 2 * nseg), jnp.float32),
          jax.ShapeDtypeStruct((num_chunks, r), jnp.float32))


def block_rows(npc, h):
  """The fewest rows the kernel takes (one layout block; inputs with fewer rows are padded with zero rows)."""
  return step_layout(npc, step_groups(h // npc))[1]


def step_groups(nseg):
  """Groups per step for ``nseg`` groups per half: the largest power of two dividing ``nseg``, at most
  :data:`STEP_GROUPS`."""
  g = 1
  while g < STEP_GROUPS and nseg % (2 * g) == 0:
    g *= 2
  return g


def step_view(npc, groups, rows):
  """The shape of a step of ``groups`` groups and ``rows`` rows in registers: ``(rows, groups, npc/8, 8)``, one
  group plainly ``(rows, npc)`` (a group axis of one element defeats Mosaic GPU's layout inference)."""
  return (rows, npc) if groups == 1 else (rows, groups, npc // 8, 8)


def step_layout(npc, groups):
  """``(layout, rows per layout block)`` of a :func:`step_view`: 8-element vectors (bf16, the widest stored type,
  sets 16 bytes), a group's vectors on consecutive lanes, the groups of a row on the next lanes
  (:func:`jaxkern._layouts.group_vectors_layout`; one group: :func:`jaxkern._layouts.row_layout` on
  ``npc / 8`` lanes)."""
  return row_layout(npc, 2, npc // 8) if groups == 1 else group_vectors_layout(groups, npc, 2)


def _reduce_to(op, v, ndim):
  """``op`` (``jnp.max`` / ``jnp.sum``) over the trailing axes of ``v`` down to ``ndim`` axes, one at a time."""
  while v.ndim > ndim:
    v = op(v, axis=v.ndim - 1)
  return v


def _expand(s, ndim):
  """``s`` with trailing unit axes up to ``ndim`` axes (for broadcasting against a step)."""
  return s[(...,) + (None,) * (ndim - s.ndim)]


def backward_kernel(q, sf, grad, weight, *, npc, round_sf, clamp, interpret):
  """``q`` ``(R, 2h)`` e4m3, ``sf`` ``(R, 2h/npc)`` float32, ``grad`` ``(R, h)`` bf16, ``weight`` ``(1, R)``
  float32 (``R`` at least :func:`block_rows`) -> ``(out (R, h) bf16, x_grad (R, 2h) bf16, x_grad_q (R, 2h) e4m3,
  x_grad_sf (R, 2h/npc) float32 (layout A), row sums (chunks, R) float32)``."""
  r, h = grad.shape
  nseg = h // npc  # groups per half
  groups = step_groups(nseg)
  width = groups * npc  # columns per step
  nsteps = nseg // groups
  chunk = min(max(1, STEP_CHUNK_COLS // width), nsteps)  # steps per CTA
  num_chunks = ref.cdiv(nsteps, chunk)
  lay, rt = step_layout(npc, groups)
  view = step_view(npc, groups, rt)
  nd = len(view)
  sf_nd = 1 if groups == 1 else 2  # the sf of a step: (rows,) or (rows, groups)
  sfl = lay.reduce(1) if groups == 1 else lay.reduce(3).reduce(2)  # held by each of a group's lanes
  rowl = lay.reduce(1) if groups == 1 else sfl.reduce(1)  # one value per row
  out_type = output_types(r, h, nseg, num_chunks)
  c = None if clamp is None else float(np.float32(clamp))
  swish, sf_div = _ieee.mosaic_swish_divisions(lay, view, sfl, view[:sf_nd], interpret)

  @functools.partial(plgpu.kernel, out_type=out_type, grid=(num_chunks, pl.cdiv(r, rt)), grid_names=("g", "i"),
                     compiler_params=NO_AUTO_BARRIERS, interpret=interpret)
  def kernel(q_g, sf_g, g_g, w_g, c_g, out_g, xg_g, xq_g, xsf_g, dot_g):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * rt, r - rt), rt)
    maxv = c_g[0]

    def load(ref_, c0):
      """Columns ``[c0, c0 + width)`` of the block's rows in the step view (compiled: a view of the GMEM ref,
      interpret mode: a reshaped value)."""
      if interpret is not None:
        return ref_[rows, pl.ds(c0, width)].reshape(view)
      src = ref_.at[rows, pl.ds(c0, width)]
      return plgpu.load(src if nd == 2 else src.reshape(*view), layout=lay, optimized=False)

    def store(ref_, c0, v):
      """``v`` (a step view) to columns ``[c0, c0 + width)`` of the block's rows."""
      if interpret is not None:
        ref_[rows, pl.ds(c0, width)] = v.reshape(rt, width)
      else:
        dst = ref_.at[rows, pl.ds(c0, width)]
        (dst if nd == 2 else dst.reshape(*view))[...] = v

    def sf_cols(g0):
      """The sf columns of the step whose first group is ``g0``."""
      return g0 if groups == 1 else pl.ds(g0, groups)

    def fetch(t):
      """Step ``t``'s inputs as loaded: ``(x, y)`` e4m3 (columns ``t·width`` and ``h + t·width``), their sf
      (:func:`sf_cols`), ``g`` bf16."""
      col = t * width
      sf_pair = [plgpu.load(sf_g.at[rows, sf_cols(k + t * groups)], layout=sfl, optimized=False) for k in (0, nseg)]
      return load(q_g, col), load(q_g, h + col), *sf_pair, load(g_g, col)

    def cast(v):
      """Per-token e4m3 cast of one float32 step: ``(data, sf)`` (one sf per row and group)."""
      amax = key_value(_reduce_to(jnp.max, abs_key(v, interpret), sf_nd), interpret)
      s, inv = ref.scale_factors(amax, maxv, "e4m3", round_sf, div=sf_div)
      return to_e4m3(gpu_nan(v * _expand(inv, nd), interpret), interpret), gpu_nan(s, interpret)

    def step(t, inputs, w, acc):
      """Step ``t`` of each half from its :func:`fetch`ed ``inputs``: stores its outputs, returns ``acc`` plus
      its elementwise ``g · act``."""
      xq, yq, sx, sy, g = inputs
      col = t * width
      xv = xq.astype(jnp.float32) * _expand(sx, nd)
      yv = yq.astype(jnp.float32) * _expand(sy, nd)
      act, dx, dy = swiglu_grads(xv, yv, g.astype(jnp.float32), w, c, swish)
      store(out_g, col, (act * w).astype(jnp.bfloat16))
      for half, v in ((0, dx), (1, dy)):
        store(xg_g, half * h + col, v.astype(jnp.bfloat16))
        data, s_out = cast(v)
        store(xq_g, half * h + col, data)
        xsf_g[rows, sf_cols(half * nseg + t * groups)] = s_out
      return acc + g * act

    def body(chunk_index, nlocal):
      """Steps ``chunk_index·chunk + u`` for ``u < nlocal`` (static), one per iteration of a loop, the next
      step's inputs loaded one iteration ahead (carried through the loop)."""
      t0 = chunk_index * chunk
      w = _expand(plgpu.load(w_g.at[0, rows], layout=rowl, optimized=False), nd)
      acc = plgpu.layout_cast(jnp.zeros(view, jnp.float32), lay)

      def loop(u, carry):
        acc, inputs = carry
        ahead = fetch(t0 + jnp.minimum(u + 1, nlocal - 1))  # the last iteration reloads its own step
        return step(t0 + u, inputs, w, acc), ahead

      acc, _ = lax.fori_loop(0, nlocal, loop, (acc, fetch(t0)))
      dot_g[chunk_index, rows] = _reduce_to(jnp.sum, acc, 1)

    tiling.over_chunks(body, lax.axis_index("g"), nsteps, chunk)

  # The largest e4m3 value as a one-element host constant, loaded by the kernel (not folded in interpret mode).
  consts = np.full((1,), ref.FP8_MAX, np.float32)
  return kernel(q, sf, grad, weight, consts)

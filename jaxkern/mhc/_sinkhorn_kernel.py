"""Mosaic GPU kernels of the Sinkhorn normalisation (docs/mhc.md, "sinkhorn_normalize"), forward and backward.

One thread per token: a CTA loads a ``(128, M·M)`` float32 tile (``row_layout(M·M, 4, max_lanes=1)``: each
thread holds its token's whole matrix as 16-byte vectors) and splits it into ``M·M`` per-thread scalars
(masked in-thread sums, which fold to register picks), so every row / column sum and normalisation is
plain per-thread arithmetic in registers; the result is reassembled the same way and stored. The last
CTA's 128 tokens are clamped to end at ``T`` (it recomputes a few of its neighbour's tokens); ``T < 128``
is padded to 128 rows by the caller.

Order of operations (the contract for fused kernels that must match bit for bit, see :func:`forward`):
softmax ``exp(x - rowmax) / rowsum`` (sums ``n = 0..M-1`` in order), ``+ eps``; each normalisation
``X / (Σ + eps)`` with the sum over the other index in order. ``/`` is the GPU's float32 division
(approximate, within ~2 ulp: the tests' tolerance is ``assert_close`` at fp32 defaults).

The backward (:func:`backward`, ``repeat <= MAX_LINEAR_REPEAT``) runs the forward chain once and keeps its
iterates per thread: ``X_1 = P + eps`` and the inputs ``X_2q`` of the row steps (``10·M²`` values for
``repeat = 10``; ptxas keeps what does not fit in registers in thread-local memory, L1-resident). Walking
back it recomputes ``X_2q+1 = row_norm(X_2q)``, each step's sums and their reciprocals ``r = 1/(Σ_i + eps)``
from those saved values: that work does not depend on the incoming gradient, so it runs beside the gradient
chain instead of lengthening it, and a backward step on the chain is ``t = (Σ g·X_i)·r``, ``g = (g - t)·r``
(two multiplies where the reference divides twice: each differs from the division by at most an ulp or so; the
tests' tolerance is fp32 ``assert_close``). The chain is thus ``2·repeat - 1`` forward normalisations and as
many multiply-only backward steps (linear in ``repeat``). The first version re-ran the forward up to ``X_i``
for every step (``O(repeat²)`` normalisations, ~170 dependent steps for ``repeat = 10``) and ran at
0.26-0.74x XLA on an H100: with one token per thread and at most one CTA per SM for ``T <= 16896``, the
kernel's time is the latency of that one chain. Larger ``repeat`` keeps the recomputing form
(:func:`backward_recompute`: the reference's divisions, few registers).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern._layouts import row_layout

ROWS = 128  # tokens per CTA: one per thread


def unsupported(m: int) -> str | None:
  if (m * m) % 4 or m > 8:
    return f"mhc_mult {m}: the kernel takes M·M a multiple of 4 and M <= 8"
  return None


def _layout(m):
  lay, rows = row_layout(m * m, 4, max_lanes=1)
  assert rows == ROWS
  return lay


def _split(tile, m, lay):
  cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, m * m), 1, layout=lay)
  return [[jnp.sum(jnp.where(cols == a * m + b, tile, 0.0), axis=1) for b in range(m)] for a in range(m)]


def _join(e, m, lay):
  cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, m * m), 1, layout=lay)
  out = jnp.zeros((ROWS, m * m), jnp.float32)
  for a in range(m):
    for b in range(m):
      out = jnp.where(cols == a * m + b, e[a][b][:, None], out)
  return out


def _sum(vals):
  acc = vals[0]
  for v in vals[1:]:
    acc = acc + v
  return acc


def softmax(e):
  """Row softmax of the per-token matrix ``e[m][n]`` (lists of arrays)."""
  out = []
  for row in e:
    mx = row[0]
    for v in row[1:]:
      mx = jnp.maximum(mx, v)
    ex = [jnp.exp(v - mx) for v in row]
    s = _sum(ex)
    out.append([v / s for v in ex])
  return out


def col_norm(e, eps):
  m = len(e)
  d = [_sum([e[a][b] for a in range(m)]) + eps for b in range(m)]
  return [[e[a][b] / d[b] for b in range(m)] for a in range(m)]


def row_norm(e, eps):
  out = []
  for row in e:
    d = _sum(row) + eps
    out.append([v / d for v in row])
  return out


def _pairs(e, count, eps):
  """``count`` (row, column) normalisation pairs (``count`` a static or traced int)."""
  m = len(e)
  flat = [v for row in e for v in row]

  def body(_, flat):
    x = [list(flat[a * m:(a + 1) * m]) for a in range(m)]
    x = col_norm(row_norm(x, eps), eps)
    return tuple(v for row in x for v in row)

  flat = lax.fori_loop(0, count, body, tuple(flat))
  return [list(flat[a * m:(a + 1) * m]) for a in range(m)]


def forward(e, repeat, eps):
  """The forward chain on per-token values ``e[m][n]``: softmax, ``+ eps``, column normalisation, then
  ``repeat - 1`` (row, column) pairs."""
  x = [[v + eps for v in row] for row in softmax(e)]
  return _pairs(col_norm(x, eps), repeat - 1, eps)


def _bwd_step(g, xi, eps, axis_rows):
  """One normalisation's backward: ``t = Σ g·X_i / (Σ_i + eps)``, ``g = (g - t) / (Σ_i + eps)`` with sums
  over ``n`` (row step) or ``m`` (column step)."""
  m = len(g)
  if axis_rows:
    out = []
    for a in range(m):
      d = _sum(xi[a]) + eps
      t = _sum([g[a][b] * xi[a][b] for b in range(m)]) / d
      out.append([(g[a][b] - t) / d for b in range(m)])
    return out
  d = [_sum([xi[a][b] for a in range(m)]) + eps for b in range(m)]
  t = [_sum([g[a][b] * xi[a][b] for a in range(m)]) / d[b] for b in range(m)]
  return [[(g[a][b] - t[b]) / d[b] for b in range(m)] for a in range(m)]


MAX_LINEAR_REPEAT = 16  # beyond this the saved iterates (repeat·M² values per thread) would spill heavily


def _bwd_step_rcp(g, xi, eps, axis_rows):
  """:func:`_bwd_step` with the divisions by ``Σ_i + eps`` as multiplies by its reciprocal (computed from
  ``X_i`` alone, off the gradient's dependency chain)."""
  m = len(g)
  if axis_rows:
    out = []
    for a in range(m):
      r = 1.0 / (_sum(xi[a]) + eps)
      t = _sum([g[a][b] * xi[a][b] for b in range(m)]) * r
      out.append([(g[a][b] - t) * r for b in range(m)])
    return out
  r = [1.0 / (_sum([xi[a][b] for a in range(m)]) + eps) for b in range(m)]
  t = [_sum([g[a][b] * xi[a][b] for a in range(m)]) * r[b] for b in range(m)]
  return [[(g[a][b] - t[b]) * r[b] for b in range(m)] for a in range(m)]


def backward(g, e, repeat, eps):
  """Gradient of :func:`forward` w.r.t. ``e`` for the output cotangent ``g`` (docs/mhc.md, "sinkhorn_normalize"): one forward pass
  saving ``X_1`` and the row-step inputs ``X_2q``, then the steps in reverse with reciprocal multiplies
  (module docstring)."""
  if repeat > MAX_LINEAR_REPEAT:
    return backward_recompute(g, e, repeat, eps)
  p = softmax(e)
  x1 = [[v + eps for v in row] for row in p]
  saved = {2: col_norm(x1, eps)}  # saved[2q] = X_2q = the input of row step 2q
  for q in range(2, repeat):
    saved[2 * q] = col_norm(row_norm(saved[2 * q - 2], eps), eps)
  for i in range(2 * repeat - 1, 0, -1):
    if i == 1:
      xi = x1
    elif i % 2:
      xi = row_norm(saved[i - 1], eps)  # X_i, i = 2q + 1: the input of column step i
    else:
      xi = saved[i]
    g = _bwd_step_rcp(g, xi, eps, axis_rows=(i % 2 == 0))
  return _softmax_bwd(g, p)


def _softmax_bwd(g, p):
  m = len(g)
  out = []
  for a in range(m):
    t = _sum([g[a][b] * p[a][b] for b in range(m)])
    out.append([(g[a][b] - t) * p[a][b] for b in range(m)])
  return out


def backward_recompute(g, e, repeat, eps):
  """:func:`backward` without saved iterates: ``X_i`` re-run from ``X_2`` for every step (``O(repeat²)``
  normalisations, few registers); the same values."""
  p = softmax(e)
  x1 = [[v + eps for v in row] for row in p]
  c1 = col_norm(x1, eps)
  for i in range(2 * repeat - 1, 0, -1):
    if i == 1:
      xi = x1
    else:  # i = 2q (input of row step i) or 2q + 1 (input of column step i)
      q = i // 2
      xi = _pairs(c1, q - 1, eps)
      if i % 2:
        xi = row_norm(xi, eps)
    g = _bwd_step(g, xi, eps, axis_rows=(i % 2 == 0))
  return _softmax_bwd(g, p)


def _pad(a, rows):
  return a if a.shape[0] >= rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


@functools.partial(jax.jit, static_argnames=("repeat", "eps", "backward_pass", "recompute", "interpret"))
def sinkhorn_kernel(x, g, *, repeat, eps, backward_pass, recompute=False, interpret=None):
  """``x (T, M, M)`` float32 (``T >= 1``) -> the forward output, or with ``backward_pass`` the gradient for the
  cotangent ``g (T, M, M)`` (``recompute``: the ``O(repeat²)`` form, kept for comparisons)."""
  t, m, _ = x.shape
  lay = _layout(m)
  tp = max(t, ROWS)
  grid = pl.cdiv(tp, ROWS)
  eps = float(np.float32(eps))

  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((tp, m * m), jnp.float32), grid=(grid,),
                     grid_names=("i",), interpret=interpret)
  def kernel(*refs):
    rows = pl.ds(jnp.minimum(lax.axis_index("i") * ROWS, tp - ROWS), ROWS)
    e = _split(plgpu.load(refs[0].at[rows], layout=lay, optimized=False), m, lay)
    if backward_pass:
      gv = _split(plgpu.load(refs[1].at[rows], layout=lay, optimized=False), m, lay)
      out = (backward_recompute if recompute else backward)(gv, e, repeat, eps)
    else:
      out = forward(e, repeat, eps)
    refs[-1][rows] = _join(out, m, lay)

  args = [_pad(x.reshape(t, m * m), ROWS)]
  if backward_pass:
    args.append(_pad(g.reshape(t, m * m), ROWS))
  return kernel(*args)[:t].reshape(t, m, m)

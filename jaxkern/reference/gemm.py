"""``jnp`` references for :mod:`jaxkern.gemm`: FP8 grouped GEMMs on the fused MoE layout.

Numerics (DeepGEMM's recipe, what the kernels compute): every 128-deep K step is one float32 product
``p = Σ_{k in step} f32(x[r, k]) · f32(w[e, n, k])`` (e4m3 products are exact in float32; only the
summation order within a step may differ between backends), promoted into a float32 accumulator as
``acc += p · (sf_x[r, step] · sf_w[e, n // 128, step])`` in step order, then rounded once to the
output dtype. The dots run at ``precision=HIGHEST`` (float32, not TF32, on a GPU).

The references loop over 128-row blocks (``lax.map``), so that no ``(M, N, K/128)`` or per-row
weight gather is materialised; they are the oracle of the tests and the CPU path, not fast code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern.reference import quant as rq
from jaxkern.types import QuantTensor

BLOCK = 128
_HI = lax.Precision.HIGHEST


def x_scales(sf: jax.Array, m: int, kb: int, *, x_use_tma_aligned_col_major_sf: bool = False):
  """Per-token sf of ``x`` in layout A / B / C -> the logical ``(M, K/128)`` float32 matrix."""
  return rq.sf_to_float(sf, m, kb, use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)


def _block_products(xb, wb, sx, sw):
  """One 128-row block: ``xb (128, K)``, ``wb (N, K)``, ``sx (128, Kb)``, ``sw (N/128, Kb)`` -> ``(128, N)``
  float32, promoted per K step in step order."""
  n, k = wb.shape
  kb = k // BLOCK
  xs = xb.astype(jnp.float32).reshape(BLOCK, kb, BLOCK)
  ws = wb.astype(jnp.float32).reshape(n, kb, BLOCK)
  swn = jnp.repeat(sw, BLOCK, axis=0)  # (N, Kb)

  def step(acc, b):
    p = jnp.dot(xs[:, b], ws[:, b].T, precision=_HI, preferred_element_type=jnp.float32)
    return acc + p * (sx[:, b][:, None] * swn[:, b][None, :]), None

  acc, _ = lax.scan(step, jnp.zeros((BLOCK, n), jnp.float32), jnp.arange(kb))
  return acc


def fp8_grouped_gemm(x: QuantTensor | tuple[jax.Array, jax.Array], w: QuantTensor | tuple[jax.Array, jax.Array],
                     block_expert: jax.Array, *, out_dtype: jax.typing.DTypeLike = jnp.bfloat16,
                     x_use_tma_aligned_col_major_sf: bool = False):
  """Reference of :func:`jaxkern.gemm.fp8_grouped_gemm`: ``out[r] = x[r] · w[e]ᵀ`` with the DeepGEMM
  promotion (module docstring), ``e = block_expert[r // 128]``; rows of a block whose id is outside
  ``[0, G)`` are zero."""
  xq, xsf = x
  wq, wsf = w
  m, k = xq.shape
  g, n, _ = wq.shape
  kb = k // BLOCK
  if m == 0:
    return jnp.zeros((0, n), out_dtype)
  sx = x_scales(xsf, m, kb, x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)
  be = block_expert.astype(jnp.int32)
  valid = (be >= 0) & (be < g)
  e = jnp.where(valid, be, 0)

  def block(args):
    xb, sxb, eb, ok = args
    out = _block_products(xb, wq[eb], sxb, wsf[eb])
    return jnp.where(ok, out, 0.0)

  out = lax.map(block, (xq.reshape(m // BLOCK, BLOCK, k), sx.reshape(m // BLOCK, BLOCK, kb), e, valid))
  return out.reshape(m, n).astype(out_dtype)


def dequantized_product(x: QuantTensor | tuple[jax.Array, jax.Array], w: QuantTensor | tuple[jax.Array, jax.Array],
                        block_expert: jax.Array, *, x_use_tma_aligned_col_major_sf: bool = False):
  """The float32 product of the dequantised inputs (``f32(q) · sf`` expanded per element), per block's
  expert: the accuracy yardstick of the GPU tests (≤ 0.5% max-relative). Zero rows for
  skipped blocks."""
  xq, xsf = x
  wq, wsf = w
  m, k = xq.shape
  g, n, _ = wq.shape
  sx = x_scales(xsf, m, k // BLOCK, x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)
  xd = xq.astype(jnp.float32) * jnp.repeat(sx, BLOCK, axis=1)
  be = block_expert.astype(jnp.int32)
  valid = (be >= 0) & (be < g)
  e = jnp.where(valid, be, 0)

  def block(args):
    xb, eb, ok = args
    wd = wq[eb].astype(jnp.float32) * jnp.repeat(jnp.repeat(wsf[eb], BLOCK, axis=0), BLOCK, axis=1)
    return jnp.where(ok, jnp.dot(xb, wd.T, precision=_HI), 0.0)

  return lax.map(block, (xd.reshape(m // BLOCK, BLOCK, k), e, valid)).reshape(m, n)


def fp8_grouped_gemm_input_grad(dy: QuantTensor | tuple[jax.Array, jax.Array],
                                w: QuantTensor | tuple[jax.Array, jax.Array], block_expert: jax.Array, *,
                                out_dtype: jax.typing.DTypeLike = jnp.bfloat16,
                                x_use_tma_aligned_col_major_sf: bool = False):
  """Reference of :func:`jaxkern.gemm.fp8_grouped_gemm_input_grad`: :func:`fp8_grouped_gemm` of ``dy`` ``(M, N)``
  with the weights transposed to ``(G, K, N)`` (sf ``(G, K/128, N/128)``): promotion per 128-deep step of N."""
  wq, wsf = w
  wt = (jnp.swapaxes(wq, 1, 2), jnp.swapaxes(wsf, 1, 2))
  return fp8_grouped_gemm(dy, wt, block_expert, out_dtype=out_dtype,
                          x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)


def fp8_grouped_gemm_weight_grad(dy_t: QuantTensor | tuple[jax.Array, jax.Array],
                                 x_t: QuantTensor | tuple[jax.Array, jax.Array], block_expert: jax.Array, *,
                                 num_experts: int, out_dtype: jax.typing.DTypeLike = jnp.float32):
  """Reference of :func:`jaxkern.gemm.fp8_grouped_gemm_weight_grad`: ``dw[e] += (dy_bᵀ x_b) · (sf_dy[b, n] ·
  sf_x[b, k])`` for every 128-row block ``b`` of expert ``e`` in block order (float32 products, promoted per
  block); blocks with ids outside ``[0, G)`` skipped. Returns ``(G, N, K)`` ``out_dtype`` (the float32 sums
  rounded once)."""
  dq, dsf = dy_t
  xq, xsf = x_t
  n, m = dq.shape
  k = xq.shape[0]
  g = num_experts
  dw = jnp.zeros((g, n, k), jnp.float32)
  if m == 0:
    return dw.astype(out_dtype)
  be = block_expert.astype(jnp.int32)

  def step(b, dw):
    rows = b * BLOCK
    d = lax.dynamic_slice_in_dim(dq, rows, BLOCK, axis=1).astype(jnp.float32)
    x = lax.dynamic_slice_in_dim(xq, rows, BLOCK, axis=1).astype(jnp.float32)
    p = jnp.dot(d, x.T, precision=_HI, preferred_element_type=jnp.float32)
    e = be[b]
    ok = (e >= 0) & (e < g)
    ec = jnp.where(ok, e, 0)
    upd = dw[ec] + p * (dsf[b][:, None] * xsf[b][None, :])
    return dw.at[ec].set(jnp.where(ok, upd, dw[ec]))

  return lax.fori_loop(0, m // BLOCK, step, dw).astype(out_dtype)


def transpose_weights(w: QuantTensor | tuple[jax.Array, jax.Array]) -> QuantTensor:
  """Reference of :func:`jaxkern.gemm.transpose_weights`: ``(G, N, K)`` data and ``(G, N/128, K/128)`` sf with
  their last two axes swapped."""
  wq, wsf = w
  return QuantTensor(jnp.swapaxes(wq, 1, 2), jnp.swapaxes(wsf, 1, 2))

"""Dequantisation: ``cast_back``, ``per_token_cast_back`` and ``unpack_from_e2m1fn_x2`` (quant.md §9).

``out = RN(f32(q) · sf)`` in float32, then one rounding to bf16 for ``fmt="bf16"``.

Mosaic GPU kernel for e4m3 data with block widths 16, 32, 64, 128 or the whole row (any block
height): each CTA dequantises one ``(64, 256)`` tile (TMA in, WGMMA-layout registers, TMA out; the
boxes clip at the array edges). The wrapper decodes the sf (any layout) into a float32
``(groups, rows)`` matrix with one value per row and group, which the kernel reads as row vectors.
Row counts that are not multiples of 8 are padded (TMA granularity of the tiled SMEM). Packed e2m1
data and other block widths (e.g. per-channel ``(128, 1)``) run the ``jnp`` reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkern import _checks, _config
from jaxkern.quant import common
from jaxkern.quant.per_token_cast import BM, FP8_TRANSFORMS, ROW_ALIGN, TILE, group_select
from jaxkern.reference import quant as ref

KERNEL_BLOCK_WIDTHS = (16, 32, 64, 128)


@functools.partial(jax.jit, static_argnames=("gw", "out_dtype", "interpret"))
def _kernel(q, sfr, *, gw, out_dtype, interpret):
  """``q`` ``(M, K)`` e4m3 (``M % 8 == 0``), ``sfr`` ``(G, Mb·64)`` float32 -> ``(M, K)`` ``out_dtype``."""
  m, k = q.shape
  t = TILE if gw <= TILE else min(TILE, k)
  kt = ref.cdiv(k, t)
  gpt = t // gw if gw <= TILE else 1
  cw = max(min(gw, t), 64)
  nsub = cw // min(gw, t)

  @functools.partial(
      plgpu.kernel, out_type=jax.ShapeDtypeStruct((m, k), out_dtype), grid=(ref.cdiv(m, BM), kt),
      grid_names=("i", "j"), interpret=interpret,
      scratch_types=dict(q_s=plgpu.SMEM((BM, t), q.dtype, transforms=FP8_TRANSFORMS),
                         o_s=plgpu.SMEM((BM, t), out_dtype), bar=plgpu.Barrier(num_arrivals=1)))
  def kernel(q_g, sf_g, o_g, q_s, o_s, bar):
    i, j = lax.axis_index("i"), lax.axis_index("j")
    rows = pl.ds(i * BM, BM)
    plgpu.copy_gmem_to_smem(q_g.at[rows, pl.ds(j * t, t)], q_s, bar)
    plgpu.barrier_wait(bar)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    if gw > TILE:
      sfs = [plgpu.load(sf_g.at[0, rows], layout=row_layout, optimized=False)]
    else:
      sfs = [plgpu.load(sf_g.at[j * gpt + g, rows], layout=row_layout, optimized=False) for g in range(gpt)]
    for c in range(t // cw):
      v = plgpu.load(q_s.at[:, pl.ds(c * cw, cw)], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      sf = group_select(sfs[c * nsub:(c + 1) * nsub] if gw <= TILE else sfs, cw)
      o_s.at[:, pl.ds(c * cw, cw)][...] = (v * sf).astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[rows, pl.ds(j * t, t)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return kernel(q, sfr)


def _run_kernel(x, out_dtype, block_size, impl, col_major):
  q, sf = x
  m, k = q.shape
  bm, bk = block_size
  gw = k if bk >= k else bk
  s = ref.sf_to_float(sf, ref.cdiv(m, bm), ref.cdiv(k, bk), use_tma_aligned_col_major_sf=col_major)
  s = jnp.repeat(s, bm, axis=0)[:m].T  # (Kb, M): one value per row and group
  ng = 1 if gw > TILE else ref.cdiv(k, TILE) * (TILE // gw)
  s = jnp.pad(s, ((0, ng - s.shape[0]), (0, ref.cdiv(m, BM) * BM - m)))
  mp = ref.cdiv(m, ROW_ALIGN) * ROW_ALIGN
  qp = jnp.pad(q, ((0, mp - m), (0, 0))) if mp != m else q
  out = _kernel(qp, s, gw=gw, out_dtype=out_dtype, interpret=_config.mosaic_interpret(impl))
  return out[:m] if mp != m else out


def cast_back(x, fmt: str, x_block_size, x_special_fmt=None, *, x_use_tma_aligned_col_major_sf: bool = False,
              implementation: str | None = None):
  """Dequantises a QuantTensor ``(q, sf)`` with blocks ``x_block_size``.

  Args:
    x: ``q`` float8_e4m3fn ``(M, K)`` or int8 packed e2m1 ``(M, K/2)`` (logical ``K % 64 == 0``), and
      ``sf`` in layout A (float32), B (float32 with ``x_use_tma_aligned_col_major_sf``) or C (int32).
    fmt: ``"bf16"`` or ``"fp32"``, the output dtype.
    x_block_size: ``(bm, bk)``, any positive sizes.
    x_special_fmt: must be None (E5M6 is not part of this module).

  Returns:
    ``(M, K)`` bfloat16 or float32.
  """
  if x_special_fmt is not None:
    raise ValueError(f"x_special_fmt must be None, got {x_special_fmt!r}")
  k = common.check_quant_tensor("x", x, x_block_size, col_major=x_use_tma_aligned_col_major_sf)
  if k % 64:
    raise ValueError(f"x[0] must have a logical width K % 64 == 0, got K={k}")
  common.check_fmt(fmt, ("bf16", "fp32"))
  impl = _config.get_implementation(implementation)
  q = x[0]
  if (impl != "reference" and q.shape[0] and q.dtype == jnp.float8_e4m3fn
      and (x_block_size[1] in KERNEL_BLOCK_WIDTHS or x_block_size[1] >= k)):
    out_dtype = jnp.bfloat16 if fmt == "bf16" else jnp.float32
    return _run_kernel(x, out_dtype, tuple(x_block_size), impl, x_use_tma_aligned_col_major_sf)
  return ref.cast_back(x, fmt, tuple(x_block_size), x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)


def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt=None, *,
                        x_use_tma_aligned_col_major_sf: bool = False, implementation: str | None = None):
  """:func:`cast_back` with blocks ``(1, num_per_channels)``."""
  return cast_back(x, fmt, (1, num_per_channels), x_special_fmt,
                   x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf, implementation=implementation)


def unpack_from_e2m1fn_x2(x, out_dtype=jnp.float32):
  """Decodes packed e2m1 bytes ``(..., L)`` (int8 / uint8, rank ≥ 1) to ``(..., 2L)`` of ``out_dtype``;
  element ``2j`` is the low nibble of byte ``j``."""
  if x.ndim < 1:
    raise ValueError("x must have rank >= 1")
  _checks.check_dtype("x", x, (jnp.int8, jnp.uint8))
  return ref.unpack_from_e2m1fn_x2(x, out_dtype)

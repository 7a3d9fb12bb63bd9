"""Per-block casts (``bm × bk`` blocks, ``bm, bk ∈ {32, 128}``) and the lossless FP4 -> FP8 re-quantisation.

Mosaic GPU kernel for e4m3 (``per_block_cast*``): each CTA owns ``max(bm, 64)`` rows and 256 (128
for ``bm = 128``) columns, brought in by one TMA box (clipped and zero-filled at the array edges).
Each 64-row half is loaded in the WGMMA layout; a row reduction gives the amax of each row within a
block column, and a reduction across the rows of the resulting vector (masked to 32-row halves for
``bm = 32``) gives the block amax. The kernel writes one sf per row and block column, float32
``(groups, rows)``; the wrapper keeps every ``bm``-th row and formats the layout. Divisions as in
:mod:`jaxkern.quant.per_token_cast`. Row counts that are not multiples of 8 are padded with zero
rows (TMA granularity), which never change a block amax.

FP4 e2m1 and ``per_block_cast_lossless`` run the ``jnp`` reference (:mod:`jaxkern.reference.quant`).
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
from jaxkern.quant.per_token_cast import BM, FP8_TRANSFORMS, ROW_ALIGN, group_select
from jaxkern.reference import quant as ref

BLOCK_SIDES = (32, 128)


def _tile(bm: int) -> tuple[int, int]:
  return max(bm, BM), (128 if bm == 128 else 256)


@functools.partial(jax.jit, static_argnames=("block_size", "round_sf", "write_data", "compute_sf", "interpret"))
def _kernel(x, sf_in, *, block_size, round_sf, write_data, compute_sf, interpret):
  """``x`` ``(M, K)``, ``M % 8 == 0``; ``sf_in`` per-row precomputed sf ``(G, Mr)`` or None.

  Returns ``(out (M, K) e4m3 | None, sf (G, Mr) float32 | None)``, one sf per row and block column
  (``Mr`` = rows rounded up to the CTA height, ``G ≥ ceil(K / bk)``).
  """
  m, k = x.shape
  bm, bk = block_size
  r, t = _tile(bm)
  mt, kt = ref.cdiv(m, r), ref.cdiv(k, t)
  gpt = t // bk
  cw = max(bk, 64)
  nsub = cw // bk
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  out_type = []
  if write_data:
    out_type.append(jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn))
  if compute_sf:
    out_type.append(jax.ShapeDtypeStruct((kt * gpt, mt * r), jnp.float32))
  scratch = dict(x_s=plgpu.SMEM((r, t), x.dtype), bar=plgpu.Barrier(num_arrivals=1))
  if write_data:
    scratch["o_s"] = plgpu.SMEM((r, t), jnp.float8_e4m3fn, transforms=FP8_TRANSFORMS)

  @functools.partial(plgpu.kernel, out_type=tuple(out_type), grid=(mt, kt), grid_names=("i", "j"),
                     scratch_types=scratch, interpret=interpret)
  def kernel(*refs, x_s, bar, o_s=None):
    x_g, c_g, *rest = refs
    sfin_g = rest.pop(0) if sf_in is not None else None
    o_g = rest.pop(0) if write_data else None
    sf_g = rest.pop(0) if compute_sf else None
    i, j = lax.axis_index("i"), lax.axis_index("j")
    plgpu.copy_gmem_to_smem(x_g.at[pl.ds(i * r, r), pl.ds(j * t, t)], x_s, bar)
    plgpu.barrier_wait(bar)
    halves = r // BM

    def chunk(h, c):
      return plgpu.load(x_s.at[pl.ds(h * BM, BM), pl.ds(c * cw, cw)], layout=plgpu.Layout.WGMMA).astype(jnp.float32)

    def rows(h):
      return pl.ds(i * r + h * BM, BM)

    if sf_in is not None:
      invs = [[common.exact_div(1.0, plgpu.load(sfin_g.at[j * gpt + g, rows(h)], layout=row_layout, optimized=False))
               for g in range(gpt)] for h in range(halves)]
    else:
      maxv = plgpu.load(c_g, layout=row_layout, optimized=False)
      col = plgpu.broadcasted_iota(jnp.int32, (BM, cw), 1, layout=plgpu.Layout.WGMMA) // bk
      row = plgpu.broadcasted_iota(jnp.int32, (BM,), 0, layout=row_layout)
      row_max = [[], []]
      for h in range(halves):
        for c in range(t // cw):
          a = jnp.abs(chunk(h, c))
          row_max[h] += [jnp.max(a if nsub == 1 else jnp.where(col == s, a, 0.0), axis=1) for s in range(nsub)]
      invs = [[], []]
      for g in range(gpt):
        if bm == 128:
          a = jnp.max(jnp.maximum(row_max[0][g], row_max[1][g]), axis=0)
          blk = [jnp.where(row < BM, a, 0.0)] * 2  # the scalar broadcast back to a row vector
        else:
          rm = row_max[0][g]
          lo = jnp.max(jnp.where(row < 32, rm, 0.0), axis=0)
          hi = jnp.max(jnp.where(row >= 32, rm, 0.0), axis=0)
          blk = [jnp.where(row < 32, lo, hi)]
        for h in range(halves):
          sf, inv = ref.scale_factors(blk[h], maxv, "e4m3", round_sf, div=common.exact_div)
          invs[h].append(inv)
          if compute_sf:
            sf_g[j * gpt + g, rows(h)] = sf
    if write_data:
      for h in range(halves):
        for c in range(t // cw):
          inv = group_select(invs[h][c * nsub:(c + 1) * nsub], cw)
          o_s.at[pl.ds(h * BM, BM), pl.ds(c * cw, cw)][...] = ref.encode_e4m3(chunk(h, c) * inv)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_g.at[pl.ds(i * r, r), pl.ds(j * t, t)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  consts = jnp.full((BM,), ref.FP8_MAX, jnp.float32)
  outs = list(kernel(*((x, consts) if sf_in is None else (x, consts, sf_in))))
  return (outs.pop(0) if write_data else None), (outs.pop(0) if compute_sf else None)


def _run_kernel(x, block_size, impl, *, sf_in=None, round_sf=False, write_data=True, compute_sf=True):
  """Pads rows to a multiple of 8 if needed, runs the kernel, returns ``(out, sf (Mb, Kb))``."""
  m, k = x.shape
  bm, bk = block_size
  r, t = _tile(bm)
  mp = ref.cdiv(m, ROW_ALIGN) * ROW_ALIGN
  xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
  if sf_in is not None:
    s = jnp.repeat(sf_in, bm, axis=0).T
    ng = ref.cdiv(k, t) * (t // bk)
    sf_in = jnp.pad(s, ((0, ng - s.shape[0]), (0, ref.cdiv(m, r) * r - s.shape[1])), constant_values=1.0)
  out, sf = _kernel(xp, sf_in, block_size=block_size, round_sf=round_sf, write_data=write_data,
                    compute_sf=compute_sf, interpret=_config.mosaic_interpret(impl))
  if out is not None and mp != m:
    out = out[:m]
  if sf is not None:
    sf = sf[:ref.cdiv(k, bk), :m:bm].T
  return out, sf


def _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0):
  if isinstance(x, tuple):
    raise ValueError("x must be a plain (M, K) array (no QuantTensor input for per-block casts)")
  _checks.check_rank("x", x, 2)
  _checks.check_dtype("x", x, (jnp.bfloat16, jnp.float32))
  _checks.check_multiple("x", x, 1, 64)
  common.check_fmt(fmt)
  if len(block_size) != 2 or any(b not in BLOCK_SIDES for b in block_size):
    raise ValueError(f"block_size must be (bm, bk) with bm, bk in {BLOCK_SIDES}, got {block_size}")
  common.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)


def per_block_cast(x, fmt: str, block_size, use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                   use_packed_ue8m0: bool = False, *, implementation: str | None = None):
  """Blockwise cast of ``x`` ``(M, K)`` bf16 / float32 (``K % 64 == 0``) to e4m3 or packed e2m1.

  Returns ``(out, out_sf)``: ``out`` ``(M, K)`` float8_e4m3fn or ``(M, K/2)`` int8; ``out_sf`` for
  ``(ceil(M/bm), ceil(K/bk))`` blocks in layout A / B / C (:mod:`jaxkern.reference.quant`).
  """
  _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or x.shape[0] == 0 or fmt != "e4m3":
    return ref.cast(x, fmt, tuple(block_size), round_sf=round_sf,
                    use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)
  out, sf = _run_kernel(x, tuple(block_size), impl, round_sf=round_sf)
  return out, ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_block_cast_with_sf_only(x, fmt: str, block_size, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                                implementation: str | None = None):
  """The ``out_sf`` of :func:`per_block_cast`, without writing the data."""
  _check(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or x.shape[0] == 0 or fmt != "e4m3":
    return ref.cast(x, fmt, tuple(block_size), round_sf=round_sf, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                    use_packed_ue8m0=use_packed_ue8m0)[1]
  _, sf = _run_kernel(x, tuple(block_size), impl, round_sf=round_sf, write_data=False)
  return ref.format_sf(sf, use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_block_cast_with_precomputed_sf(x, fmt: str, block_size, sf, use_tma_aligned_col_major_sf: bool = False,
                                       round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                                       implementation: str | None = None):
  """Quantises with a caller-given layout-A float32 ``sf`` ``(Mb, Kb)`` (``sf_inv = 1/sf``); returns ``out``."""
  _check(x, fmt, block_size, False, False, False)
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    raise ValueError("use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False with a precomputed sf")
  m, k = x.shape
  common.check_sf("sf", sf, (ref.cdiv(m, block_size[0]), ref.cdiv(k, block_size[1])), jnp.float32)
  impl = _config.get_implementation(implementation)
  if impl == "reference" or m == 0 or fmt != "e4m3":
    return ref.cast(x, fmt, tuple(block_size), sf=sf)
  out, _ = _run_kernel(x, tuple(block_size), impl, sf_in=sf, compute_sf=False)
  return out


def per_block_cast_lossless(x, fmt: str, x_block_size, out_block_size, use_tma_aligned_col_major_sf: bool = False,
                            round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                            x_use_tma_aligned_col_major_sf: bool = False, implementation: str | None = None):
  """Exact re-quantisation of a packed-e2m1 QuantTensor (power-of-two sf) into e4m3 with larger blocks.

  Precondition (not checked inside ``jit``): within one output block the input sf span at most 2^11;
  otherwise the values round or flush in the e4m3 conversion. ``round_sf`` has no effect. Returns
  ``(out (M, K) e4m3, out_sf)`` for blocks ``out_block_size`` in the layout of the flags.
  """
  k = common.check_quant_tensor("x", x, x_block_size, col_major=x_use_tma_aligned_col_major_sf)
  if x[0].dtype == jnp.float8_e4m3fn:
    raise ValueError("x[0] must be packed e2m1 (int8)")
  if k % 32:
    raise ValueError(f"x[0] must have a logical width K % 32 == 0, got K={k}")
  common.check_fmt(fmt, ("e4m3",))
  common.check_sf_flags(use_tma_aligned_col_major_sf, True, use_packed_ue8m0)
  (ibm, ibk), (obm, obk) = x_block_size, out_block_size
  if ibk & (ibk - 1) or obk & (obk - 1) or obm % ibm or obk % ibk:
    raise ValueError(f"out_block_size {out_block_size} must be a multiple of x_block_size {x_block_size} "
                     "with power-of-two widths")
  _config.get_implementation(implementation)
  return ref.per_block_cast_lossless(x, tuple(x_block_size), tuple(out_block_size),
                                     use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                                     use_packed_ue8m0=use_packed_ue8m0,
                                     x_use_tma_aligned_col_major_sf=x_use_tma_aligned_col_major_sf)

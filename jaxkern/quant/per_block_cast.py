"""Per-block casts (``bm × bk`` blocks, ``bm, bk ∈ {32, 128}``) and the lossless FP4 -> FP8 re-quantisation.

No Pallas kernel yet: every implementation runs the ``jnp`` reference (:mod:`jaxkern.reference.quant`),
which follows the spec bit for bit (quant.md §6).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkern import _checks, _config
from jaxkern.quant import common
from jaxkern.reference import quant as ref

BLOCK_SIDES = (32, 128)


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
  _config.get_implementation(implementation)
  return ref.cast(x, fmt, tuple(block_size), round_sf=round_sf,
                  use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, use_packed_ue8m0=use_packed_ue8m0)


def per_block_cast_with_sf_only(x, fmt: str, block_size, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                                implementation: str | None = None):
  """The ``out_sf`` of :func:`per_block_cast`."""
  return per_block_cast(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
                        implementation=implementation)[1]


def per_block_cast_with_precomputed_sf(x, fmt: str, block_size, sf, use_tma_aligned_col_major_sf: bool = False,
                                       round_sf: bool = False, use_packed_ue8m0: bool = False, *,
                                       implementation: str | None = None):
  """Quantises with a caller-given layout-A float32 ``sf`` ``(Mb, Kb)`` (``sf_inv = 1/sf``); returns ``out``."""
  _check(x, fmt, block_size, False, False, False)
  if use_tma_aligned_col_major_sf or use_packed_ue8m0:
    raise ValueError("use_tma_aligned_col_major_sf / use_packed_ue8m0 must be False with a precomputed sf")
  m, k = x.shape
  common.check_sf("sf", sf, (ref.cdiv(m, block_size[0]), ref.cdiv(k, block_size[1])), jnp.float32)
  _config.get_implementation(implementation)
  return ref.cast(x, fmt, tuple(block_size), sf=sf)


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

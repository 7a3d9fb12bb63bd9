"""Dequantisation: ``cast_back``, ``per_token_cast_back`` and ``unpack_from_e2m1fn_x2`` (quant.md §9).

No Pallas kernel yet: every implementation runs the ``jnp`` reference (:mod:`jaxkern.reference.quant`);
``out = RN(f32(q) · sf)`` in float32, then one rounding to bf16 for ``fmt="bf16"``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkern import _checks, _config
from jaxkern.quant import common
from jaxkern.reference import quant as ref


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
  _config.get_implementation(implementation)
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
